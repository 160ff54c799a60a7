#include "fuzz.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>

#include "../kernels/ep_host.h"
#include "../kernels/moe_host.h"
#include "case.h"
#include "dump.h"
#include "error.h"
#include "memory_estimate.h"
#include "random_case.h"
#include "fuzz_shrink.h"
#include "profile.h"
#include "runner.h"
#include "subprocess.h"

namespace moev {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string without_rank(const std::string& t) { return t.substr(0, t.find('@')); }

/// Threads per configuration: part of the draw (the multi-chunk sort and the
/// thread-count independence need more than one), fixed by the index.
int threads_of(uint64_t index) { return 1 + int(index % 2); }

Verdict run_yaml(const std::string& yaml, const FuzzOptions& o, int threads) {
  const Case c = load_one_case(yaml, "fuzz");
  RunOptions ro;
  ro.threads = threads;
  ro.faults = o.faults;
  ro.collective_timeout_ms = o.collective_timeout_ms;
  try {
    return verdict_of(run_case(c, ro));
  } catch (const std::exception& e) {
    return Verdict{Outcome::ERROR, "run/-/-", "run/-", e.what()};
  }
}

int64_t int_at(const YAML::Node& n, const char* a, const char* b, int64_t dflt) {
  return n[a] && n[a][b] && n[a][b].IsScalar() ? n[a][b].as<int64_t>() : dflt;
}

/// Smaller configurations near `n`, most shrinking first: fewer tokens and
/// ranks, smaller D, F, E, K, then options switched back to their defaults.
/// Invalid ones are dropped by the loader.
std::vector<YAML::Node> shrink_candidates(const YAML::Node& n) {
  std::vector<YAML::Node> out;
  auto with = [&](const auto& edit) {
    YAML::Node c = YAML::Clone(n);
    edit(c);
    out.push_back(c);
  };
  const YAML::Node shape = n["shape"];
  if (shape && shape["tokens_per_rank"]) {
    const YAML::Node tpr = shape["tokens_per_rank"];
    const int64_t hi = tpr.IsSequence() ? [&] {
      int64_t m = 0;
      for (const auto& e : tpr) m = std::max(m, e.as<int64_t>());
      return m;
    }() : tpr["uniform"][1].as<int64_t>();
    with([&](YAML::Node& c) {
      c["shape"].remove("tokens_per_rank");
      c["shape"]["tokens"] = hi;
    });
    if (tpr.IsSequence())
      for (size_t i = 0; i < tpr.size(); ++i)
        if (tpr[i].as<int64_t>() > 0)
          with([&](YAML::Node& c) { c["shape"]["tokens_per_rank"][i] = tpr[i].as<int64_t>() / 2; });
  }
  const int ep = n["ep"] ? n["ep"].as<int>() : 1;
  const auto to_ranks = [](YAML::Node& c, int r) {  // the first r ranks' token counts kept
    c["ep"] = r;
    YAML::Node tpr = c["shape"]["tokens_per_rank"];
    if (!tpr || !tpr.IsSequence()) return;
    YAML::Node cut(YAML::NodeType::Sequence);
    for (int i = 0; i < r; ++i) cut.push_back(tpr[i]);
    c["shape"]["tokens_per_rank"] = cut;
  };
  for (int r = 1; r < ep; r *= 2)
    if (ep % r == 0) with([&](YAML::Node& c) { to_ranks(c, r); });
  // Fewer ranks where the rank count has no power-of-two divisor below it
  // (EP 7 shrank to EP 1 alone): the local expert count kept, E and K cut
  // to fit.
  const int64_t experts = int_at(n, "shape", "experts", -1), top_k = int_at(n, "shape", "top_k", -1);
  if (experts > 0 && experts % ep == 0)
    for (int r = 2; r < ep; r *= 2)
      if (ep % r != 0)
        with([&](YAML::Node& c) {
          to_ranks(c, r);
          c["shape"]["experts"] = experts / ep * r;
          if (top_k > experts / ep * r) c["shape"]["top_k"] = experts / ep * r;
        });
  const struct { const char* key; int64_t floor; } dims[] = {
      {"tokens", 0}, {"seq_len", 0}, {"batch", 1}, {"experts", 1}, {"top_k", 1}, {"hidden", 1}, {"ffn", 1}};
  for (const auto& d : dims) {
    const int64_t v = int_at(n, "shape", d.key, -1);
    if (v < 0) continue;
    // Small values first, then fractions; small even numbers and v - 2 keep
    // failures that need a multiple of something (M* % E_l, say).
    std::vector<int64_t> cands = {d.floor, d.floor + 1, 2, 4, 8, 16, v / 4, v / 4 * 2, v / 2, v - 2, v - 1};
    std::sort(cands.begin(), cands.end());
    cands.erase(std::unique(cands.begin(), cands.end()), cands.end());
    for (int64_t cand : cands)
      if (cand >= d.floor && cand < v) with([&](YAML::Node& c) { c["shape"][d.key] = cand; });
  }
  for (const char* section : {"router", "experts", "shared_experts", "combine", "equal_split", "tolerance"})
    if (n[section]) with([&](YAML::Node& c) { c.remove(section); });
  for (const char* section : {"router", "experts", "shared_experts", "combine", "equal_split", "tolerance"})
    if (n[section] && n[section].IsMap() && n[section].size() > 1)
      for (const auto& kv : n[section]) {
        const std::string k = kv.first.Scalar();
        with([&](YAML::Node& c) { c[section].remove(k); });
      }
  for (const char* key : {"score_before_experts", "align", "empty_groups", "permute", "dtype", "data",
                          "router.gate_dtype", "router.score_dtype", "score_multiply", "experts.rounding", "experts.compute_dtype", "experts.w13_fused", "experts.weights", "sp",
                          "sp_padding", "backward", "layers", "capacity", "dispatch"})
    if (n[key]) with([&](YAML::Node& c) { c.remove(key); });
  return out;
}

/// A drawn configuration with the case key `backend` set (unchanged on the
/// host, so that a host fuzz draws exactly what it always drew).
std::string on_backend(const std::string& yaml, const std::string& backend) {
  if (backend == "host") return yaml;
  YAML::Node n = YAML::Load(yaml);
  n["backend"] = backend;
  return flow(n);
}

}  // namespace

