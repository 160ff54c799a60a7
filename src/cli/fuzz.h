// `moeverify fuzz` and `moeverify selftest` (issue 10).
//
// fuzz: draws random valid configurations over every case key
// (src/config/random_case.cpp), runs each through the same runner as `run`, and
// shrinks every failure to a small YAML case that reproduces it.
// selftest: turns on each planted fault in turn and shows that the shipped
// cases, a fuzz budget, or (for faults no case-sized data can reach) a probe
// of the kernel entry point catches it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "diff.h"
#include "faults.h"

namespace moev {

struct Profile;  // profile.h

struct FuzzOptions {
  uint64_t seed = 1;
  double seconds = 0;       // 0: no time limit
  uint64_t iterations = 0;  // 0: no count limit (one of the two must be set)
  int jobs = 1;             // configurations run at once
  FaultSet faults;
  std::string out_dir;      // where shrunk failures are written ("" : nowhere)
  std::string fault_flags;  // the --fault flags, for the repro line
  bool shrink = true;
  int shrink_budget = 400;  // configurations run at most while shrinking one failure
  double shrink_seconds = 300;  // fuzz --impl: seconds at most spent shrinking one failure
  bool stop_at_first = false;  // selftest: stop at the first failure
  int collective_timeout_ms = 5000;
  std::string backend = "host";  // the case key `backend` of every drawn configuration
  const Profile* profile = nullptr;  // what the generator may draw, fixed keys applied (null: everything)
  std::vector<std::string> sets;     // the --set flags folded into `profile`, for the replay line
};

/// The replay line's flags that give the drawn configurations: --profile
/// FILE (when the profile has one) and each --set.
std::string profile_flags(const FuzzOptions& o);

/// `fuzz --impl CMD`: the implementation under test, run per configuration
/// on an exported case folder and judged as `check` judges it.
struct ImplOptions {
  std::string cmd;          // with {case} for the folder; a worker command with `worker`
  bool worker = false;      // CMD started once per job, fed one folder per line (docs/guide.md)
  double timeout_s = 60;    // per configuration; past it the implementation counts as crashed
  bool keep = false;        // keep the temporary case folders (printed)
  std::string require;      // check's --require ("all" or STAGE,STAGE), passed on to every judgement
  bool strict_ties = false; // check's --strict-ties
};

/// A failure: the first check that did not pass, named without its rank.
struct FuzzFailure {
  uint64_t index = 0;
  Outcome outcome = Outcome::INCORRECT;
  std::string check;     // slot/variant/tensor
  std::string note;      // that check's note or first mismatch
  std::string yaml;      // the drawn configuration
  std::string shrunk;    // the shrunk configuration (== yaml when not shrunk)
  int shrink_runs = 0;   // configurations run while shrinking
  int64_t shrunk_tokens = 0;
  std::string file;      // the written case file ("" when none)
  std::string repro;     // the command line that reproduces it ("" when no file)
  std::string stderr_tail;  // --impl: what the implementation wrote to stderr on the drawn configuration
  int64_t same_as = -1;  // --impl: the configuration whose failure of the same check was shrunk (-1: this one)
};

/// `fuzz --impl`: per stage, the configurations that judged it and those
/// where it was INCORRECT.
struct StageCount {
  uint64_t judged = 0, failed = 0;
};

struct FuzzResult {
  uint64_t seed = 0, configurations = 0, passed = 0, uninformative = 0;
  std::string fault_flags;  // the --fault flags, for the repro lines
  double seconds = 0;
  std::vector<FuzzFailure> failures;
  std::map<std::string, int> uninformative_checks;  // check -> count
  // check -> the NOT_VERIFIED configurations' indices, ascending (`--emit`
  // writes configuration i as case fuzz_SEED_i, to look at one)
  std::map<std::string, std::vector<uint64_t>> uninformative_configurations;
  // --impl only
  bool impl = false;
  std::string impl_cmd, profile, work_dir;
  std::vector<std::string> sets;  // fuzz --set, as given
  uint64_t drawn = 0, judged = 0, skipped = 0, crashed = 0, failed = 0;
  uint64_t accepted_ties = 0;  // judged configurations with an exact tie broken otherwise (accepted)
  std::vector<uint64_t> tie_configurations;  // their indices, ascending
  std::map<std::string, StageCount> stages;
  std::map<std::string, int> skip_reasons;  // first line of the implementation's reason -> count
  bool interrupted = false;                 // SIGINT or SIGTERM ended the draws (and shrinking) early
  int interrupt_signal = 0;                 // which (fuzz --impl exits 128 + it unless something failed)
};

/// Runs the fuzz loop; prints the seed first and a progress line every few
/// seconds to `progress`.
FuzzResult fuzz(const FuzzOptions& opt, std::ostream& progress);

/// `fuzz --emit`: the case file of the configurations `fuzz` would run
/// (0 to iterations - 1, inside the profile, on the backend), each named
/// fuzz_SEED_I; `replay` is the fuzz command line that runs the same ones.
std::string emit_case_file(const FuzzOptions& o, const std::string& replay);

void print_fuzz_result(const FuzzResult& r, std::ostream& os);
std::string fuzz_json(const FuzzResult& r);

/// Notes configuration i NOT_VERIFIED at `check` (the jobs finish out of
/// order: the indices are kept ascending).
void note_uninformative(FuzzResult& r, const std::string& check, uint64_t i);
/// "(configurations 3, 17, ...)": at most 12 indices, for the text reports.
std::string configuration_list(const std::vector<uint64_t>& indices);

/// `fuzz --impl`: the same loop over a user's implementation (fuzz_impl.cpp).
/// o.backend, o.faults do not apply; o.out_dir receives the shrunk cases.
FuzzResult fuzz_impl(const FuzzOptions& o, const ImplOptions& impl, std::ostream& progress);
/// Exit status of an --impl run: 1 on any failure or crash, NOT_VERIFIED's
/// when nothing was judged PASSED, else 0.
int fuzz_impl_status(const FuzzResult& r);
/// Text in the order a person counts: a run of digits compares as a number
/// (fuzz_7_2.yaml before fuzz_7_10.yaml; 2 before 10), the rest as text.
bool natural_less(const std::string& a, const std::string& b);

/// `profile` (null: none) names a fixed key the implementation refuses.
void print_impl_result(const FuzzResult& r, std::ostream& os, const Profile* profile = nullptr);
std::string impl_json(const FuzzResult& r);  // schema moeverify-fuzz-impl/1

struct SelftestOptions {
  std::string cases_dir;     // shipped case files (*.yaml, regressions/ too)
  uint64_t seed = 1;
  uint64_t fuzz_budget = 400;  // configurations per fault
  int jobs = 1;
  /// Shipped cases (and probes) first; the fuzz budget only for a fault no
  /// case catches, its failure not shrunk. The full mode also shows the fuzz
  /// finding every fault on its own.
  bool quick = false;
};

struct SelftestRow {
  std::string fault, what;
  bool caught = false;
  std::string by;            // which check caught it first, and where
  uint64_t fuzz_configurations = 0;  // configurations until the fuzz caught it (0: not by fuzz)
  int64_t shrunk_tokens = -1;        // tokens of the fuzz failure after shrinking
  std::string fuzz_check;            // the fuzz failure's check
  std::string case_hit;              // the first shipped case that caught it
  std::string probe;                 // the probe that caught it
  double seconds = 0;
};

std::vector<SelftestRow> selftest(const SelftestOptions& opt, std::ostream& progress);
void print_selftest(const std::vector<SelftestRow>& rows, std::ostream& os);
std::string selftest_json(const std::vector<SelftestRow>& rows);

}  // namespace moev
