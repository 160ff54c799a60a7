// `moeverify fuzz --impl CMD` (docs/guide.md "Fuzz your own implementation"):
// the fuzz's configurations, drawn inside a profile, exported with export's
// code, handed to the user's implementation, judged with check's code, and
// every failure shrunk with the fuzz's own reductions by running the
// implementation again.
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <mutex>
#include <regex>
#include <set>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>

#include "dump.h"
#include "error.h"
#include "export_check.h"
#include "fuzz.h"
#include "fuzz_shrink.h"
#include "golden.h"
#include "profile.h"
#include "random_case.h"
#include "subprocess.h"

namespace moev {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// The last `n` non-empty lines of `text`.
std::string last_lines(const std::string& text, int n) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (l.find_first_not_of(" \t\r") != std::string::npos) lines.push_back(l);
  std::string out;
  for (size_t i = lines.size() > size_t(n) ? lines.size() - size_t(n) : 0; i < lines.size(); ++i)
    out += (out.empty() ? "" : "\n") + lines[i];
  return out;
}

/// What kind of failure an implementation's last words name, so that two
/// different crashes are two failures (each shrunk and saved), not one: the
/// last exception name in its last line ("ValueError", "KeyError" in
/// Python's "my_moe.py: FOLDER: KeyError: 7"), else that line with its case
/// folder written {case} and its digits blanked (indices, sizes and
/// addresses vary from one configuration to the next), at most 80
/// characters.
std::string crash_kind(const std::string& last_line, const std::string& folder) {
  static const std::regex exception_name(R"([A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Exit|Interrupt|Fault)\b)");
  std::string name;
  for (auto m = std::sregex_iterator(last_line.begin(), last_line.end(), exception_name); m != std::sregex_iterator(); ++m)
    name = m->str();
  if (!name.empty()) return name;
  std::string line = last_line;
  for (size_t p; !folder.empty() && (p = line.find(folder)) != std::string::npos;) line.replace(p, folder.size(), "{case}");
  std::string k;
  for (char ch : line.substr(0, 80)) k += std::isdigit(static_cast<unsigned char>(ch)) ? '#' : ch;
  return k;
}

/// What one run of the implementation on one configuration gave.
struct ImplRun {
  enum class Kind { judged, skipped, crashed } kind = Kind::judged;
  Verdict v;             // judged: check's verdict; crashed: ERROR at impl/crash or impl/timeout
  std::string reason;    // skipped: the implementation's reason
  std::string err_tail;  // what it wrote to stderr
  std::map<std::string, std::pair<bool, bool>> stages;  // judged: slot -> (judged, INCORRECT)
  bool accepted_ties = false;  // judged: it broke an exact tie otherwise than the lowest id (accepted)
};

/// A file's bytes; for a file that cannot be read, a text no file holds
/// (a NUL first), so that it differs from any file's bytes.
std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::string("\0unreadable", 11);
  std::ostringstream b;
  b << f.rdbuf();
  return b.str();
}

/// One job: runs the implementation (its own worker process in worker mode)
/// on exported case folders under `root`.
class ImplJob {
 public:
  ImplJob(const ImplOptions& impl, std::string root) : impl_(impl), root_(std::move(root)), worker_(impl.cmd) {}

  /// Exports `yaml` into root/tag, runs the implementation, judges it.
  ImplRun run(const std::string& yaml, const std::string& tag) {
    const std::string folder = root_ + "/" + tag;
    ImplRun r;
    try {
      r = run_in(yaml, folder);
    } catch (const std::exception& e) {  // moeverify's own side (export, check) failed: an ERROR, not a crash of yours
      r = ImplRun{};
      r.v = Verdict{Outcome::ERROR, "moeverify/-/-", "moeverify/-", std::string("moeverify failed: ") + e.what()};
    }
    if (!impl_.keep) {
      std::error_code ec;
      std::filesystem::remove_all(folder, ec);  // links inside are removed, never followed
    }
    return r;
  }

