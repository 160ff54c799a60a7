// What a run produces (CaseReport: checks, variant decisions, notes) and its
// renderings: the human table, the JSON report, .npy files. The engine fills
// a CaseReport (engine/runner.h run_case); the commands print it.
#pragma once

#include <functional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "case.h"
#include "stage.h"

namespace moev {

struct VariantDecision {
  std::string slot, variant;
  bool ran = false, primary = false;
  std::string reason;               // why it did not run
  std::vector<std::string> notes;   // what it reported (fast path taken, ...)
  /// Wall seconds of this variant, summed over ranks run one after another:
  /// the fast function (all ranks, with their collectives), its reference
  /// on the same inputs, and the comparisons (input checks included).
  double fast_seconds = 0, ref_seconds = 0, compare_seconds = 0;
  /// On a device backend: the seconds its device spent in this variant's
  /// kernels and GEMMs (Device::busy_seconds; CUDA events on a GPU), inside
  /// fast_seconds, which adds the transfers and host work. < 0 on the host.
  double device_seconds = -1;
};

struct CaseReport {
  Case c;
  std::vector<Check> checks;
  std::vector<VariantDecision> decisions;
  std::vector<std::string> notes;
  Outcome outcome = Outcome::PASSED;
  double seconds = 0;
  Board fast;  // every primary fast output (of layer entry 1), when RunOptions::keep == fast_board
  /// `check`: an implementation's file could not be read (malformed, wrong
  /// dtype or columns). The checks hold what was judged before it; the
  /// command reports them, then exits 2 with this line.
  std::string bad_input;
  /// `check`: the folder the implementation's outputs were read from (the
  /// report's header names it under the case line).
  std::string actual_dir;
  /// `check`: exact ties the implementation broke otherwise than the lowest
  /// expert id or token (accepted without --strict-ties, docs/contract.md
  /// §15): tokens at routing, ranks at a capacity boundary.
  int64_t accepted_ties = 0;
  /// The overload factor of the case's layer entries (docs/contract.md §12) from the
  /// fast pipeline; the checks compare it with the reference's.
  struct Overload {
    bool valid = false;
    std::vector<double> entries;
    double avg = 0, max = 0, max_cum = 0;
  } overload;
  /// `check`: how much of the manifest's outputs the implementation wrote.
  struct Coverage {
    bool valid = false;
    int64_t expected = 0, checked = 0;  // tensors (one per rank)
    std::vector<std::string> partly, not_written;  // stages ("stage (missing tensors)" for partly)
  } coverage;
};

/// How much of a case the human table shows. `summary`: one line per (slot,
/// variant) aggregated over ranks and tensors, and the per-tensor rows of the
/// checks that did not pass. `every_check`: every variant note and every
/// per-tensor row as well (`moeverify run --verbose`).
enum class ReportDetail { summary, every_check };

/// "0-3,5" for {0, 1, 2, 3, 5}: ranks, layers.
std::string int_ranges(const std::set<int>& v);

/// Human table (stdout) and JSON (--json, every check always) of a run.
void print_report(const CaseReport& r, std::ostream& os, ReportDetail detail = ReportDetail::summary);

/// The end of a run or check that did not pass: "failures:", then per case
/// that did not pass "   NAME: OUTCOME" followed by what `tail` writes (it
/// is given the case's index, the case and its first check that did not
/// pass, or null) and a newline. Nothing when every case passed.
using FailureTail = std::function<void(size_t i, const CaseReport& r, const Check* first, std::ostream& out)>;
void print_failure_list(const std::vector<CaseReport>& reports, const FailureTail& tail, std::ostream& out);
void print_tolerance_table(const std::vector<CaseReport>& reports, std::ostream& os);
/// What a JSON report says of the run as a whole (docs/json-schema.md).
struct ReportMeta {
  std::string schema = "moeverify-run/1";  // or "moeverify-check/1"
  std::vector<std::string> faults;          // planted with --fault
  /// Planted faults that no check caught (run --fault: the run must fail).
  std::vector<std::string> faults_uncaught;
};
std::string reports_json(const std::vector<CaseReport>& reports, const std::string& file, const ReportMeta& meta = {});

/// Writes `t` as a NumPy .npy file (bf16 as uint16; the manifest names it).
void write_npy(const std::string& path, const Tensor& t);

}  // namespace moev
