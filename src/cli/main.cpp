// moeverify: reference-vs-fast verification of MoE token paths.
// Exit status: 0 all PASSED, 1 INCORRECT, 2 bad input, 3 ERROR,
// 4 NOT_VERIFIED, 5 NOT_SUPPORTED (the worst outcome of the run decides).
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "case.h"
#include "comm.h"
#include "cuda_probe.h"
#include "dump.h"
#include "error.h"
#include "fuzz.h"
#include "profile.h"
#include "subprocess.h"
#include "case_filter.h"
#include "case_key_docs.h"
#include "export_check.h"
#include "memory_estimate.h"
#include "registry.h"
#include "runner.h"
#include "version.h"

using namespace moev;

namespace {

/// How long a rank other than 0 of an mpirun job waits before it says why
/// it failed (say_failure): 3 s for `run`, at most half its collective
/// timeout, so that rank 0, waiting for it in a collective, does not end
/// the job first; 0 for every other command (not an MPI job).
std::chrono::milliseconds g_failure_delay{0};

void say_failure(const std::string& text);

/// The cases of a file with the `--set` overrides, those the overrides do
/// not fit left out (load_cases) and each named on stderr as it is loaded,
/// before anything runs, as is each key without effect: those about the
/// cases `filter` (--case) selects.
std::vector<Case> load_noting_left_out(const std::string& file, const std::vector<std::string>& sets,
                                       const CaseFilter& filter = {}) {
  LoadNotes notes;
  std::vector<Case> cases = load_cases(file, sets, &notes);
  std::vector<std::string> names;
  for (const Case& c : cases) names.push_back(c.name);
  // Every rank under mpirun loads the same files alike: rank 0 says it, in
  // one write a note (ranks share stderr).
  if (launched_rank() == 0) {
    for (const auto& n : notes.left_out)
      if (filter.selects(n.first)) std::cerr << ("moeverify: note: " + left_out_note(n) + "\n");
    for (const auto& n : notes.no_effect)
      if (filter.selects_entry(n.first, names)) std::cerr << ("moeverify: note: " + n.second + "\n");
  }
  return cases;
}

// ---- option values: parsed here, so that a bad one says what is wrong -------

int parse_int_option(const std::string& flag, const std::string& text, int lo, int hi) {
  const std::string valid = "valid: an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0' || errno == ERANGE)
    bad_input(flag + ": expected an integer, got '" + printable(text) + "'; " + valid);
  if (v < lo || v > hi) bad_input(flag + ": " + text + " is out of range; " + valid);
  return int(v);
}

double parse_real_option(const std::string& flag, const std::string& text, double lo, double hi) {
  std::ostringstream valid;
  valid << "valid: a number in [" << lo << ", " << hi << "]";
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || *end != '\0' || !std::isfinite(v))
    bad_input(flag + ": expected a finite number, got '" + printable(text) + "'; " + valid.str());
  if (v < lo || v > hi) bad_input(flag + ": " + text + " is out of range; " + valid.str());
  return v;
}

MemoryLimit memory_limit(const CLI::App* cmd, const std::string& text) {
  if (cmd->count("--max-memory")) return {parse_memory_size(text, "--max-memory"), "--max-memory " + printable(text)};
  return {default_memory_limit(), default_memory_limit_origin() + "; set it with --max-memory"};
}

struct RunArgs {
  std::vector<std::string> files, sets, faults;
  std::string threads, json, dump, timeout = "30", max_memory, backend;
  CaseFilter cases;
  bool verbose = false;
};

/// The progress line of `run` on a terminal (stderr): "[3/12] case: slot/variant  4.2 s",
/// rewritten in place before each stage variant once the case has run for
/// more than a second, and cleared when the case ends.
class ProgressLine {
 public:
  void start(size_t done, size_t total, const std::string& name) {
    prefix_ = "[" + std::to_string(done) + "/" + std::to_string(total) + "] " + name;
    start_ = std::chrono::steady_clock::now();
  }
  void update(const std::string& slot, const std::string& variant) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (slot.empty()) {
      if (shown_) std::cerr << "\r\033[K" << std::flush;
      shown_ = false;
      return;
    }
    if (s <= 1.0) return;
    std::ostringstream o;
    o << "\r\033[K" << prefix_ << ": " << slot << "/" << variant << "  " << std::fixed << std::setprecision(1) << s
      << " s";
    std::cerr << o.str() << std::flush;
    shown_ = true;
  }

 private:
  std::string prefix_;
  std::chrono::steady_clock::time_point start_;
  bool shown_ = false;
};

/// A --backend value: one of the case key `backend`'s names, else bad input.
Backend backend_flag(const std::string& name) {
  std::string valid;
  for (const auto& [n, b] : backend_table()) {
    if (name == n) return b;
    valid += (valid.empty() ? "" : " | ") + std::string(n);
  }
  bad_input("--backend: unknown backend '" + printable(name) + "'; valid: " + valid);
}


/// The end of a run that did not pass: each case that failed, its first
/// check that did not pass, and the command that runs it alone.
void print_failures(const std::vector<CaseReport>& reports, const RunArgs& a, std::ostream& out) {
  print_failure_list(reports, [&](size_t, const CaseReport& r, const Check* first, std::ostream& out) {
    if (first) out << " at " << first->slot << " / " << first->variant << " / " << first->tensor;
    std::string file = r.c.source.substr(0, r.c.source.rfind(':'));
    out << "\n      repro: " << self_command() << " run " << shell_word(file) << " --case " << shell_word(r.c.name);
    for (const auto& st : a.sets) out << " --set " << shell_word(st);
    for (const auto& f : a.faults) out << " --fault " << shell_word(f);
    if (!a.backend.empty()) out << " --backend " << shell_word(a.backend);
  }, out);
}

/// The case files of `run`, every case loaded and validated before any
/// runs; --backend is the case key `backend` set for every case (validated
/// there); every --case pattern must select some case.
using CaseFiles = std::vector<std::pair<std::string, std::vector<Case>>>;
CaseFiles load_run_cases(const CLI::App* cmd, const RunArgs& a) {
  std::vector<std::string> sets = a.sets;
  if (cmd->count("--backend")) {
    backend_flag(a.backend);  // a wrong value is named as the flag, not as a --set
    sets.push_back("backend=" + a.backend);
  }
  CaseFiles all;
  for (const auto& f : a.files) all.push_back({f, load_noting_left_out(f, sets, a.cases)});
  if (!a.cases.patterns.empty()) {
    std::vector<std::string> names;
    for (const auto& [file, cases] : all)
      for (const auto& c : cases) names.push_back(c.name);
    a.cases.check_each_used(names, "the given files");
  }
  return all;
}

/// Under mpirun: keeps the cases whose ep equals the process count `world`;
/// the others that --case selects are returned as "NAME (ep N)" for the header.
std::vector<std::string> keep_cases_of_world(CaseFiles& all, int world, const CaseFilter& filter) {
  std::vector<std::string> skipped;
  for (auto& [file, cases] : all) {
    std::vector<Case> keep;
    for (auto& c : cases) {
      if (c.ep == world) keep.push_back(c);
      else if (filter.selects(c.name)) skipped.push_back(c.name + " (ep " + std::to_string(c.ep) + ")");
    }
    cases = keep;
  }
  return skipped;
}