 private:
  ImplRun run_in(const std::string& yaml, const std::string& folder) {
    ImplRun r;
    export_case_folder(load_one_case(yaml, "fuzz"), folder);
    // The configuration is judged from the folder's manifest: one the
    // implementation rewrote (its conventions changed to fit its outputs)
    // would judge it on another contract. The inputs need no such guard:
    // check generates them anew from the manifest.
    const std::string manifest = folder + "/manifest.json", drawn = file_bytes(manifest);
    std::string answer;
    ProcEnd end;
    bool ok = false;
    if (impl_.worker) {
      ok = worker_.request(folder, impl_.timeout_s, answer, end);
      r.err_tail = end.err_tail;
      if (!worker_.unrequested().empty())
        return crashed(r, "impl/protocol", "the worker wrote '" + printable(worker_.unrequested(), 200) +
                                               "' on stdout beyond its one answer line per folder (a second answer?): "
                                               "each folder gets exactly one line, done, skip REASON or error REASON, "
                                               "and nothing else on stdout (docs/guide.md); the worker was restarted");
      if (ok && answer.rfind("skip", 0) == 0) return skipped(r, answer.size() > 5 ? answer.substr(5) : "");
      if (ok && answer.rfind("error", 0) == 0) {
        const std::string why = answer.size() > 6 ? answer.substr(6) : "";
        return crashed(r, "impl/error", "the implementation raised: " + why, crash_kind(why, folder), folder);
      }
      if (ok && answer != "done")
        return crashed(r, "impl/protocol",
                       "the worker answered '" + printable(answer, 200) +
                           "'; valid answers: done, skip REASON, error REASON (docs/guide.md)" +
                           (worker_.started_by_last_request()
                                ? "; it was the new worker's first line: printed at start-up? a worker writes only "
                                  "its answer lines on stdout, anything else on stderr"
                                : ""));
    } else {
      std::string cmd = impl_.cmd;
      for (size_t p; (p = cmd.find("{case}")) != std::string::npos;) cmd.replace(p, 6, shell_quote(folder));
      end = run_command(cmd, impl_.timeout_s);
      r.err_tail = end.err_tail;
      ok = end.how == ProcEnd::How::exited && end.code == 0;
      if (end.how == ProcEnd::How::exited && end.code == 77)
        return skipped(r, last_lines(end.err_tail.empty() ? end.out_tail : end.err_tail, 1));
    }
    if (!ok) {
      const bool hung = end.how == ProcEnd::How::timed_out;
      const std::string last = last_lines(end.err_tail, 1);
      // a timeout is one kind whatever it printed; a crash is told apart by
      // its last words, or else by how it ended (an exit status, a signal)
      const std::string kind =
          hung ? "" : !last.empty() ? crash_kind(last, folder) : end.describe(impl_.timeout_s, "--impl-timeout");
      return crashed(r, hung ? "impl/timeout" : "impl/crash",
                     "the implementation crashed: " + end.describe(impl_.timeout_s, "--impl-timeout") +
                         (last.empty() ? "" : "; its last stderr line: " + printable(last, 300)),
                     kind, folder);
    }
    if (file_bytes(manifest) != drawn)
      return crashed(r, "impl/manifest", "the implementation changed or removed " + manifest +
                                             ", the configuration it is judged on; an implementation writes under "
                                             "actual/ only (docs/guide.md)");
    judge(folder, r);
    return r;
  }

  static ImplRun& skipped(ImplRun& r, const std::string& why) {
    r.kind = ImplRun::Kind::skipped;
    r.reason = why.empty() ? "(no reason given)" : printable(why, 160);
    return r;
  }

  /// A crash, `kind` telling it from other crashes of the same check. With
  /// `folder`, what the implementation wrote before it ended is judged, and
  /// the first stage already wrong is added to the note: often the crash's
  /// cause (a wrong offset, then an index past a buffer). Shrinking keeps to
  /// the kind and that stage (a smaller configuration that crashes alike
  /// but writes nothing wrong first would lose the cause).
  ImplRun& crashed(ImplRun& r, const std::string& check, const std::string& note, const std::string& kind = "",
                   const std::string& folder = "") {
    r.kind = ImplRun::Kind::crashed;
    r.v = Verdict{Outcome::ERROR, check, kind.empty() ? check : check + ": " + printable(kind, 80), note};
    if (folder.empty()) return r;
    const Verdict before = wrong_before_crash(folder);
    if (before.check.empty()) return r;
    r.v.key += "; after " + before.key;
    r.v.note += "; before it ended, it wrote INCORRECT outputs: " + before.check + ": " + before.note.substr(0, 400);
    return r;
  }