Verdict verdict_of(const CaseReport& r, const char* mine) {
  Verdict v;
  v.outcome = r.outcome;
  if (r.outcome == Outcome::PASSED) return v;
  for (const Check& ch : r.checks) {
    if (ch.outcome != r.outcome) continue;  // the check that decided the outcome
    v.check = ch.slot + "/" + ch.variant + "/" + without_rank(ch.tensor);
    v.key = ch.slot + "/" + without_rank(ch.tensor);
    std::ostringstream o;
    // Every digit and the bit patterns (value_text): two values that differ
    // in the last place of the type must not print alike.
    if (!ch.diff.first.empty()) {
      const Mismatch& m = ch.diff.first[0];
      const int64_t u = ulp_distance(m.fast, m.ref, ch.diff.type);
      o << ch.diff.mismatches << " mismatch(es), first " << m.coords << ": " << mine << " "
        << value_text(m.fast, ch.diff.type) << " vs " << value_text(m.ref, ch.diff.type) << " (" << ch.against << ")"
        << (u > 0 ? ", " + std::to_string(u) + " ulp apart" : "") << (ch.note.empty() ? "" : "; ");
    }
    o << ch.note;
    v.note = o.str();
    break;
  }
  return v;
}

std::string flow(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

int64_t tokens_of(const std::string& yaml) {
  const Case c = load_one_case(yaml, "fuzz");
  int64_t t = 0;
  for (int r = 0; r < c.ep; ++r) t = std::max(t, c.tokens_on(r));
  return t;
}

std::string shrink(const std::string& yaml, const Verdict& v, const JudgeFn& judge, const FitFn& fit, int budget,
                   int& runs) {
  YAML::Node cur = YAML::Load(yaml);
  bool improved = true;
  while (improved && runs < budget) {
    improved = false;
    const std::string now = flow(cur);
    for (const YAML::Node& cand : shrink_candidates(cur)) {
      if (runs >= budget) break;
      const std::optional<std::string> text = fit(flow(cand));
      // A candidate the fit turns back into the current configuration (a
      // profile's fixed key set again) is no step: taking it would loop.
      if (!text || *text == now) continue;
      ++runs;
      const Verdict w = judge(*text);
      if (w.outcome == v.outcome && w.key == v.key) {
        cur = YAML::Load(*text);
        improved = true;
        break;
      }
    }
  }
  return flow(cur);
}

namespace {

/// Whether a shrink candidate loads: a configuration to run as it is.
std::optional<std::string> loads(const std::string& yaml) {
  try {
    load_one_case(yaml, "shrink");
  } catch (const Error&) {
    return std::nullopt;
  }
  return yaml;
}

}  // namespace

std::string write_shrunk_case(const FuzzOptions& o, FuzzFailure& f, const HeaderFn& header) {
  YAML::Node n = YAML::Load(f.shrunk);
  const std::string name = "fuzz_" + std::to_string(o.seed) + "_" + std::to_string(f.index);
  n["name"] = name;
  const std::string path = o.out_dir + "/" + name + ".yaml";
  const std::string body = header(path, name) + "cases:\n  - " + flow(n) + "\n";
  const std::string err = write_file(path, {body}, /*no_follow=*/true);
  if (!err.empty()) {
    f.note += "; the shrunk case could not be written to " + path + ": " + err;
    return "";
  }
  return path;
}

std::string profile_flags(const FuzzOptions& o) {
  std::string f = o.profile && !o.profile->file.empty() ? " --profile " + shell_word(o.profile->file) : "";
  for (const auto& s : o.sets) f += " --set " + shell_word(s);
  return f;
}

std::string replay_bound(const FuzzOptions& o) {
  std::ostringstream b;
  if (o.iterations) b << " --iterations " << o.iterations;
  if (o.seconds > 0) b << " --seconds " << o.seconds;
  return b.str();
}

bool natural_less(const std::string& a, const std::string& b) {
  const auto digit = [](char ch) { return ch >= '0' && ch <= '9'; };
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      // Leading zeros aside, the longer run is the larger number.
      while (i + 1 < ie && a[i] == '0') ++i;
      while (j + 1 < je && b[j] == '0') ++j;
      if (ie - i != je - j) return ie - i < je - j;
      const int c = a.compare(i, ie - i, b, j, je - j);
      if (c != 0) return c < 0;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

void prepare_out_dir(const FuzzOptions& o, std::ostream& progress) {
  if (o.out_dir.empty()) return;
  // --out is a folder that exists or can be made in an existing one (never
  // a chain of folders anywhere), checked now, not at the first failure.
  prepare_dump_root(o.out_dir, "fuzz --out");
  std::vector<std::string> earlier;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(o.out_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("fuzz_", 0) == 0 && e.path().extension() == ".yaml") earlier.push_back(n);
  }
  if (earlier.empty()) return;
  std::sort(earlier.begin(), earlier.end(), natural_less);
  std::string names;
  for (size_t i = 0; i < earlier.size() && i < 3; ++i) names += (i ? ", " : "") + printable(earlier[i], 80);
  const std::string mine = "fuzz_" + std::to_string(o.seed) + "_";
  const auto same_seed = std::count_if(earlier.begin(), earlier.end(), [&](const std::string& n) { return n.rfind(mine, 0) == 0; });
  progress << "fuzz: --out " << printable(o.out_dir, 200) << " already holds " << earlier.size()
           << " case file(s) of earlier runs (" << names << (earlier.size() > 3 ? ", ..." : "") << "), kept";
  if (same_seed)
    progress << " but for the " << same_seed << " of seed " << o.seed << " (" << mine
             << "N.yaml): configuration N failing again replaces its file";
  else
    progress << "; this run's are named " << mine << "N.yaml";
  progress << std::endl;
}

FuzzResult fuzz(const FuzzOptions& o, std::ostream& progress) {
  if (o.seconds <= 0 && o.iterations == 0) bad_input("fuzz: give --seconds or --iterations");
  require_profile_fits(o.profile, o.seed);
  prepare_out_dir(o, progress);
  FuzzResult res;
  res.seed = o.seed;
  res.fault_flags = o.fault_flags;
  progress << "fuzz: seed " << o.seed << " (replay: " << self_command() << " fuzz --seed " << o.seed << replay_bound(o)
           << profile_flags(o) << (o.backend == "host" ? "" : " --backend " + o.backend) << o.fault_flags << ")" << std::endl;
  const auto t0 = Clock::now();
  std::atomic<uint64_t> next{0}, done{0}, passed{0}, uninformative{0};
  std::atomic<bool> stop{false};
  std::mutex m;
  auto worker = [&] {
    while (!stop) {
      const uint64_t i = next++;
      if ((o.iterations && i >= o.iterations) || (o.seconds > 0 && since(t0) >= o.seconds)) break;
      std::string why;
      const std::optional<std::string> drawn = draw_configuration(o.profile, o.seed, i, why);
      if (!drawn) continue;  // no draw fits (index 0 did, checked before): not counted
      const std::string yaml = on_backend(*drawn, o.backend);
      Verdict v;
      try {
        v = run_yaml(yaml, o, threads_of(i));
      } catch (const std::exception& e) {  // the generator drew a configuration the loader refuses
        v = Verdict{Outcome::ERROR, "generator/-/-", "generator/-", e.what()};
      }
      if (v.outcome == Outcome::PASSED) {
        ++passed;
      } else if (v.outcome == Outcome::NOT_VERIFIED || v.outcome == Outcome::NOT_SUPPORTED) {
        // Data that cannot show a bug (an all-zero reference, say): counted
        // and shown, never a failure.
        ++uninformative;
        std::lock_guard<std::mutex> lk(m);
        note_uninformative(res, v.check, i);
      } else {
        FuzzFailure f;
        f.index = i;
        f.outcome = v.outcome;
        f.check = v.check;
        f.note = v.note;
        f.yaml = yaml;
        const bool valid = v.key != "generator/-";
        const JudgeFn judge = [&](const std::string& y) { return run_yaml(y, o, threads_of(i)); };
        const FitFn fit = [&](const std::string& y) -> std::optional<std::string> {
          std::string w;
          return o.profile ? o.profile->refit(y, w) : loads(y);
        };
        f.shrunk = o.shrink && valid ? shrink(yaml, v, judge, fit, o.shrink_budget, f.shrink_runs) : yaml;
        f.shrunk_tokens = valid ? tokens_of(f.shrunk) : -1;
        std::lock_guard<std::mutex> lk(m);
        if (!o.out_dir.empty())
          f.file = write_shrunk_case(o, f, [&](const std::string& path, const std::string&) {
            std::ostringstream h;
            h << "# moeverify fuzz: seed " << o.seed << ", configuration " << f.index << ", " << outcome_name(f.outcome)
              << " at " << f.check << "\n# drawn: " << f.yaml << "\n# repro: " << printable(self_command() + " run " + shell_word(path), 4000) << " --threads "
              << threads_of(f.index) << o.fault_flags << "\n";
            return h.str();
          });
        res.failures.push_back(f);
        if (o.stop_at_first) stop = true;
      }
      ++done;
    }
  };
  std::vector<std::thread> pool;
  for (int j = 0; j < std::max(1, o.jobs); ++j) pool.emplace_back(worker);
  // Progress from this thread while the workers run.
  auto last = Clock::now();
  while (true) {
    const uint64_t finished = done.load();
    if ((o.iterations && finished >= o.iterations) || stop || (o.seconds > 0 && since(t0) >= o.seconds)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (std::chrono::duration<double>(Clock::now() - last).count() >= 2.0) {
      last = Clock::now();
      size_t fails;
      {
        std::lock_guard<std::mutex> lk(m);
        fails = res.failures.size();
      }
      progress << "fuzz: " << finished << " configurations (" << std::fixed << std::setprecision(0)
               << 60.0 * double(finished) / std::max(1e-9, since(t0)) << "/min), " << fails << " failure(s), "
               << uninformative.load() << " uninformative" << std::endl;
      progress.unsetf(std::ios::fixed);
    }
  }
  for (auto& t : pool) t.join();
  std::sort(res.failures.begin(), res.failures.end(),
            [](const FuzzFailure& a, const FuzzFailure& b) { return a.index < b.index; });
  res.configurations = done;
  res.passed = passed;
  res.uninformative = uninformative;
  res.seconds = since(t0);
  return res;
}

std::string emit_case_file(const FuzzOptions& o, const std::string& replay) {
  std::ostringstream y;
  y << "# moeverify fuzz --emit: configurations 0 to " << o.iterations - 1 << " of seed " << o.seed
    << (o.profile && !o.profile->name.empty() ? ", inside profile " + o.profile->name : "")
    << (o.sets.empty() ? "" : ", with --set") << "\n# the ones `" << replay << "` runs\ncases:\n";
  for (uint64_t i = 0; i < o.iterations; ++i) {
    std::string why;
    const std::optional<std::string> drawn = draw_configuration(o.profile, o.seed, i, why);
    if (!drawn) bad_input("fuzz --emit: configuration " + std::to_string(i) + " has no draw inside the profile: " + why);
    YAML::Node n = YAML::Load(on_backend(*drawn, o.backend));
    n["name"] = "fuzz_" + std::to_string(o.seed) + "_" + std::to_string(i);
    y << "  - " << flow(n) << "\n";
  }
  return y.str();
}

void note_uninformative(FuzzResult& r, const std::string& check, uint64_t i) {
  ++r.uninformative_checks[check];
  std::vector<uint64_t>& at = r.uninformative_configurations[check];
  at.insert(std::upper_bound(at.begin(), at.end(), i), i);
}

std::string configuration_list(const std::vector<uint64_t>& indices) {
  std::string s = indices.size() > 1 ? "(configurations " : "(configuration ";
  for (size_t k = 0; k < indices.size() && k < 12; ++k) s += (k ? ", " : "") + std::to_string(indices[k]);
  return s + (indices.size() > 12 ? ", ...)" : ")");
}

void print_fuzz_result(const FuzzResult& r, std::ostream& os) {
  os << "\nfuzz: seed " << r.seed << ", " << r.configurations << " configurations in " << std::fixed
     << std::setprecision(1) << r.seconds << " s (" << std::setprecision(0)
     << 60.0 * double(r.configurations) / std::max(1e-9, r.seconds) << "/min)\n";
  os.unsetf(std::ios::fixed);
  os << "   " << std::left << std::setw(16) << "PASSED" << r.passed << "\n"
     << "   " << std::setw(16) << "uninformative" << r.uninformative << "  (NOT_VERIFIED: data that cannot show a bug)\n"
     << "   " << std::setw(16) << "failures" << r.failures.size() << "\n";
  for (const auto& [check, n] : r.uninformative_checks)
    os << "      uninformative at " << check << ": " << n << " "
       << configuration_list(r.uninformative_configurations.at(check)) << "\n";
  if (r.uninformative > 0)
    os << "      (--emit FILE writes configuration i as case fuzz_" << r.seed << "_i, to run it with --verbose)\n";
  for (const auto& f : r.failures) {
    os << "\n   FAIL configuration " << f.index << ": " << outcome_name(f.outcome) << " at " << f.check << "\n";
    if (!f.note.empty()) os << "      " << f.note.substr(0, 300) << "\n";
    os << "      drawn:  " << f.yaml << "\n      shrunk: " << f.shrunk << "  (" << f.shrunk_tokens << (f.shrunk_tokens == 1 ? " token" : " tokens") << " per rank, "
       << f.shrink_runs << " configurations run to shrink it)\n";
    if (!f.file.empty())
      os << "      repro:  " << self_command() << " run " << shell_word(f.file) << " --threads " << threads_of(f.index) << r.fault_flags << "\n";
  }
  os << std::right;
}

std::string fuzz_json(const FuzzResult& r) {
  nlohmann::json j;
  j["schema"] = "moeverify-fuzz/1";
  j["seed"] = r.seed;
  j["seconds"] = r.seconds;
  j["configurations"] = r.configurations;
  j["passed"] = r.passed;
  j["uninformative"] = r.uninformative;
  j["uninformative_configurations"] = r.uninformative_configurations;
  j["failures"] = nlohmann::json::array();
  j["files"] = nlohmann::json::array();
  for (const auto& f : r.failures) {
    j["failures"].push_back({{"index", f.index},
                             {"outcome", outcome_name(f.outcome)},
                             {"check", f.check},
                             {"note", f.note.substr(0, 2000)},
                             {"drawn", f.yaml},
                             {"shrunk", f.shrunk},
                             {"shrunk_tokens", f.shrunk_tokens},
                             {"threads", threads_of(f.index)},
                             {"file", f.file}});
    if (!f.file.empty()) j["files"].push_back(f.file);
  }
  return j.dump(2) + "\n";
}

// ---- selftest -----------------------------------------------------------------

namespace {

/// Probes for faults that case-sized data cannot reach: each calls the
/// kernel entry point the fault lives in, on data built for it, and compares
/// with what the contract says, computed here independently. true: caught.
struct Probe {
  Fault fault;
  const char* what;
  bool (*caught)(const FaultSet&);
};

// docs/contract.md §4: group starts past 2^31 rows need 64-bit offsets.
bool probe_offsets(const FaultSet& f) {
  const int64_t A = 16;
  const std::vector<int64_t> counts = {(int64_t(1) << 31) - 5, 7, 1 << 20};
  const PadLayout l = pad_layout(counts.data(), int(counts.size()), A, EmptyGroupRows::zero, f);
  int64_t start = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (l.start[j] != start) return true;
    start += (counts[j] + A - 1) / A * A;
  }
  return l.start[counts.size()] != start;
}

// docs/frameworks.md §8.1: the batched cache must be rebuilt when the weight version changes.
bool probe_weight_cache(const FaultSet& f) {
  const int E_l = 2;
  const int64_t c = 3, D = 4, F = 5;
  std::vector<float> X(size_t(E_l * c * D), 0.5f), W1(size_t(E_l * F * D), 0.25f), W3(W1.size(), 0.5f),
      W2(W1.size(), 0.125f), Y(X.size()), Y_loop(X.size());
  const std::vector<int64_t> counts(size_t(E_l), c);
  const ExecCtx ex{1, f};
  BatchedWeightCache cache;
  experts_swiglu_batched(ex, DType::fp32, X.data(), c, E_l, D, F, W1.data(), W3.data(), W2.data(), 1, cache, Y.data());
  for (auto& w : W3) w = -w;  // new weights, new version
  experts_swiglu_batched(ex, DType::fp32, X.data(), c, E_l, D, F, W1.data(), W3.data(), W2.data(), 2, cache, Y.data());
  experts_swiglu(ExecCtx{1, {}}, DType::fp32, ExpertsImpl::loop, X.data(), counts.data(), E_l, D, F, W1.data(),
                 W3.data(), W2.data(), Y_loop.data());
  for (size_t i = 0; i < Y.size(); ++i)
    if (std::fabs(Y[i] - Y_loop[i]) > 1e-5f * (1.f + std::fabs(Y_loop[i]))) return true;
  return false;
}

const std::vector<Probe>& probes() {
  static const std::vector<Probe> p = {
      {Fault::offsets_32bit, "pad_layout with a group past 2^31 rows", probe_offsets},
      {Fault::stale_weight_cache, "batched experts after a weight-version bump", probe_weight_cache},
  };
  return p;
}

std::vector<std::string> case_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const std::string& d : {dir, dir + "/regressions"}) {
    if (!std::filesystem::is_directory(d)) continue;
    for (const auto& e : std::filesystem::directory_iterator(d))
      if (e.is_regular_file() && e.path().extension() == ".yaml") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

std::vector<SelftestRow> selftest(const SelftestOptions& opt, std::ostream& progress) {
  const std::vector<std::string> files = case_files(opt.cases_dir);
  if (files.empty())
    bad_input("selftest: no case files in " + opt.cases_dir + "; valid: --cases DIR with the shipped *.yaml files");
  // Every shipped case, cheapest first (by the memory estimate), so that a
  // fault is usually caught before the large shapes run.
  // (cases/slow/, the real shapes that take minutes, is not among them.)
  std::vector<std::pair<std::string, Case>> shipped;
  for (const auto& f : files)
    for (Case& c : load_cases(f, {})) shipped.push_back({std::filesystem::path(f).filename().string(), std::move(c)});
  std::stable_sort(shipped.begin(), shipped.end(), [](const auto& a, const auto& b) {
    return estimate_case_bytes(a.second, 2) < estimate_case_bytes(b.second, 2);
  });
  std::vector<SelftestRow> rows;
  std::ostream null_stream(nullptr);
  for (const FaultInfo& fi : fault_table()) {
    const auto t0 = Clock::now();
    SelftestRow row;
    row.fault = fi.name;
    row.what = fi.what;
    const FaultSet faults{uint64_t(fi.fault)};
    // 0. A probe, where the fault has one: the faults no case-sized data can
    // reach; fuzz budget and shipped cases would run in full for nothing.
    for (const Probe& p : probes())
      if (p.fault == fi.fault && p.caught(faults)) row.probe = p.what;
    // 1. A fuzz budget with the fault on, stopped at the first failure.
    FuzzOptions fo;
    fo.seed = opt.seed;
    fo.iterations = opt.fuzz_budget;
    fo.jobs = opt.jobs;
    fo.faults = faults;
    fo.stop_at_first = true;
    fo.collective_timeout_ms = 2000;
    // A fault that makes ranks disagree ends each run at the collective
    // timeout: shrinking its failure 400 times took minutes of the selftest.
    // 24 runs still report a small T.
    fo.shrink_budget = 24;
    auto run_fuzz = [&] {
      const FuzzResult fr = fuzz(fo, null_stream);
      if (fr.failures.empty()) return;
      const FuzzFailure& f = fr.failures.front();
      row.fuzz_configurations = f.index + 1;
      row.fuzz_check = f.check;
      row.shrunk_tokens = f.shrunk_tokens;
    };
    if (opt.quick) fo.shrink = false;
    if (row.probe.empty() && !opt.quick) run_fuzz();
    // 2. The shipped cases, until one catches it.
    for (const auto& [file, c] : shipped) {
      if (!row.probe.empty()) break;
      RunOptions ro;
      ro.threads = 2;
      ro.faults = faults;
      ro.collective_timeout_ms = 2000;
      const Verdict v = verdict_of(run_case(c, ro));
      if (v.outcome == Outcome::INCORRECT || v.outcome == Outcome::ERROR) {
        row.case_hit = file + " " + c.name + " at " + v.check;
        break;
      }
    }
    if (opt.quick && row.probe.empty() && row.case_hit.empty()) run_fuzz();
    row.caught = row.fuzz_configurations > 0 || !row.case_hit.empty() || !row.probe.empty();
    row.by = !row.case_hit.empty() ? "case " + row.case_hit
             : row.fuzz_configurations ? "fuzz " + row.fuzz_check
             : !row.probe.empty()      ? "probe: " + row.probe
                                       : "nothing";
    row.seconds = since(t0);
    progress << "selftest: " << fi.name << ": " << (row.caught ? "caught" : "NOT CAUGHT") << " (" << std::fixed
             << std::setprecision(1) << row.seconds << " s)" << std::endl;
    progress.unsetf(std::ios::fixed);
    rows.push_back(row);
  }
  return rows;
}

void print_selftest(const std::vector<SelftestRow>& rows, std::ostream& os) {
  os << "\nselftest: every planted fault must be caught (shipped cases, a fuzz budget, or a probe)\n";
  os << "   " << std::left << std::setw(28) << "fault" << std::setw(12) << "outcome" << std::setw(26) << "fuzz"
     << "first shipped case / probe\n";
  size_t caught = 0;
  for (const auto& r : rows) {
    caught += r.caught;
    std::string fz = "-";
    if (r.fuzz_configurations)
      fz = "after " + std::to_string(r.fuzz_configurations) + " (T<=" + std::to_string(r.shrunk_tokens) + ")";
    os << "   " << std::setw(28) << r.fault << std::setw(12) << (r.caught ? "caught" : "NOT CAUGHT") << std::setw(26)
       << fz << (!r.case_hit.empty() ? r.case_hit : !r.probe.empty() ? "probe: " + r.probe : "-") << "\n";
  }
  os << std::right << "\n" << caught << " of " << rows.size() << " planted faults caught\n";
}

std::string selftest_json(const std::vector<SelftestRow>& rows) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : rows)
    j.push_back({{"fault", r.fault},
                 {"caught", r.caught},
                 {"by", r.by},
                 {"fuzz_configurations", r.fuzz_configurations},
                 {"fuzz_check", r.fuzz_check},
                 {"fuzz_shrunk_tokens", r.shrunk_tokens},
                 {"case", r.case_hit},
                 {"probe", r.probe},
                 {"seconds", r.seconds}});
  return nlohmann::json{{"faults", j}}.dump(2) + "\n";
}

}  // namespace moev