/// The first lines of `run`: version, threads, MPI ranks (world > 0), the
/// planted faults, and the cases skipped under mpirun.
void print_run_header(std::ostream& out, const RunArgs& a, int threads, int world, bool faults,
                      const std::vector<std::string>& skipped) {
  out << "moeverify " << MOEVERIFY_VERSION << "  threads=" << threads;
  if (world > 0) out << "  mpi ranks=" << world;
  if (faults) {
    out << "  PLANTED FAULTS:";
    for (const auto& f : a.faults) out << " " << f;
  }
  out << "\n";
  if (!skipped.empty()) {
    out << "skipped under mpirun -np " << world << " (ep must equal the process count):";
    for (const auto& n : skipped) out << " " << n;
    out << "\n";
  }
}

/// Progress where stderr is not a terminal: "[i/N] name" as a case starts,
/// then, while it runs past 10 s, "[i/N] name: slot/variant, T s in" every
/// 10 s from a thread of its own (a single stage may take minutes).
class PipeProgress {
 public:
  PipeProgress(bool on, size_t total) : total_(total) {
    // Test hook (cli.contract): MOEVERIFY_TEST_PROGRESS_SECONDS shortens the 10 s.
    if (const char* v = std::getenv("MOEVERIFY_TEST_PROGRESS_SECONDS")) every_ = std::max(0.1, std::atof(v));
    if (on) ticker_ = std::thread([this] { tick(); });
  }
  ~PipeProgress() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (ticker_.joinable()) ticker_.join();
  }
  void start(size_t done, const std::string& name) {
    std::lock_guard<std::mutex> lk(m_);
    done_ = done;
    name_ = name;
    slot_.clear();
    start_ = last_ = std::chrono::steady_clock::now();
    std::cerr << "[" << done_ << "/" << total_ << "] " << name_ << std::endl;
  }
  void stage(const std::string& slot, const std::string& variant) {
    std::lock_guard<std::mutex> lk(m_);
    slot_ = slot.empty() ? "" : slot + "/" + variant;
  }

 private:
  void tick() {
    std::unique_lock<std::mutex> lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::duration<double>(std::min(1.0, every_ / 4)));
      const auto now = std::chrono::steady_clock::now();
      if (stop_ || name_.empty() || slot_.empty() || now - last_ < std::chrono::duration<double>(every_)) continue;
      last_ = now;
      std::cerr << "[" << done_ << "/" << total_ << "] " << name_ << ": " << slot_ << ", "
                << int64_t(std::chrono::duration<double>(now - start_).count()) << " s in" << std::endl;
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  double every_ = 10;  // seconds between lines
  size_t done_ = 0, total_;
  std::string name_, slot_;
  std::chrono::steady_clock::time_point start_, last_;
  std::thread ticker_;
};

/// The end of `run`: the tolerance table, the count of passed cases, the
/// failures with their repro lines, a planted fault no case caught, and the
/// JSON report (`write_json`: rank 0 with --json).
void finish_run(const std::vector<CaseReport>& reports, Outcome worst_all, const RunArgs& a, bool faults,
                bool write_json, std::ostream& out) {
  print_tolerance_table(reports, out);
  size_t passed = 0;
  for (const auto& r : reports) passed += r.outcome == Outcome::PASSED;
  out << "\n" << passed << " of " << reports.size() << " case(s) PASSED; overall " << outcome_name(worst_all) << "\n";
  print_failures(reports, a, out);
  ReportMeta meta;
  meta.faults = a.faults;
  if (faults && passed == reports.size()) {
    // Every case passed with the fault on: nothing here exercises it.
    meta.faults_uncaught = a.faults;
    out << "PLANTED FAULT NOT CAUGHT:";
    for (const auto& f : a.faults) out << " " << f;
    out << " was on and every case PASSED: these cases do not exercise it (`moeverify selftest` names the case "
           "or fuzz run that catches each fault)\n";
  }
  if (write_json) {
    const std::string err =
        write_file(a.json, {reports_json(reports, a.files.size() == 1 ? a.files[0] : "(several)", meta)});
    if (!err.empty()) bad_input("--json: " + err + "; valid: a writable file path such as report.json");
  }
}

int cmd_run(const CLI::App* cmd, const RunArgs& a) {
  const bool mpi = launched_under_mpi();
  const bool writer = !mpi || mpi_world().rank() == 0;  // rank 0 prints and writes
  RunOptions opt;
  const int threads = cmd->count("--threads") ? parse_int_option("--threads", a.threads, 1, 256)
                                               : int(std::max(1u, std::thread::hardware_concurrency()));
  opt.threads = threads;
  opt.collective_timeout_ms = int(parse_real_option("--collective-timeout", a.timeout, 0.05, 3600.0) * 1000);
  set_mpi_collective_timeout(std::chrono::milliseconds(opt.collective_timeout_ms));  // MPI collectives too
  g_failure_delay = std::min(g_failure_delay, std::chrono::milliseconds(opt.collective_timeout_ms / 2));
  const MemoryLimit limit = memory_limit(cmd, a.max_memory);
  a.cases.check_not_empty();
  const bool want_json = cmd->count("--json") > 0, want_dump = cmd->count("--dump") > 0;
  if (want_json && a.json.empty()) bad_input("--json: the path is empty; valid: a file path such as report.json");
  if (want_dump && a.dump.empty()) bad_input("--dump: the path is empty; valid: a folder path such as dump/");
  for (const auto& f : a.faults) {
    try {
      opt.faults.bits |= uint64_t(parse_fault(f));
    } catch (const std::invalid_argument& e) {
      bad_input(std::string("--fault: ") + e.what());
    }
  }
  CaseFiles all = load_run_cases(cmd, a);
  const bool select = !a.cases.patterns.empty();
  auto selected = [&](const Case& c) { return a.cases.selects(c.name); };
  // Under mpirun every process runs every case (one rank each); rank 0 prints.
  const int world = mpi ? mpi_world().size() : 0;
  const std::vector<std::string> skipped = mpi ? keep_cases_of_world(all, world, a.cases) : std::vector<std::string>{};
  size_t total = 0;
  for (const auto& [file, cases] : all)
    for (const auto& c : cases) total += selected(c);
  if (mpi) mpi_agree_on_case_count(int64_t(total));  // before any rank can stop alone
  if (total == 0)
    bad_input("no case with ep " + std::to_string(world) + " to run under mpirun -np " + std::to_string(world) +
              (select ? " among those --case selects" : ""));
  // Everything that can be refused is refused before the first case runs:
  // memory, then the output paths.
  for (const auto& [file, cases] : all)
    for (const auto& c : cases)
      if (selected(c)) check_case_memory(c, threads, limit);
  if (writer && want_json) check_output_file("--json", a.json, a.files);
  if (writer && want_dump) prepare_dump_root(a.dump);
  if (writer) opt.dump_dir = a.dump;

  std::ostream null_stream(nullptr);
  std::ostream& out = writer ? std::cout : null_stream;
  std::vector<CaseReport> reports;
  Outcome worst_all = Outcome::PASSED;
  print_run_header(out, a, threads, mpi ? world : 0, opt.faults.bits != 0, skipped);
  size_t done = 0;
  // On a terminal a transient progress line; otherwise (tests, CI, logs) one
  // fixed line per case, and on a case past 10 s a line every 10 s naming
  // its stage (short cases print no more).
  const bool tty = writer && isatty(STDERR_FILENO);
  ProgressLine line;
  PipeProgress piped(writer && !tty, total);
  if (tty) opt.progress = [&](const std::string& slot, const std::string& variant) { line.update(slot, variant); };
  else if (writer) opt.progress = [&](const std::string& slot, const std::string& variant) { piped.stage(slot, variant); };
  for (const auto& [file, cases] : all) {
    for (const auto& c : cases) {
      if (!selected(c)) continue;
      ++done;
      if (tty) line.start(done, total, c.name);
      else if (writer) piped.start(done, c.name);
      reset_peak_rss();
      reports.push_back(run_case(c, opt));
      const uint64_t measured = peak_rss_bytes();
      print_report(reports.back(), out, a.verbose ? ReportDetail::every_check : ReportDetail::summary);
      out << "   " << memory_line(estimate_case_bytes(c, threads), measured) << "\n";
      worst_all = worst(worst_all, reports.back().outcome);
    }
  }
  finish_run(reports, worst_all, a, opt.faults.bits != 0, writer && want_json, out);
  // A planted fault that every case passed with: the run promised to fail,
  // and nothing here could show that bug: NOT_VERIFIED (exit 4), not 0.
  if (opt.faults.bits != 0 && worst_all == Outcome::PASSED) return exit_status(Outcome::NOT_VERIFIED);
  return exit_status(worst_all);
}