  /// The verdict on the first written tensor that is wrong (its check
  /// empty when there is none: an unwritten one is the crash itself, not
  /// its cause).
  Verdict wrong_before_crash(const std::string& folder) const {
    try {
      if (!golden::is_dir(folder + "/actual")) return {};
      const CaseReport rep = check_case_folder(folder, folder + "/actual", check_args());
      for (const Check& ch : rep.checks) {
        if (ch.variant != "actual" || ch.outcome != Outcome::INCORRECT || ch.absent || !ch.consequence_of.empty())
          continue;
        CaseReport one;
        one.outcome = Outcome::INCORRECT;
        one.checks.push_back(ch);
        return verdict_of(one, "yours");
      }
    } catch (const std::exception&) {  // files check refuses: the crash says enough
    }
    return {};
  }

  CheckArgs check_args() const {
    CheckArgs a;
    a.external.strict_ties = impl_.strict_ties;
    if (!impl_.require.empty()) parse_require(impl_.require, a.external);
    return a;
  }

  void judge(const std::string& folder, ImplRun& r) const {
    const CheckArgs a = check_args();
    try {
      const CaseReport rep = check_case_folder(folder, folder + "/actual", a);
      r.v = verdict_of(rep, "yours");
      r.accepted_ties = rep.accepted_ties > 0;
      if (!rep.bad_input.empty()) r.v = Verdict{Outcome::ERROR, "check/files", "check/files", rep.bad_input};
      for (const Check& ch : rep.checks) {
        if (ch.variant != "actual" || ch.tensor == "-") continue;
        auto& s = r.stages[ch.slot];
        s.first = true;
        // a consequence of an earlier stage's failure is not this stage's
        s.second = s.second || (ch.outcome == Outcome::INCORRECT && ch.consequence_of.empty());
      }
    } catch (const Error& e) {  // a file check refuses (unknown name, wrong dtype or columns)
      r.v = Verdict{Outcome::ERROR, "check/files", "check/files", e.what()};
    }
  }

  const ImplOptions& impl_;
  std::string root_;
  Worker worker_;
};

/// The folder of the temporary case folders: a new one under $TMPDIR (or /tmp).
std::string make_work_dir() {
  const char* t = getenv("TMPDIR");
  std::string tmpl = std::string(t && *t ? t : "/tmp") + "/moeverify-fuzz-XXXXXX";
  if (!mkdtemp(tmpl.data())) bad_input("fuzz --impl: cannot make a temporary folder " + tmpl + "; valid: TMPDIR names a writable folder");
  return tmpl;
}

/// The command line that reproduces a failure from its case file: export,
/// the implementation (under `timeout` where it hung), then check, which
/// runs whatever the implementation's exit status (after a crash it judges
/// what was written before it); the line's exit status is check's.
std::string repro_line(const ImplOptions& impl, const std::string& file, const std::string& name, bool hung) {
  const std::string dir = file.substr(0, file.size() - 5) + ".golden", folder = dir + "/" + dump_folder_name(name);
  std::ostringstream limit;
  limit << "timeout " << impl.timeout_s << " ";
  // The command as the fuzz ran it, `sh -c CMD`: whatever it holds (an
  // `exit`, a `#`, a leading `(`, VAR=value) stays inside it.
  std::string cmd = impl.cmd;
  for (size_t p; !impl.worker && (p = cmd.find("{case}")) != std::string::npos;) cmd.replace(p, 6, shell_quote(folder));
  const std::string run = (impl.worker ? "echo " + shell_quote(folder) + " | " : std::string()) +
                          (hung ? limit.str() : std::string()) + "sh -c " + shell_quote(cmd);
  const std::string& self = self_command();
  return self + " export " + shell_quote(file) + " " + shell_quote(dir) + " && { " + run + "; " + self + " check " +
         shell_quote(folder) + (impl.require.empty() ? "" : " --require " + shell_word(impl.require)) +
         (impl.strict_ties ? " --strict-ties" : "") + "; }";
}

void write_impl_failure(const FuzzOptions& o, const ImplOptions& impl, FuzzFailure& f) {
  f.file = write_shrunk_case(o, f, [&](const std::string& path, const std::string& name) {
    f.repro = repro_line(impl, path, name, f.check == "impl/timeout");
    std::ostringstream h;
    h << "# moeverify fuzz --impl: seed " << o.seed << ", configuration " << f.index << ", " << outcome_name(f.outcome)
      << " at " << f.check << "\n# implementation: " << printable(impl.cmd, 4000) << (impl.worker ? " (worker)" : "")
      << "\n# drawn: " << f.yaml << "\n# repro: " << printable(f.repro, 8000) << "\n";  // one line each: a newline
                                                                                       // in them would end the comment
    return h.str();
  });
  if (f.file.empty()) f.repro.clear();
}

