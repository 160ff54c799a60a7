// Runs one case: every applicable stage variant against the reference on the
// same inputs, then the end-to-end chain; produces a CaseReport.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "case.h"
#include "registry.h"

namespace moev {

struct VariantDecision;

struct RunOptions {
  int threads = 1;
  FaultSet faults;
  std::string dump_dir;  // empty: no dump
  enum class Keep { nothing, fast_board } keep = Keep::nothing;
  int collective_timeout_ms = 30000;  // local comm: a collective not joined by every rank fails after this
  /// Called before each stage variant runs (slot, variant) and once with
  /// ("", "") when the case ends: drives a progress line on a terminal.
  std::function<void(const std::string& slot, const std::string& variant)> progress;
  /// Called once a slot's variants have run and been checked, for each
  /// variant that ran, with the fast board then: the slot's inputs (and the
  /// primary's outputs), still held by the streaming runner. `moeverify
  /// bench` times each variant here instead of keeping the whole board.
  /// Layer entry 1 of a case only; never in the invariance reruns.
  std::function<void(const Stage& s, const VariantDecision& vd, const Board& fast)> after_slot;
  /// Runs the primary variant of each slot only, with no reference, no
  /// comparison and no invariance reruns: the fast pipeline's outputs (and
  /// `out_magnitude`, the end-to-end error scale computed from the fast
  /// board) for a property that compares two fast runs (EP and SP
  /// invariance). Such a run reports no checks.
  bool fast_only = false;
  /// With fast_only: whether `out_magnitude` is wanted (a bitwise comparison
  /// needs no error scale, and computing it reads every routed row).
  bool fast_only_magnitude = true;
  /// Set by run_case on a device backend: every fast call runs on its device
  /// (kernels/device.h), board tensors resident there for the whole case.
  Mirror* mirror = nullptr;
};

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
  /// The overload factor of the case's layer entries (CONTRACT §12) from the
  /// fast pipeline; the checks compare it with the reference's.
  struct Overload {
    bool valid = false;
    std::vector<double> entries;
    double avg = 0, max = 0, max_cum = 0;
  } overload;
};

CaseReport run_case(const Case& c, const RunOptions& opt);

/// Why `c` cannot run on its backend ("" when it can): the backend is not
/// built, has no usable device, or lacks an implementation of a stage
/// variant the case needs. run_case reports such a case NOT_SUPPORTED.
std::string backend_unsupported(const Case& c);
/// The first part of that: why backend `b` cannot run anything here ("" when
/// it can), e.g. "--backend cuda: no usable CUDA device (...)".
std::string backend_unavailable(Backend b);

/// SP invariance (CONTRACT §10, src/paths/stages_sp.cpp): with sp > 1, every EP
/// rank's gathered output `sp_out` on the fast board equals the sp = 1 run
/// of the same inputs; appends one check per EP rank to `rep`.
void check_sp_invariance(const Case& c, const RunOptions& opt, const Board& fast, CaseReport& rep);

/// One output compared as `run` compares it (class, tolerance, error scale,
/// data promise, MoE coordinates from `board`): for `moeverify check`, which
/// compares an implementation's outputs without running a fast stage.
Check check_output(const Case& c, const std::string& slot, const std::string& variant, const OutputSpec& o,
                   const Tensor* actual, const Tensor* expected, const RankBoard& board, int rank, int ranks,
                   const std::string& against, const Tensor* scale = nullptr);

/// How much of a case the human table shows. `summary`: one line per (slot,
/// variant) aggregated over ranks and tensors, and the per-tensor rows of the
/// checks that did not pass. `every_check`: every variant note and every
/// per-tensor row as well (`moeverify run --verbose`).
enum class ReportDetail { summary, every_check };

/// Human table (stdout) and JSON (--json, every check always) of a run.
void print_report(const CaseReport& r, std::ostream& os, ReportDetail detail = ReportDetail::summary);
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

/// The overload factor's values (CONTRACT §12), fast against reference:
/// bitwise, a value count that differs is INCORRECT too.
Check overload_check(const std::string& what, const std::vector<double>& fast, const std::vector<double>& ref);

}  // namespace moev