int cmd_validate(const CLI::App* cmd, const std::vector<std::string>& files, const std::vector<std::string>& sets,
                 bool keys, bool markdown, const std::string& max_memory) {
  const MemoryLimit limit = memory_limit(cmd, max_memory);
  if (markdown && !keys) bad_input("validate --markdown: goes with --keys (moeverify validate --keys --markdown)");
  if (keys && markdown) {
    std::cout << case_keys_markdown();
    return 0;
  }
  if (keys) {
    for (const auto& [k, h] : case_keys()) std::cout << "  " << k << ": " << h << "\n";
    if (files.empty()) return 0;
  }
  if (files.empty()) bad_input("validate: give case files, or --keys");
  // The memory estimate as `run` would make it with its default thread count.
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  // Every file is validated: its first error said (one line on stderr, as
  // any bad input), the next file then read; exit 2 when any was invalid.
  size_t invalid = 0;
  for (const auto& f : files) {
    try {
      const auto cases = load_noting_left_out(f, sets);
      for (const auto& c : cases) check_case_memory(c, threads, limit);
      std::cout << f << ": " << cases.size() << " case(s) valid\n";
      for (const auto& c : cases) std::cout << "  " << c.name << ": " << c.summary() << "\n";
    } catch (const Error& e) {
      // a --set value wrong in itself is every file's error: said once, as any bad input
      const bool of_the_file = std::string(e.what()).rfind("--set ", 0) != 0;
      if (e.kind != ErrorKind::bad_input || files.size() == 1 || !of_the_file) throw;
      ++invalid;
      std::cout << std::flush;
      say_failure(printable(e.what(), 4000));
    }
  }
  if (invalid) std::cout << invalid << " of " << files.size() << " file(s) invalid (each error above)\n";
  return invalid ? 2 : 0;
}

/// validate --profile P [FILE...]: the profile explained or refused (file,
/// line, what would be valid); each case of the files inside or outside it.
int cmd_validate_profile(const std::string& name, const std::vector<std::string>& files,
                         const std::vector<std::string>& sets) {
  const Profile p = load_profile(name);
  require_profile_fits(&p, 1);
  std::cout << p.file << ": profile " << p.name << " valid" << (p.about.empty() ? "" : ": " + p.about) << "\n";
  for (const auto& f : p.fix) std::cout << "  fix    " << f.key << " = " << f.value << "\n";
  for (const auto& a : p.allow) std::cout << "  allow  " << a.key << " in " << a.text() << "\n";
  const std::vector<std::string> all = p.sets_after(sets);
  for (const auto& file : files) {
    size_t inside = 0;
    // A case the fixed keys make invalid (score_on_hidden beside ep 4) lies
    // outside the profile; where they fit no case, every case does.
    LoadNotes notes;
    std::vector<Case> cases;
    try {
      cases = load_cases(file, all, &notes);
    } catch (const Error& e) {
      if (e.kind != ErrorKind::bad_input || p.fix.empty()) throw;
      const size_t n = load_cases(file, sets).size();
      std::cout << "  " << file << ": the profile's fixed keys fit none of its cases: " << e.what() << "\n"
                << file << ": 0 of " << n << " case(s) inside the profile\n";
      continue;
    }
    const std::string cause = left_out_cause(true, !sets.empty());
    for (const auto& m : notes.left_out) std::cout << "  " << file << ": " << left_out_note(m, cause) << "\n";
    // (about the cases inside the profile: the others are named below with why)
    for (const std::string& n : replaced_notes(notes, p.name, p.fixed_keys(), [&](const std::string& e) {
           return p.keeps_entry(e, cases, [](const std::string&) { return true; });
         }))
      std::cout << "  " << n << "\n";
    for (const auto& c : cases) {
      const std::string why = p.violation(c);
      inside += why.empty();
      if (!why.empty()) std::cout << "  " << file << ": " << c.name << " outside: " << why << "\n";
    }
    std::cout << file << ": " << inside << " of " << cases.size() + notes.left_out.size()
              << " case(s) inside the profile\n";
  }
  return 0;
}

int cmd_list(bool json) {
  const CudaStatus cs = cuda_status();
  auto backends = [](const Stage& s) {
    std::vector<std::string> v;
    for (Backend b : s.backends) v.push_back(enum_name(backend_table(), b));
    return v;
  };
  if (json) {
    nlohmann::json doc;
    doc["slots"] = slot_order();
    doc["variants"] = nlohmann::json::array();
    for (const auto& slot : slot_order())
      for (const auto& s : registry())
        if (s.slot == slot)
          doc["variants"].push_back({{"slot", s.slot}, {"variant", s.variant}, {"summary", s.summary}, {"backends", backends(s)}});
    doc["cuda"] = {{"built", cs.built}, {"devices", cs.devices}, {"message", cs.message}};
    doc["faults"] = nlohmann::json::array();
    for (const auto& f : fault_table()) doc["faults"].push_back({{"name", f.name}, {"what", f.what}});
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::cout << "registered stage variants (slot order; every applicable variant runs, the primary feeds the next slot;\n"
               "[the backends that implement it]):\n";
  for (const auto& slot : slot_order()) {
    std::cout << "\n" << slot << "\n";
    for (const auto& s : registry()) {
      if (s.slot != slot) continue;
      std::string b;
      for (const auto& n : backends(s)) b += (b.empty() ? "" : " ") + n;
      std::cout << "  " << s.variant << " [" << b << "]: " << s.summary << "\n";
    }
  }
  std::cout << "\nCUDA executor: " << (cs.built ? "built" : "not built") << ", " << cs.devices
            << " usable device(s): " << cs.message << "\n";
  std::cout << "\nplanted faults (--fault NAME):\n";
  for (const auto& f : fault_table()) std::cout << "  " << f.name << ": " << f.what << "\n";
  return 0;
}

uint64_t parse_u64_option(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0])) || *end != '\0' || errno == ERANGE)
    bad_input(flag + ": expected a non-negative integer, got '" + printable(text) + "'; valid: 0 to 2^64-1");
  return v;
}