/// The profile of an --impl run: the user's, plus held routed weights (a
/// golden folder holds every input as .npy; export refuses streamed ones).
Profile impl_profile(const FuzzOptions& o) {
  Profile p = o.profile ? *o.profile : Profile{};
  bool has = false;
  for (const auto& f : p.fix) has = has || f.key == "experts.weights";
  if (!has) p.fix.push_back({"experts.weights", "held", 0});
  return p;
}

/// Counts configuration `i`'s outcome into the result (under its mutex).
void tally(FuzzResult& res, const ImplRun& r, uint64_t i) {
  if (r.kind == ImplRun::Kind::skipped) {
    ++res.skipped;
    ++res.skip_reasons[r.reason];
    return;
  }
  if (r.kind == ImplRun::Kind::crashed) {
    ++res.crashed;
    return;
  }
  ++res.judged;
  if (r.accepted_ties) {
    ++res.accepted_ties;
    // the jobs finish out of order: kept ascending
    res.tie_configurations.insert(
        std::upper_bound(res.tie_configurations.begin(), res.tie_configurations.end(), i), i);
  }
  for (const auto& [slot, s] : r.stages) {
    res.stages[slot].judged += s.first;
    res.stages[slot].failed += s.second;
  }
  if (r.v.outcome == Outcome::PASSED) ++res.passed;
  else if (r.v.outcome == Outcome::NOT_VERIFIED) ++res.uninformative, note_uninformative(res, r.v.check, i);
  else ++res.failed;
}

/// Set by SIGINT or SIGTERM: the jobs finish the configuration they run,
/// shrinking stops, and the summary is printed (temporary folders removed).
/// A second one sets g_stop_commands: the implementations under way are
/// ended at once and their configurations not counted.
std::atomic<bool> g_interrupted{false};
std::atomic<int> g_interrupt_signal{0};  // the first one's number
extern "C" void on_interrupt(int sig) {
  if (g_interrupted) g_stop_commands = true;  // the second: the implementations under way end now
  if (!g_interrupted) g_interrupt_signal = sig;
  g_interrupted = true;
}

}  // namespace

namespace {

/// One --impl run: the jobs' shared state, each job's loop, the failure
/// handling (shrink, case file) and the progress lines.
class ImplFuzz {
 public:
  ImplFuzz(const FuzzOptions& o, const ImplOptions& impl, std::ostream& progress)
      : o_(o), impl_(impl), profile_(impl_profile(o)), progress_(progress) {}

  FuzzResult run() {
    require_profile_fits(&profile_, o_.seed);
    prepare_out_dir(o_, progress_);
    res_.impl = true;
    res_.seed = o_.seed;
    res_.impl_cmd = impl_.cmd;
    res_.profile = o_.profile ? o_.profile->name : "";
    res_.sets = o_.sets;
    res_.work_dir = make_work_dir();
    progress_ << "fuzz --impl: seed " << o_.seed << " (replay: " << self_command() << " fuzz --seed " << o_.seed
              << replay_bound(o_) << " --impl " << shell_quote(impl_.cmd) << (impl_.worker ? " --worker" : "")
              << profile_flags(o_)
              << (impl_.require.empty() ? "" : " --require " + shell_word(impl_.require))
              << (impl_.strict_ties ? " --strict-ties" : "") << ")" << std::endl;
    if (impl_.keep) progress_ << "fuzz --impl: --keep: the case folders stay in " << res_.work_dir << std::endl;
    t0_ = Clock::now();
    running_ = std::max(1, o_.jobs);
    std::vector<std::thread> pool;
    for (int k = 0; k < running_; ++k) pool.emplace_back([this] { job(); });
    report_progress();
    for (auto& t : pool) t.join();
    std::sort(res_.failures.begin(), res_.failures.end(),
              [](const FuzzFailure& a, const FuzzFailure& b) { return a.index < b.index; });
    res_.configurations = res_.drawn;
    res_.seconds = since(t0_);
    res_.interrupted = g_interrupted;
    res_.interrupt_signal = g_interrupt_signal;
    if (!impl_.keep) {
      std::error_code ec;
      std::filesystem::remove_all(res_.work_dir, ec);
    }
    return res_;
  }

