// Runs one case: every applicable stage variant against the reference on the
// same inputs, then the end-to-end chain; produces a CaseReport.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "case.h"
#include "registry.h"
#include "report.h"  // CaseReport, VariantDecision: what a run produces and the reports render

namespace moev {

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
  /// `mirror` is the case's device mirror on a device backend (the board's
  /// tensors resident there), null on the host.
  /// Layer entry 1 of a case only; never in the invariance reruns.
  std::function<void(const Stage& s, const VariantDecision& vd, const Board& fast, Mirror* mirror)> after_slot;
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

CaseReport run_case(const Case& c, const RunOptions& opt);

/// Why `c` cannot run on its backend ("" when it can): the backend is not
/// built, has no usable device, or lacks an implementation of a stage
/// variant the case needs. run_case reports such a case NOT_SUPPORTED.
std::string backend_unsupported(const Case& c);
/// The first part of that: why backend `b` cannot run anything here ("" when
/// it can), e.g. "--backend cuda: no usable CUDA device (...)".
std::string backend_unavailable(Backend b);

/// The device side of a fast call on RunOptions::mirror, shared by the
/// runner and `moeverify bench`: begin_device_call makes the named inputs of
/// every rank of `in` resident on the device and starts the call's marks
/// (Mirror::begin_call); sync_device_outputs, after the call, brings to the
/// device each output that host code wrote (splits, an MPI exchange of host
/// rows: the next stage reads its device copy), the device-written ones
/// being on both sides already (write-through). The caller ends the call
/// (Mirror::end_call).
void begin_device_call(Mirror& m, const Board& in, const std::vector<std::string>& inputs);
void sync_device_outputs(Mirror& m, std::vector<RankBoard>& out);

/// SP invariance (docs/contract.md §10, src/paths/stages_sp.cpp): with sp > 1, every EP
/// rank's gathered output `sp_out` on the fast board equals the sp = 1 run
/// of the same inputs; appends one check per EP rank to `rep`.
void check_sp_invariance(const Case& c, const RunOptions& opt, const Board& fast, CaseReport& rep);

/// One output compared as `run` compares it (class, tolerance, error scale,
/// data promise, MoE coordinates from `board`): for `moeverify check`, which
/// compares an implementation's outputs without running a fast stage.
Check check_output(const Case& c, const std::string& slot, const std::string& variant, const OutputSpec& o,
                   const Tensor* actual, const Tensor* expected, const RankBoard& board, int rank, int ranks,
                   const std::string& against, const Tensor* scale = nullptr);

/// The overload factor's values (docs/contract.md §12), fast against reference:
/// bitwise, a value count that differs is INCORRECT too.
Check overload_check(const std::string& what, const std::vector<double>& fast, const std::vector<double>& ref);

}  // namespace moev