FaultSet parse_faults(const std::vector<std::string>& names, std::string* flags = nullptr) {
  FaultSet fs;
  for (const auto& f : names) {
    try {
      fs.bits |= uint64_t(parse_fault(f));
    } catch (const std::invalid_argument& e) {
      bad_input(std::string("--fault: ") + e.what());
    }
    if (flags) *flags += " --fault " + f;
  }
  return fs;
}

struct BenchArgs {
  std::vector<std::string> files, sets;
  std::string threads, repeat = "5", warmup = "1", json, plot, backend = "host", max_memory, peer,
      peer_timeout = "600";
  CaseFilter cases;
  bool sweep = false;
};

/// The OpenMP wait policy in effect: the user's OMP_WAIT_POLICY, or
/// moeverify's default (set by adopt_passive_openmp_wait).
std::string g_omp_wait_policy;

/// Whether re-executing `self` (the resolved /proc/self/exe) runs this same
/// program as it was started: the file that holds this function's code must
/// be `self`, which it is not when a loader was run explicitly (ld.so
/// moeverify ...: `self` is the loader); and not under valgrind, which
/// preloads its core and would be left, silently, by the exec.
bool reexec_keeps_program(const char* self) {
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload && std::strstr(preload, "vgpreload")) return false;
  const auto here = reinterpret_cast<uintptr_t>(&reexec_keeps_program);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {  // "lo-hi perms offset dev inode path"
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2 || here < lo || here >= hi) continue;
    const size_t slash = line.find('/');
    struct stat a {}, b {};
    return slash != std::string::npos && stat(line.c_str() + slash, &a) == 0 && stat(self, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
  }
  return false;
}