 private:
  void job() {
    ImplJob j(impl_, res_.work_dir);
    while (!stop_ && !g_interrupted) {
      const uint64_t i = next_++;
      if ((o_.iterations && i >= o_.iterations) || (o_.seconds > 0 && since(t0_) >= o_.seconds)) break;
      std::string why_not;
      const std::optional<std::string> yaml = draw_configuration(&profile_, o_.seed, i, why_not);
      if (!yaml) continue;  // no draw fits (index 0 did, checked in run): not counted
      const ImplRun r = j.run(*yaml, "c" + std::to_string(i));
      if (g_stop_commands) break;  // ended by the interrupt, not judged
      const bool failed = r.kind == ImplRun::Kind::crashed ||
                          (r.kind == ImplRun::Kind::judged && r.v.outcome != Outcome::PASSED &&
                           r.v.outcome != Outcome::NOT_VERIFIED);
      if (failed) {
        fail(j, i, *yaml, r);
      } else {
        std::lock_guard<std::mutex> lk(m_);
        ++res_.drawn;
        tally(res_, r, i);
      }
    }
    --running_;
  }

  /// A failing configuration: shrunk (the first of its check), written
  /// under --out with its repro line, and counted.
  void fail(ImplJob& j, uint64_t i, const std::string& yaml, const ImplRun& r) {
    FuzzFailure f;
    f.index = i;
    f.outcome = r.v.outcome;
    f.check = r.v.check;
    f.note = r.v.note;
    f.yaml = yaml;
    f.stderr_tail = last_lines(r.err_tail, 20);
    {
      // The first failure of each check is shrunk; a later one of the same
      // check is listed as drawn (shrinking it again would repeat the work).
      std::lock_guard<std::mutex> lk(m_);
      const auto [it, fresh] = shrunk_keys_.emplace(r.v.key, i);
      if (!fresh) f.same_as = int64_t(it->second);
    }
    int n = 0;
    // Shrinking one failure ends after --shrink-seconds (default 300): a hang
    // costs the whole --impl-timeout per candidate that still hangs (25
    // minutes at the default 60 s before this limit), and --seconds bounds
    // the draws only.
    const auto shrink_end = Clock::now() + std::chrono::milliseconds(int64_t(o_.shrink_seconds * 1000));
    bool out_of_time = false;
    const JudgeFn judge = [&](const std::string& y) {
      const ImplRun s = j.run(y, "c" + std::to_string(i) + ".s" + std::to_string(++n));
      return s.kind == ImplRun::Kind::skipped ? Verdict{Outcome::NOT_SUPPORTED, "", "", ""} : s.v;
    };
    const FitFn fit = [&](const std::string& y) -> std::optional<std::string> {
      std::string w;
      if (g_interrupted) return std::nullopt;
      // past the limit no candidate is tried (one under way finishes)
      if (Clock::now() >= shrink_end) return out_of_time = true, std::nullopt;
      ++shrinking_;
      return profile_.refit(y, w);
    };
    // A protocol error is what the worker writes on stdout, not what the
    // configuration makes it compute: no smaller configuration explains it.
    const bool shrinkable = o_.shrink && f.same_as < 0 && r.v.check != "impl/protocol";
    f.shrunk = shrinkable ? shrink(yaml, r.v, judge, fit, o_.shrink_budget, f.shrink_runs) : yaml;
    if (o_.shrink && f.same_as < 0 && !shrinkable) f.note += "; not shrunk: a protocol error is not the configuration's";
    if (out_of_time) {
      std::ostringstream t;
      t << "; shrinking stopped at --shrink-seconds " << o_.shrink_seconds;
      f.note += t.str();
    }
    f.shrunk_tokens = tokens_of(f.shrunk);
    std::lock_guard<std::mutex> lk(m_);
    ++res_.drawn;
    tally(res_, r, i);
    if (!o_.out_dir.empty() && f.same_as < 0) write_impl_failure(o_, impl_, f);
    res_.failures.push_back(f);
    if (o_.stop_at_first) stop_ = true;
  }

  /// Progress every 2 s until every job has ended (a job may still be
  /// shrinking a failure after the time is up).
  void report_progress() {
    auto last = Clock::now();
    bool told = false, told_stop = false;
    // The interrupts said once each, also where the jobs ended before the
    // next look (the loop's last pass).
    auto tell = [&] {
      if (g_interrupted && !told) {
        progress_ << "fuzz --impl: interrupted; finishing the configurations under way (interrupt again to end "
                     "them now)" << std::endl;
        told = true;
      }
      if (g_stop_commands && !told_stop) {
        progress_ << "fuzz --impl: interrupted again; ending the implementation's processes" << std::endl;
        told_stop = true;
      }
    };
    for (bool last_pass = false; !last_pass;) {
      last_pass = running_ == 0;
      if (!last_pass) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      tell();
      if (last_pass || since(last) < 2.0) continue;
      last = Clock::now();
      std::lock_guard<std::mutex> lk(m_);
      progress_ << "fuzz --impl: " << res_.drawn << " drawn, " << res_.judged << " judged (" << res_.passed
                << " PASSED), " << res_.skipped << " skipped, " << res_.crashed << " crashed, " << res_.failed
                << " failed; " << std::fixed << std::setprecision(0)
                << 60.0 * double(res_.judged) / std::max(1e-9, since(t0_)) << " judged/min"
                << (shrinking_ ? "; shrinking (a failure, counted when shrunk): " + std::to_string(shrinking_) +
                                     " candidates tried"
                               : "")
                << std::endl;
      progress_.unsetf(std::ios::fixed);
    }
  }