/// libgomp's idle threads spin (hundreds of thousands of polls) before they
/// sleep. moeverify runs more threads than cores as a rule: in-process ranks
/// are threads, `fuzz`/`selftest --jobs` run configurations at once, and CI
/// or mpirun run several processes on the same cores; spinning threads then
/// take the cores from the ones with work (measured: docs/guide.md, "Threads
/// and the OpenMP wait policy"). libgomp reads OMP_WAIT_POLICY once, in its
/// initializer, before main; a setenv in the executable's earliest hook
/// (.preinit_array) did not reach it (glibc's start-up resets the
/// environment pointer after that hook), so it cannot be set in-process. When the user has not chosen a policy (unset or empty, which
/// libgomp ignores) this sets OMP_WAIT_POLICY=passive and re-executes the
/// binary, by its resolved path, so the process keeps its name. The
/// re-executed process removes both variables again, so the commands
/// moeverify starts (`--impl`, `--peer`) see the user's environment. Where a
/// re-exec would not run the same program, or it fails, libgomp keeps its
/// default.
void adopt_passive_openmp_wait(char** argv) {
  static const char kMarker[] = "MOEVERIFY_SET_OMP_WAIT_POLICY";
  const char* marker = std::getenv(kMarker);
  const char* v = std::getenv("OMP_WAIT_POLICY");
  if (marker && v && std::strcmp(v, "passive") == 0) {  // the re-executed process
    unsetenv(kMarker);
    unsetenv("OMP_WAIT_POLICY");
    g_omp_wait_policy = "passive (moeverify's default)";
    return;
  }
  if (marker) unsetenv(kMarker);  // not ours: inherited from elsewhere
  if (v && *v) {
    g_omp_wait_policy = v;
    return;
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  if (!reexec_keeps_program(self)) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  setenv(kMarker, "1", 1);
  execv(self, argv);
  unsetenv(kMarker);  // the exec failed: run on with libgomp's default
  if (v) setenv("OMP_WAIT_POLICY", v, 1);
  else unsetenv("OMP_WAIT_POLICY");
}

int cmd_bench(const CLI::App* cmd, const BenchArgs& a) {
  // Every case is timed on the backend (the case key `backend` of each); one
  // that cannot run here at all is NOT_SUPPORTED before anything runs.
  if (const std::string why = backend_unavailable(backend_flag(a.backend)); !why.empty())
    throw Error(ErrorKind::not_supported, "NOT_SUPPORTED: bench " + why);
  if (launched_under_mpi()) bad_input("bench: runs its EP ranks in one process; valid: start it without mpirun");
  BenchOptions o;
  o.omp_wait_policy = g_omp_wait_policy;
  o.threads = cmd->count("--threads") ? parse_int_option("--threads", a.threads, 1, 256)
                                      : int(std::max(1u, std::thread::hardware_concurrency()));
  o.repeat = parse_int_option("--repeat", a.repeat, 1, 100000);
  o.warmup = parse_int_option("--warmup", a.warmup, 0, 100000);
  o.sweep = a.sweep;
  o.sets = a.sets;
  if (cmd->count("--peer") && a.peer.find_first_not_of(" \t") == std::string::npos)
    bad_input("--peer: the command is empty; valid: a command such as \"python3 -m moeverify.peer {spec}\"");
  o.peer = a.peer;
  o.peer_timeout_s = parse_real_option("--peer-timeout", a.peer_timeout, 1, 86400);
  if (cmd->count("--peer-timeout") && !cmd->count("--peer"))
    bad_input("bench: --peer-timeout goes with --peer CMD; valid: add --peer, or drop it");
  if (cmd->count("--backend")) o.sets.push_back("backend=" + a.backend);
  const MemoryLimit limit = memory_limit(cmd, a.max_memory);
  a.cases.check_not_empty();
  const bool want_json = cmd->count("--json") > 0, want_plot = cmd->count("--plot") > 0;
  if (want_json && a.json.empty()) bad_input("--json: the path is empty; valid: a file path such as bench.json");
  if (want_plot && a.plot.empty()) bad_input("--plot: the path is empty; valid: a file path such as bench.svg");
  std::vector<std::pair<std::string, Case>> selected;
  std::vector<std::string> names;
  for (const auto& f : a.files)
    for (const auto& c : load_noting_left_out(f, o.sets, a.cases)) {
      names.push_back(c.name);
      if (a.cases.selects(c.name)) selected.push_back({f, c});
    }
  a.cases.check_each_used(names, "the given files");
  for (const auto& [f, c] : selected) check_case_memory(c, o.threads, limit);
  if (want_json) check_output_file("--json", a.json, a.files);
  if (want_plot) check_output_file("--plot", a.plot, a.files);
  if (want_json && want_plot && a.json == a.plot)
    bad_input("--json and --plot name the same file " + printable(a.json, 200) + "; valid: two paths");
  std::cout << "moeverify " << MOEVERIFY_VERSION << " bench  threads=" << o.threads << "  repeat=" << o.repeat
            << "  warmup=" << o.warmup << "  backend=" << a.backend << "\n";
  std::vector<CaseBench> all;
  Outcome worst_all = Outcome::PASSED;
  int peer_failed = 0;
  for (size_t i = 0; i < selected.size(); ++i) {
    std::cerr << "[" << i + 1 << "/" << selected.size() << "] " << selected[i].second.name << "\n";
    o.file = selected[i].first;
    all.push_back(bench_case(selected[i].second, o, std::cerr));
    print_bench(all.back(), std::cout);
    worst_all = worst(worst_all, all.back().outcome);
    peer_failed += !all.back().peer_note.empty();
  }
  if (worst_all != Outcome::PASSED)
    std::cout << "\nWARNING: a verifying run was " << outcome_name(worst_all)
              << ": the timings are of a fast path that is not verified\n";
  // A peer asked for and not run is an ERROR (exit 3) once every case has
  // been timed: a CI job comparing against it must not pass without it. A
  // wrong fast path (INCORRECT, exit 1) stays the verdict.
  if (peer_failed) {
    std::cout << "\nERROR: the peer gave no figures for " << peer_failed << " of " << all.size()
              << " case(s) (each case's \"not run\" line says why)\n";
    if (worst_all != Outcome::INCORRECT) worst_all = worst(worst_all, Outcome::ERROR);
  }
  if (want_json) {
    const std::string err = write_file(a.json, {bench_json(all, o)});
    if (!err.empty()) bad_input("--json: " + err + "; valid: a writable file path such as bench.json");
  }
  if (want_plot) {
    const std::string err = write_file(a.plot, {bench_svg(all)});
    if (!err.empty()) bad_input("--plot: " + err + "; valid: a writable file path such as bench.svg");
  }
  return exit_status(worst_all);
}

struct FuzzArgs {
  std::string seconds, iterations, seed, jobs = "1", backend = "host", out = "fuzz-failures", json;
  std::vector<std::string> faults, sets;
  bool no_shrink = false;
  std::string impl, impl_timeout = "60", profile, shrink_budget = "400", shrink_seconds = "300", emit, require;
  bool worker = false, keep = false, strict_ties = false;
};

/// fuzz --impl's options, checked: CMD's {case} (or --worker).
ImplOptions impl_options(const CLI::App* cmd, const FuzzArgs& a) {
  ImplOptions impl;
  impl.cmd = a.impl;
  impl.worker = a.worker;
  impl.keep = a.keep;
  impl.timeout_s = parse_real_option("--impl-timeout", a.impl_timeout, 0.1, 86400);
  impl.strict_ties = a.strict_ties;
  impl.require = a.require;
  if (cmd->count("--require")) {
    ExternalOptions parsed;  // refused here, before anything is drawn
    parse_require(a.require, parsed);
  }
  if (a.impl.empty()) bad_input("--impl: the command is empty; valid: e.g. --impl \"python3 my_moe.py {case}\"");
  const bool has_case = a.impl.find("{case}") != std::string::npos;
  if (!a.worker && !has_case)
    bad_input("--impl " + printable(a.impl, 200) + ": no {case} in the command; valid: a command with {case} where the "
              "case folder goes, or --worker for a command that reads case folders on stdin");
  if (a.worker && has_case)
    bad_input("--impl with --worker: the worker reads case folders on stdin, one per line; valid: a command without "
              "{case} (e.g. \"python3 my_moe.py --serve\")");
  if (!a.faults.empty() || cmd->count("--backend"))
    bad_input("fuzz --impl: --fault and --backend apply to moeverify's own fast paths; valid: --impl without them");
  return impl;
}

int cmd_fuzz(const CLI::App* cmd, const FuzzArgs& a) {
  const bool impl = cmd->count("--impl") > 0, emit = cmd->count("--emit") > 0;
  if (!impl && (a.worker || a.keep || a.strict_ties || cmd->count("--impl-timeout") || cmd->count("--require") ||
                cmd->count("--shrink-seconds")))
    bad_input("fuzz: --worker, --keep, --impl-timeout, --shrink-seconds, --require and --strict-ties go with --impl "
              "CMD; valid: add --impl, or drop them");
  if (emit && (impl || cmd->count("--seconds") || !cmd->count("--iterations")))
    bad_input("fuzz --emit FILE writes --iterations N configurations and runs none; valid: --emit FILE --iterations N "
              "[--seed S] [--profile P] [--backend B], without --impl or --seconds");
  // Every drawn configuration runs on the backend; one that cannot run here
  // at all is NOT_SUPPORTED before anything is drawn.
  if (const std::string why = backend_unavailable(backend_flag(a.backend)); !impl && !why.empty())
    throw Error(ErrorKind::not_supported, "NOT_SUPPORTED: fuzz " + why);
  FuzzOptions o;
  o.backend = a.backend;
  if (cmd->count("--seconds")) o.seconds = parse_real_option("--seconds", a.seconds, 0.1, 1e7);
  if (cmd->count("--iterations")) o.iterations = parse_u64_option("--iterations", a.iterations);
  if (cmd->count("--iterations") && o.iterations == 0)
    bad_input("--iterations 0: no configuration to draw (0 once meant no limit); valid: 1 or more, or --seconds S");
  if (o.seconds <= 0 && o.iterations == 0) o.seconds = 60;
  o.seed = cmd->count("--seed") ? parse_u64_option("--seed", a.seed)
                                : uint64_t(std::chrono::system_clock::now().time_since_epoch().count()) % 1000000007u;
  o.jobs = parse_int_option("--jobs", a.jobs, 1, 256);
  o.faults = parse_faults(a.faults, &o.fault_flags);
  o.out_dir = a.out;
  o.shrink = !a.no_shrink;
  o.shrink_budget = parse_int_option("--shrink-budget", a.shrink_budget, 1, 1000000);
  o.shrink_seconds = parse_real_option("--shrink-seconds", a.shrink_seconds, 0, 86400);
  if (a.out.empty()) bad_input("--out: the path is empty; valid: a folder for the shrunk failures");
  std::unique_ptr<Profile> profile;
  if (cmd->count("--profile")) profile = std::make_unique<Profile>(load_profile(a.profile));
  if (!a.sets.empty()) {
    profile = std::make_unique<Profile>(with_sets(profile.get(), a.sets));
    o.sets = a.sets;
  }
  o.profile = profile.get();
  const std::vector<std::string> reads =
      profile && !profile->file.empty() ? std::vector<std::string>{profile->file} : std::vector<std::string>{};
  if (cmd->count("--json")) {
    if (a.json.empty()) bad_input("--json: the path is empty; valid: a file path such as fuzz.json");
    check_output_file("--json", a.json, reads);
  }
  if (emit) {
    if (a.emit.empty()) bad_input("--emit: the path is empty; valid: a case file path such as soak.yaml");
    check_output_file("--emit", a.emit, reads);
    const std::string replay = "moeverify fuzz --seed " + std::to_string(o.seed) + " --iterations " +
                               std::to_string(o.iterations) + profile_flags(o) + (a.backend == "host" ? "" : " --backend " + a.backend);
    const std::string err = write_file(a.emit, {emit_case_file(o, replay)});
    if (!err.empty()) bad_input("--emit: " + err);
    std::cout << a.emit << ": " << o.iterations << " configurations of seed " << o.seed
              << (profile && !profile->name.empty() ? " inside profile " + profile->name : "")
              << (o.sets.empty() ? "" : " with --set") << " (run them: " << self_command() << " run " << shell_word(a.emit) << ")\n";
    return 0;
  }
  if (impl) {
    const ImplOptions io = impl_options(cmd, a);
    const FuzzResult r = fuzz_impl(o, io, std::cerr);
    print_impl_result(r, std::cout, o.profile);
    if (cmd->count("--json")) {
      const std::string err = write_file(a.json, {impl_json(r)});
      if (!err.empty()) bad_input("--json: " + err);
    }
    return fuzz_impl_status(r);
  }
  const FuzzResult r = fuzz(o, std::cerr);
  print_fuzz_result(r, std::cout);
  if (cmd->count("--json")) {
    const std::string err = write_file(a.json, {fuzz_json(r)});
    if (!err.empty()) bad_input("--json: " + err);
  }
  // A planted fault the fuzz never found: as `run --fault`, exit 4.
  if (!o.fault_flags.empty() && r.failures.empty()) {
    std::cout << "PLANTED FAULT NOT CAUGHT:" << o.fault_flags << " found by none of " << r.configurations
              << " configurations (exit 4)\n";
    return 4;
  }
  return r.failures.empty() ? 0 : 1;
}

struct SelftestArgs {
  std::string cases = MOEVERIFY_SOURCE_DIR "/cases", seed = "1", budget = "400",
              jobs = std::to_string(std::max(1u, std::thread::hardware_concurrency())), json;
  bool quick = false;
};

int cmd_selftest(const CLI::App* cmd, const SelftestArgs& a) {
  SelftestOptions o;
  o.cases_dir = a.cases;
  o.seed = parse_u64_option("--seed", a.seed);
  o.fuzz_budget = parse_u64_option("--budget", a.budget);
  if (o.fuzz_budget == 0)
    bad_input("--budget 0: the fuzz would draw nothing for a fault no case catches; valid: 1 or more configurations per fault");
  o.jobs = parse_int_option("--jobs", a.jobs, 1, 256);
  o.quick = a.quick;
  if (cmd->count("--json")) check_output_file("--json", a.json);
  const std::vector<SelftestRow> rows = selftest(o, std::cerr);
  print_selftest(rows, std::cout);
  if (cmd->count("--json")) {
    const std::string err = write_file(a.json, {selftest_json(rows)});
    if (!err.empty()) bad_input("--json: " + err);
  }
  for (const auto& r : rows)
    if (!r.caught) return 1;
  return 0;
}

/// A command-line parse error as one line: an unknown command is named, and
/// CLI11's multi-line texts are joined.
std::string cli_error(const CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  const std::string valid = "valid: run, validate, list, fuzz, selftest, bench, export or check (see moeverify --help)";
  if (app.get_subcommands().empty()) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (!arg.empty() && arg[0] == '-') continue;
      return "unknown command '" + printable(arg) + "'; " + valid;
    }
    if (argc == 1) return "no command given; " + valid;
  }
  std::string msg = e.what();
  for (char& ch : msg)
    if (ch == '\n') ch = ' ';
  const std::string sub = app.get_subcommands().empty() ? "" : app.get_subcommands().front()->get_name() + " ";
  return printable(msg, 300) + "; valid: see `moeverify " + sub + "--help`";
}