  const FuzzOptions& o_;
  const ImplOptions& impl_;
  const Profile profile_;
  std::ostream& progress_;
  FuzzResult res_;
  Clock::time_point t0_;
  std::atomic<uint64_t> next_{0}, shrinking_{0};
  std::atomic<int> running_{0};
  std::atomic<bool> stop_{false};
  std::mutex m_;
  std::map<std::string, uint64_t> shrunk_keys_;  // check key -> the configuration whose failure is shrunk
};

}  // namespace

FuzzResult fuzz_impl(const FuzzOptions& o, const ImplOptions& impl, std::ostream& progress) {
  if (o.seconds <= 0 && o.iterations == 0) bad_input("fuzz: give --seconds or --iterations");
  signal(SIGPIPE, SIG_IGN);  // a worker that died is seen at its pipe's EPIPE, not by a signal
  g_interrupted = false;
  g_interrupt_signal = 0;
  g_stop_commands = false;
  struct sigaction sa {}, old_int {}, old_term {};
  sa.sa_handler = on_interrupt;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  FuzzResult r = ImplFuzz(o, impl, progress).run();
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return r;
}

namespace {

/// A skip reason of the form "KEY: VALUE; REST" (the adapters' "not
/// supported" lines), KEY a case key; key empty for any other text.
struct SkipReason {
  std::string key, value, rest;
};
SkipReason parse_skip_reason(const std::string& why) {
  static const std::set<std::string> keys = [] {
    std::set<std::string> s;
    for (const auto& [k, help] : case_keys()) s.insert(k);
    return s;
  }();
  const size_t colon = why.find(": ");
  if (colon == std::string::npos || !keys.count(why.substr(0, colon))) return {};
  const size_t semi = why.find("; ", colon + 2);
  return {why.substr(0, colon), why.substr(colon + 2, semi == std::string::npos ? semi : semi - colon - 2),
          semi == std::string::npos ? "" : why.substr(semi)};
}

/// The skip reasons, those that differ only in a key's value (router.hot_expert:
/// 0, 1, 2, ...) as one line once there are three or more.
void print_skip_reasons(const std::map<std::string, int>& reasons, std::ostream& os) {
  std::map<std::pair<std::string, std::string>, std::vector<std::pair<std::string, int>>> by_key;
  for (const auto& [why, n] : reasons) {
    const SkipReason s = parse_skip_reason(why);
    if (!s.key.empty()) by_key[{s.key, s.rest}].push_back({s.value, n});
  }
  std::set<std::pair<std::string, std::string>> printed;
  for (const auto& [why, n] : reasons) {
    const SkipReason s = parse_skip_reason(why);
    const auto group = by_key.find({s.key, s.rest});
    if (s.key.empty() || group->second.size() < 3) {
      os << "      skipped " << n << ": " << why << "\n";
      continue;
    }
    if (!printed.insert(group->first).second) continue;
    std::stable_sort(group->second.begin(), group->second.end(),
                     [](const auto& a, const auto& b) { return natural_less(a.first, b.first); });
    uint64_t total = 0;
    std::string values;
    for (size_t i = 0; i < group->second.size(); ++i) {
      total += group->second[i].second;
      if (i < 6) values += (i ? ", " : "") + group->second[i].first;
    }
    os << "      skipped " << total << ": " << s.key << ": " << group->second.size() << " values (" << values
       << (group->second.size() > 6 ? ", ..." : "") << ")" << s.rest << "\n";
  }
}

/// Where nothing was judged and the implementation refuses a value the
/// profile fixes, no configuration of the profile can ever run it: said,
/// with the shipped profiles that fix that key otherwise.
void print_fixed_key_refused(const FuzzResult& r, const Profile* profile, std::ostream& os) {
  if (!profile || r.judged > 0 || r.skipped == 0) return;
  for (const auto& f : profile->fix) {
    std::string refused;
    for (const auto& [why, n] : r.skip_reasons)
      if (parse_skip_reason(why).key == f.key) refused = why;
    if (refused.empty()) continue;
    std::string others;
    std::vector<std::string> files;
    if (const std::string dir = profiles_dir(); !dir.empty()) {
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(dir, ec))
        if (e.path().extension() == ".yaml") files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    for (const auto& file : files) {
      try {
        const Profile q = load_profile(file);
        for (const auto& g : q.fix)
          if (g.key == f.key && g.value != f.value) others += (others.empty() ? "" : ", ") + q.name + " (" + g.value + ")";
      } catch (const Error&) {
      }
    }
    os << "   the implementation refuses " << f.key << ": " << f.value << ", which "
       << (f.from_set ? "--set " + f.key + "=" + f.value : "profile " + profile->name)
       << " fixes in every configuration (\"" << refused << "\"): no configuration of this profile can run it"
       << (others.empty() ? "" : "; shipped profiles that fix " + f.key + " otherwise: " + others) << "\n";
    return;
  }
}

}  // namespace

void print_impl_result(const FuzzResult& r, std::ostream& os, const Profile* profile) {
  os << "\nfuzz --impl: seed " << r.seed << ", " << r.drawn << " configurations in " << std::fixed << std::setprecision(1)
     << r.seconds << " s (" << std::setprecision(0) << 60.0 * double(r.judged) / std::max(1e-9, r.seconds)
     << " judged/min)\n   implementation: " << r.impl_cmd << "\n";
  os.unsetf(std::ios::fixed);
  if (!r.profile.empty()) os << "   profile: " << r.profile << "\n";
  if (!r.sets.empty()) {
    os << "   --set";
    for (const auto& s : r.sets) os << " " << s;
    os << "  (in every configuration)\n";
  }
  os << "   " << std::left << std::setw(14) << "judged" << r.judged << "  (" << r.passed << " PASSED, " << r.failed
     << " failed, " << r.uninformative << " NOT_VERIFIED: nothing checked)\n"
     << "   " << std::setw(14) << "skipped" << r.skipped << "  (not supported by the implementation: exit 77 or skip)\n"
     << "   " << std::setw(14) << "crashed" << r.crashed << "  (another exit status, a signal, an exception or a timeout)\n";
  print_skip_reasons(r.skip_reasons, os);
  print_fixed_key_refused(r, profile, os);
  if (r.accepted_ties > 0) {
    os << "   " << std::setw(14) << "ties" << r.accepted_ties << "  (configuration";
    os << (r.tie_configurations.size() > 1 ? "s " : " ");
    for (size_t k = 0; k < r.tie_configurations.size() && k < 12; ++k) os << (k ? ", " : "") << r.tie_configurations[k];
    os << (r.tie_configurations.size() > 12 ? ", ...: " : ": ")
       << "judged configurations where the implementation broke an exact tie otherwise than the lowest expert id "
          "or token: accepted by docs/contract.md §15; --strict-ties holds it to the lowest)\n";
  }
  // What the NOT_VERIFIED ones checked nothing of, so that exit 0 beside
  // many of them is seen (a stage written for EP 1 only, say)
  for (const auto& [check, n] : r.uninformative_checks)
    os << "      NOT_VERIFIED " << n << ": " << (check == "-/actual/-" ? "no actual/ folder: nothing written" : check)
       << " " << configuration_list(r.uninformative_configurations.at(check)) << "\n";
  if (r.uninformative > 0)
    os << "      (--emit FILE writes configuration i as case fuzz_" << r.seed << "_i: export it, run yours, check "
       << "--verbose)\n";
  if (r.uninformative > 0 && r.uninformative >= r.passed)
    os << "      (as many configurations checked nothing as PASSED: --require all makes an unwritten stage "
          "INCORRECT)\n";
  if (r.interrupted)
    os << "   interrupted: the draws (and any shrinking) ended early on "
       << (r.interrupt_signal == SIGTERM ? "SIGTERM" : "SIGINT") << " (exit " << fuzz_impl_status(r)
       << (r.failures.empty() ? ": a run cut short is not a pass" : "") << ")\n";
  if (!r.stages.empty()) os << "   per stage (configurations judged / INCORRECT):\n";
  for (const auto& [slot, s] : r.stages) os << "      " << std::setw(20) << slot << " " << s.judged << " / " << s.failed << "\n";
  // A later failure of the same kind is one line under the failure whose
  // case stands for it (the JSON lists each).
  std::map<uint64_t, std::vector<uint64_t>> alike;
  for (const auto& f : r.failures)
    if (f.same_as >= 0) alike[uint64_t(f.same_as)].push_back(f.index);
  for (const auto& f : r.failures) {
    if (f.same_as >= 0) continue;
    os << "\n   FAIL configuration " << f.index << ": " << outcome_name(f.outcome) << " at " << f.check << "\n";
    if (!f.note.empty()) os << "      " << f.note.substr(0, 400) << "\n";
    // The implementation's own bytes: each line shown through printable(), so
    // that its control sequences (a clear screen, a title) reach no terminal.
    if (!f.stderr_tail.empty()) {
      os << "      stderr (last lines):\n";
      std::istringstream lines(f.stderr_tail);
      for (std::string l; std::getline(lines, l);) os << "         " << printable(l, 300) << "\n";
    }
    os << "      drawn:  " << f.yaml << "\n      shrunk: " << f.shrunk << "  (" << f.shrunk_tokens << (f.shrunk_tokens == 1 ? " token" : " tokens") << " per rank, "
       << f.shrink_runs << " configurations run to shrink it)\n";
    if (!f.file.empty()) os << "      case:   " << f.file << "\n      repro:  " << f.repro << "\n";
    if (const auto a = alike.find(f.index); a != alike.end()) {
      os << "      failed the same way: " << a->second.size() << " more configuration(s): ";
      for (size_t k = 0; k < a->second.size() && k < 12; ++k) os << (k ? ", " : "") << a->second[k];
      os << (a->second.size() > 12 ? ", ..." : "") << " (the JSON lists each)\n";
    }
  }
  if (r.failures.empty() && r.passed == 0)
    os << "\nNOT_VERIFIED: no configuration was judged PASSED (every one skipped, crashed or with nothing checked)\n";
  os << std::right;
}