/// Every subcommand of the tool with the values its options fill (CLI11
/// writes into these while parsing).
struct Commands {
  RunArgs ra;
  bool keys = false, keys_markdown = false, list_json = false;
  std::vector<std::string> vfiles, vsets, ex_sets;
  std::string vmax_memory, ex_file, ex_dir, ex_profile, vprofile, ex_max_memory, ck_max_memory;
  CaseFilter ex_cases;
  CheckArgs ck;
  FuzzArgs fa;
  SelftestArgs sa;
  BenchArgs ba;
  CLI::App *run = nullptr, *val = nullptr, *ls = nullptr, *exp = nullptr, *chk = nullptr, *fz = nullptr,
           *st = nullptr, *bn = nullptr;
};

/// The help text of --max-memory (run, validate, bench, export, check).
const char* const kMemHelp = "refuse a case whose estimated peak memory exceeds this (512M, 8G, 1.5GiB; "
                             "default 80% of the tightest of physical memory, the cgroup limit and ulimit -v, shared among the "
                             "ranks on a node)";

/// A repeatable option takes one value per occurrence: left to take many,
/// `--set KEY=V FILE` would swallow the case file as a second value.
CLI::Option* repeatable(CLI::Option* o) {
  return o->expected(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

/// run, validate and list.
void add_run_validate_list(CLI::App& app, Commands& c) {
  c.run = app.add_subcommand("run", "run every case of the files: reference vs fast, stage by stage");
  c.run->add_option("files", c.ra.files, "case files (YAML)")->required();
  repeatable(c.run->add_option("--set", c.ra.sets, "override a case key for every case, e.g. --set shape.tokens=128 (repeatable)"));
  c.run->add_option("--threads", c.ra.threads, "host executor threads, 1 to 256 (default: the core count)")
      ->type_name("INT");
  c.run->add_option("--json", c.ra.json, "also write the report as JSON to this file");
  c.run->add_option("--dump", c.ra.dump, "write every stage's inputs and outputs as .npy under this folder");
  repeatable(c.run->add_option("--fault", c.ra.faults, "turn on a planted fault (see `moeverify list`); the run must then fail (every case PASSED: exit 4, the fault not caught; repeatable)"));
  repeatable(c.run->add_option("--case", c.ra.cases.patterns,
                  "run only these cases: names or shell patterns over the expanded sweep names (repeatable)"));
  c.run->add_option("--backend", c.ra.backend,
                  "host (default) | cuda | emulated (the device plumbing on host memory, for testing): where the "
                  "fast path runs (the case key `backend`)");
  c.run->add_option("--collective-timeout", c.ra.timeout,
                  "seconds before a collective some rank never joins fails (in-process and MPI), 0.05 to 3600 (default 30)")
      ->type_name("SECONDS");
  c.run->add_option("--max-memory", c.ra.max_memory, kMemHelp)->type_name("SIZE");
  c.run->add_flag("--verbose", c.ra.verbose,
                "show every check of every tensor and rank and every variant note (default: one line per stage "
                "variant, and the per-tensor rows of checks that did not pass)");

  c.val = app.add_subcommand("validate", "check case files without running them");
  c.val->add_option("files", c.vfiles, "case files (YAML)");
  repeatable(c.val->add_option("--set", c.vsets, "override a case key, as for run"));
  c.val->add_flag("--keys", c.keys, "list every case key with its valid values");
  c.val->add_flag("--markdown", c.keys_markdown, "with --keys: as the Markdown table of docs/case-keys.md");
  c.val->add_option("--max-memory", c.vmax_memory, kMemHelp)->type_name("SIZE");
  c.val->add_option("--profile", c.vprofile, "check a profile file (or shipped name); with case files, also say which "
                    "cases lie outside it")->type_name("NAME|FILE");

  c.ls = app.add_subcommand("list", "list registered paths, their stages and backends, and the planted faults");
  c.ls->add_flag("--json", c.list_json, "print the list as JSON (each variant with its `backends`)");
}

/// export and check (docs/contract.md §15).
void add_export_check(CLI::App& app, Commands& c) {
  c.exp = app.add_subcommand("export", "write a case's inputs and expected stage outputs as .npy + manifest.json");
  c.exp->add_option("file", c.ex_file, "case file (YAML)")->required();
  c.exp->add_option("dir", c.ex_dir, "output folder (one folder per case inside)")->required();
  repeatable(c.exp->add_option("--case", c.ex_cases.patterns, "export only these cases: names or shell patterns (repeatable)"));
  repeatable(c.exp->add_option("--set", c.ex_sets, "override a case key, as for run"));
  c.exp->add_option("--max-memory", c.ex_max_memory, kMemHelp)->type_name("SIZE");
  c.exp->add_option("--profile", c.ex_profile, "set the profile's fixed keys on every case and leave out the cases "
                    "outside it (a shipped name such as torchtitan, or a profile file)")->type_name("NAME|FILE");
  c.chk = app.add_subcommand("check", "check an implementation's outputs against the reference, stage by stage");
  c.chk->add_option("dir", c.ck.dirs, "folders written by export: each a case folder or a folder of them")
      ->required();
  c.chk->add_option("--actual", c.ck.actual_dir, "the implementation's .npy files (default DIR/actual); where DIR "
                    "holds case folders, one folder per case: DIR2/CASE/ (default DIR/CASE/actual)");
  c.chk->add_option("--json", c.ck.json, "also write the report as JSON to this file");
  c.chk->add_flag("--allow-unknown", c.ck.allow_unknown,
                "ignore (and list) files under actual/ that name no expected tensor; by default they are refused");
  c.chk->add_option("--require", c.ck.require, "stages whose outputs must be written on every rank: all (at EP 1 "
                    "not the stages that move rows between ranks), STAGE,STAGE, or all,STAGE (a missing one is "
                    "INCORRECT; by default an unwritten stage is fed the reference's)")
      ->type_name("all|STAGES");
  c.chk->add_flag("--strict-ties", c.ck.external.strict_ties,
                "hold routing to the lowest expert id among exact ties (for implementations that promise it)");
  c.chk->add_option("--max-memory", c.ck_max_memory, kMemHelp)->type_name("SIZE");
  c.chk->add_flag("--verbose", c.ck.verbose,
                  "show every check of every tensor and rank (default: a passing case in a few lines with the notes "
                  "of its checks; a failing one as a table of stages and the checks that did not pass)");
}

/// fuzz, selftest and bench.
void add_fuzz_selftest_bench(CLI::App& app, Commands& c) {
  c.fz = app.add_subcommand("fuzz", "random valid configurations of every path; failures shrunk to YAML cases");
  c.fz->add_option("--seconds", c.fa.seconds, "stop after this many seconds (default 60 when --iterations is not given)")
      ->type_name("SECONDS");
  c.fz->add_option("--iterations", c.fa.iterations, "stop after this many configurations")->type_name("N");
  c.fz->add_option("--seed", c.fa.seed, "the stream of configurations (default: from the clock; printed first)")
      ->type_name("N");
  c.fz->add_option("--jobs", c.fa.jobs, "configurations run at once (default 1)")->type_name("N");
  c.fz->add_option("--backend", c.fa.backend,
                 "host (default), cuda or emulated: the case key `backend` of every drawn configuration");
  repeatable(c.fz->add_option("--fault", c.fa.faults, "turn on a planted fault: the fuzz must then find it (found by no configuration: exit 4; repeatable)"));
  c.fz->add_option("--out", c.fa.out, "folder for the shrunk failing cases (default fuzz-failures, made on the first)");
  c.fz->add_option("--json", c.fa.json, "also write the result as JSON");
  c.fz->add_flag("--no-shrink", c.fa.no_shrink, "write failures as drawn");
  c.fz->add_option("--shrink-seconds", c.fa.shrink_seconds,
                   "with --impl: seconds at most spent shrinking one failure (default 300; a candidate under way "
                   "finishes)")->type_name("SECONDS");
  c.fz->add_option("--shrink-budget", c.fa.shrink_budget,
                   "configurations run at most to shrink one failure (default 400)")->type_name("N");
  c.fz->add_option("--impl", c.fa.impl,
                   "fuzz YOUR implementation: a shell command with {case} for an exported case folder; it writes "
                   "{case}/actual/ and exits 0 (judged as check does), 77 (configuration not supported: skipped) or "
                   "anything else (crashed)")
      ->type_name("CMD");
  c.fz->add_flag("--worker", c.fa.worker,
                 "with --impl: CMD is started once per job and reads case folders on stdin, answering one line each "
                 "(done | skip REASON | error REASON; Python: moeverify.serve)");
  c.fz->add_option("--impl-timeout", c.fa.impl_timeout, "with --impl: seconds per configuration before it counts as "
                   "crashed (default 60)")->type_name("SECONDS");
  c.fz->add_option("--profile", c.fa.profile, "draw only what the implementation supports, with its conventions: a "
                   "shipped name (torchtitan, torchtitan-0.3, megatron, megatron-0.16, megatron-0.16-probs-on-input; "
                   "their files in cases/profiles/) or a profile file")->type_name("NAME|FILE");
  repeatable(c.fz->add_option("--set", c.fa.sets, "fix a case key in every drawn configuration, e.g. --set "
                              "combine.order=any (repeatable; over --profile: a key it fixes must keep its value, "
                              "one it allows must stay inside)"))->type_name("KEY=VALUE");
  c.fz->add_option("--emit", c.fa.emit, "write the --iterations N configurations (inside --profile) as a case file, "
                   "run none: e.g. to run them under mpirun")->type_name("FILE");
  c.fz->add_flag("--keep", c.fa.keep, "with --impl: keep the temporary case folders (their folder is printed)");
  c.fz->add_option("--require", c.fa.require, "with --impl: as check --require, for every configuration: stages "
                   "whose outputs must be written (all, or STAGE,STAGE)")->type_name("all|STAGES");
  c.fz->add_flag("--strict-ties", c.fa.strict_ties, "with --impl: as check --strict-ties, hold routing to the lowest "
                 "expert id among exact ties");

  c.st = app.add_subcommand("selftest", "show that every planted fault is caught by a case, the fuzz or a probe");
  c.st->add_option("--cases", c.sa.cases, "the shipped case files (default: this build's source cases/)");
  c.st->add_option("--seed", c.sa.seed, "the fuzz stream (default 1)")->type_name("N");
  c.st->add_option("--budget", c.sa.budget, "fuzz configurations per fault (default 400)")->type_name("N");
  c.st->add_option("--jobs", c.sa.jobs, "fuzz configurations run at once (default: the core count)")->type_name("N");
  c.st->add_option("--json", c.sa.json, "also write the table as JSON");
  c.st->add_flag("--quick", c.sa.quick,
                 "shipped cases and probes first, the fuzz only for a fault no case catches (not shrunk)");

  c.bn = app.add_subcommand("bench", "time every stage variant against a memcpy of the same bytes (docs/guide.md: Benchmarks)");
  c.bn->add_option("files", c.ba.files, "case files (YAML)")->required();
  repeatable(c.bn->add_option("--set", c.ba.sets, "override a case key, as for run"));
  repeatable(c.bn->add_option("--case", c.ba.cases.patterns, "bench only these cases: names or shell patterns (repeatable)"));
  c.bn->add_option("--threads", c.ba.threads, "host executor threads, 1 to 256 (default: the core count)")->type_name("INT");
  c.bn->add_option("--repeat", c.ba.repeat, "timed calls of each fast function (default 5)")->type_name("N");
  c.bn->add_option("--warmup", c.ba.warmup, "untimed calls before them (default 1)")->type_name("N");
  c.bn->add_option("--json", c.ba.json, "also write the results as JSON (schema moeverify-bench/1)");
  c.bn->add_option("--plot", c.ba.plot, "also draw the roof shares (and the --sweep growth) as an SVG file");
  c.bn->add_flag("--sweep", c.ba.sweep, "also verify each case at 1/4, 1/2 and 1 of its T, D and R: time and peak memory");
  c.bn->add_option("--backend", c.ba.backend, "host (default), cuda or emulated: the case key `backend` of every case; on a device each stage is also "
                   "timed by the device's clock against a device-to-device copy");
  c.bn->add_option("--max-memory", c.ba.max_memory, kMemHelp)->type_name("SIZE");
  c.bn->add_option("--peer", c.ba.peer,
                   "also time another implementation of the stages on each case's shape and print moeverify/peer "
                   "ratios: CMD gets {spec}, a JSON file of the shape, and prints its seconds as JSON "
                   "(PyTorch's: \"python3 -m moeverify.peer {spec}\"; docs/guide.md, Benchmarks)")
      ->type_name("CMD");
  c.bn->add_option("--peer-timeout", c.ba.peer_timeout,
                   "with --peer: seconds the peer may take on one case before it is ended (default 600)")
      ->type_name("SECONDS");
}

/// Runs the parsed subcommand; its exit status.
int dispatch(Commands& c) {
  if (c.run->parsed()) {
    const int rc = cmd_run(c.run, c.ra);
    nccl_finalize_if_started();
    mpi_finalize_if_started();
    return rc;
  }
  if (c.val->parsed() && c.val->count("--profile")) return cmd_validate_profile(c.vprofile, c.vfiles, c.vsets);
  if (c.val->parsed()) return cmd_validate(c.val, c.vfiles, c.vsets, c.keys, c.keys_markdown, c.vmax_memory);
  if (c.fz->parsed()) return cmd_fuzz(c.fz, c.fa);
  if (c.st->parsed()) return cmd_selftest(c.st, c.sa);
  if (c.bn->parsed()) return cmd_bench(c.bn, c.ba);
  if (c.exp->parsed()) {
    std::unique_ptr<Profile> p;
    if (c.exp->count("--profile")) p = std::make_unique<Profile>(load_profile(c.ex_profile));
    set_command_memory_limit(memory_limit(c.exp, c.ex_max_memory));
    return cmd_export(c.ex_file, c.ex_dir, c.ex_cases, c.ex_sets, p.get());
  }
  if (c.chk->parsed()) {
    c.ck.has_actual = c.chk->count("--actual") > 0;
    c.ck.want_json = c.chk->count("--json") > 0;
    set_command_memory_limit(memory_limit(c.chk, c.ck_max_memory));
    return cmd_check(c.ck);
  }
  return cmd_list(c.list_json);
}

/// Writes a failure line on stderr in one write (ranks share stderr).
/// Under mpirun the ranks mostly fail alike (the same files, the same
/// flags), and the job printed the line once per rank. Rank 0 says it at
/// once; any other rank g_failure_delay later, by when mpirun has ended the
/// job for rank 0's exit status (OpenMPI 4.1 here took about 1 s to kill
/// the other ranks), so the line comes once. A rank that failed alone (a
/// file missing on its node, a device of its own) still says it, its rank
/// named.
void say_failure(const std::string& text) {
  const int rank = launched_rank();
  if (rank > 0) std::this_thread::sleep_for(g_failure_delay);
  std::cerr << ("moeverify: " + (rank > 0 ? "rank " + std::to_string(rank) + ": " : std::string()) + text + "\n");
}

}  // namespace

int main(int argc, char** argv) {
  adopt_passive_openmp_wait(argv);
  set_self_command(argv[0]);
  if (launched_under_mpi() && argc > 1 && std::strcmp(argv[1], "run") == 0) g_failure_delay = std::chrono::seconds(3);
  // Every tensor comes from glibc's heaps, and freed memory stays there for
  // the next stage's tensors of the same sizes. With glibc's defaults each
  // tensor of more than 32 MiB is an mmap of its own and goes back to the OS
  // when freed, so every stage paid a page fault per 4 KiB of every output
  // (a third of the run at T = 4096, D = 4096), for a resident peak 6 to 9%
  // lower (measured in issue 7's closing note). The peak is still measured
  // and reported per case, and the estimate bounds it.
  mallopt(M_MMAP_MAX, 0);
  // One heap for every thread: the in-process ranks (threads) free tensors
  // that other ranks' threads allocate next; per-thread arenas could not
  // reuse them (measured: 10% faster and a 4% lower peak on the DeepSeek
  // shape at T = 1024).
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_TRIM_THRESHOLD, -1);  // -1: never trim (mallopt(3))
  CLI::App app{"moeverify: verify fast MoE token paths against an independent CPU reference"};
  app.set_version_flag("--version", std::string("moeverify ") + MOEVERIFY_VERSION);
  app.require_subcommand(1);
  app.footer("Exit codes: 0 PASSED, 1 INCORRECT (fuzz: a failure or a crash of --impl), 2 bad input (file, line, "
             "what would be valid), 3 ERROR or an internal error, 4 NOT_VERIFIED (nothing could show a bug), "
             "5 NOT_SUPPORTED; a run exits with its worst case; fuzz --impl cut short by SIGINT or SIGTERM: 130 or 143 "
             "unless it found a failure.");
  Commands c;
  add_run_validate_list(app, c);
  add_export_check(app, c);
  add_fuzz_selftest_bench(app, c);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    say_failure(cli_error(app, e, argc, argv));
    return 2;
  }
  try {
    return dispatch(c);
  } catch (const Error& e) {
    // The last guard of "one line": messages escape user text themselves.
    say_failure(printable(e.what(), 4000));
    return e.kind == ErrorKind::bad_input ? 2 : e.kind == ErrorKind::not_supported ? exit_status(Outcome::NOT_SUPPORTED) : 3;
  } catch (const OutOfMemory& e) {
    say_failure(printable(e.message(), 4000));
    return 3;
  } catch (const std::bad_alloc&) {  // outside the runner: no case or stage to name
    say_failure(OutOfMemory().message());
    return 3;
  } catch (const std::exception& e) {
    say_failure("internal error: " + printable(e.what(), 4000));
    return 3;
  }
}