std::string impl_json(const FuzzResult& r) {
  nlohmann::json j;
  j["schema"] = "moeverify-fuzz-impl/1";
  j["seed"] = r.seed;
  j["implementation"] = r.impl_cmd;
  j["profile"] = r.profile;
  j["sets"] = r.sets;
  j["seconds"] = r.seconds;
  for (const auto& [k, v] : {std::pair<const char*, uint64_t>{"drawn", r.drawn}, {"judged", r.judged},
                             {"passed", r.passed}, {"not_verified", r.uninformative}, {"skipped", r.skipped},
                             {"crashed", r.crashed}, {"failed", r.failed}, {"accepted_ties", r.accepted_ties}})
    j[k] = v;
  j["tie_configurations"] = r.tie_configurations;
  j["stages"] = nlohmann::json::object();
  for (const auto& [slot, s] : r.stages) j["stages"][slot] = {{"judged", s.judged}, {"failed", s.failed}};
  j["skip_reasons"] = r.skip_reasons;
  j["not_verified_checks"] = r.uninformative_checks;
  j["not_verified_configurations"] = r.uninformative_configurations;
  j["interrupted"] = r.interrupted;
  j["failures"] = nlohmann::json::array();
  for (const auto& f : r.failures)
    j["failures"].push_back({{"index", f.index},
                             {"outcome", outcome_name(f.outcome)},
                             {"check", f.check},
                             {"kind", f.check.rfind("impl/", 0) == 0 ? f.check.substr(5) : "incorrect"},
                             {"note", f.note.substr(0, 2000)},
                             {"stderr_tail", f.stderr_tail},
                             {"drawn", f.yaml},
                             {"shrunk", f.shrunk},
                             {"shrunk_tokens", f.shrunk_tokens},
                             {"file", f.file},
                             {"repro", f.repro},
                             {"same_as", f.same_as >= 0 ? nlohmann::json(f.same_as) : nlohmann::json()}});
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

int fuzz_impl_status(const FuzzResult& r) {
  if (!r.failures.empty()) return exit_status(Outcome::INCORRECT);
  // A run cut short has not done what was asked of it: a CI job that ends
  // it (a step's timeout sends SIGTERM) must not read it as passed. The
  // shell's convention for a process ended by a signal: 128 + its number.
  if (r.interrupted) return 128 + (r.interrupt_signal > 0 ? r.interrupt_signal : SIGINT);
  if (r.passed == 0) return exit_status(Outcome::NOT_VERIFIED);
  return 0;
}

}  // namespace moev
