// Runs one case (run_case): its backend settled, each layer entry's inputs
// generated and its pipeline run (pipeline.cpp), then the invariance
// properties (invariance.cpp) and the overload factor; and the comparison of
// one output as `run` and `check` make it (make_check, check_output).
#include "runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "comm.h"
#include "config_hash.h"
#include "cuda_probe.h"
#include "datagen.h"
#include "error.h"
#include "hints.h"
#include "../kernels/overload_host.h"
#include "parallel_errors.h"
#include "pipeline.h"
#include "../reference/reference.h"

namespace moev {
namespace {

/// Why an output can legitimately be all zero, for the NOT_VERIFIED note:
/// the routed scores or the expert inputs are so small that the products
/// vanish in the activation dtype.
std::string all_zero_reason(const Case& c, const std::string& output, const RankBoard& b) {
  if (output == "grad_logits" || output == "grad_wg" || output == "grad_x_router")
    return "; the router's gradient terms cancel or vanish on this data (a token's score gradients all equal, "
           "a softmax over few experts, or exact-mode values that cancel), so it cannot show a wrong router "
           "backward (change the seed, or use data: realistic)";
  const char* src = output == "out" ? "score_sorted" : output == "expert_output" ? "expert_input" : nullptr;
  auto it = src ? b.find(src) : b.end();
  if (it == b.end()) {  // no input known to carry it: the case's tokens, else a generic reason (never none)
    src = "x";
    it = b.find(src);
  }
  if (it == b.end())
    return std::string("; every value reaching this output is zero or rounds to zero in ") + dtype_name(c.dtype) +
           " (score_before_experts, a small route_scale or zero-token ranks can cause it), so this data cannot show "
           "a wrong result (change the seed or the data)";
  double mx = 0;
  for (float v : to_floats(it->second)) mx = std::max(mx, double(std::fabs(v)));
  std::ostringstream o;
  o << "; the largest |" << src << "| is " << mx << ": products of values this small round to zero in "
    << dtype_name(c.dtype) << ", so this data cannot show a wrong result (raise router.route_scale or change the seed)";
  return o.str();
}

/// Elements of class rounding whose half-width is infinite are not judged
/// (any value but NaN passes there): said in the note, never silently; a
/// tensor with no finite half-width at all cannot show a wrong value, and
/// is NOT_VERIFIED rather than PASSED.
void open_halfwidths(const Tensor& halfwidth, Check& ch) {
  const std::vector<float> w = to_floats(halfwidth);
  const size_t open = size_t(std::count_if(w.begin(), w.end(), [](float v) { return !std::isfinite(v); }));
  if (open == 0) return;
  ch.note += (ch.note.empty() ? "" : "; ") + std::to_string(open) + " of " + std::to_string(w.size()) +
             " element(s) have no finite half-width and are not judged there (a value the reference cannot bound: "
             "an overflow within reach, or an unknown route_norm denominator, docs/contract.md §2, §13)";
  if (open == w.size() && ch.outcome == Outcome::PASSED) ch.outcome = Outcome::NOT_VERIFIED;
}

}  // namespace

Check make_check(const Case& c, const std::string& slot, const std::string& variant, const OutputSpec& o,
                 const Tensor* f, const Tensor* r, const RankBoard& fb, int rank, int ranks, const std::string& against,
                 const Tensor* scale, const Tensor* precomputed, const Tolerance* tol,
                 const std::vector<uint8_t>* mask) {
  Check ch;
  ch.slot = slot;
  ch.variant = variant;
  ch.tensor = ranks > 1 ? o.name + "@" + std::to_string(rank) : o.name;
  const CompareClass cls = o.class_in(c);
  ch.cls = cls;
  ch.tol = tol ? *tol : tolerance_for(c, cls);
  ch.against = against;
  if (!f || !r) {
    ch.outcome = Outcome::ERROR;
    ch.note = std::string(!f ? "fast" : "reference") + " produced no '" + o.name + "'";
    return ch;
  }
  Tensor own_scale;
  if (!scale && o.magnitude && cls != CompareClass::exact && f->type == r->type && f->shape == r->shape) {
    // The reference's own scale (RefCtx::scales) where it wrote one.
    if (!precomputed) own_scale = o.magnitude(c, fb, rank, ranks);
    scale = precomputed ? precomputed : &own_scale;
  }
  // An outside implementation's values ("actual", `check`) may differ from the
  // reference in the sign of a zero (docs/contract.md §15); moeverify's own may not.
  const bool outside = variant == "actual";
  ch.diff = diff_tensors(*f, *r, cls, ch.tol, coords_for(o.coords, *f, fb, rank, ranks), mask, scale, outside);
  if (ch.diff.signed_zeros)
    ch.note = std::to_string(ch.diff.signed_zeros) +
              " element(s) are a zero of the other sign (+0 against -0): equal under check's signed-zero rule "
              "(docs/contract.md §15)";
  if (!ch.diff.structural.empty()) {
    ch.outcome = Outcome::INCORRECT;
    ch.note = ch.diff.structural;
  } else if (ch.diff.mismatches) {
    ch.outcome = Outcome::INCORRECT;
  } else if (o.promised && o.promised(c, fb) && ch.diff.both_all_zero) {
    ch.outcome = Outcome::NOT_VERIFIED;
    ch.note = "both tensors are all zero where the case promises data" + all_zero_reason(c, o.name, fb);
  }
  if (scale && ch.diff.structural.empty() && ch.diff.max_bound_ratio > 0) {
    std::ostringstream n;
    n.precision(3);
    // (cls_for: an any-order sum, OutputSpec)
    const bool rounding = cls == CompareClass::rounding, any_order = rounding && o.cls_for;
    n << (any_order ? kAnyOrderBoundNote : rounding ? kRoundingBoundNote : kScaledBoundNote)
      << (any_order ? "" : " (docs/contract.md, comparison classes)") << ", largest error/bound " << ch.diff.max_bound_ratio;
    // A zero half-width: the rounding (every order) leaves the value exact there.
    if (rounding && std::isinf(ch.diff.max_bound_ratio))
      n << (any_order ? " (where every order adds alike the bound is 0: a value that differs there is wrong in any order)"
                      : " (a value the rounding leaves exact differs)");
    ch.note += (ch.note.empty() ? "" : "; ") + n.str();
  }
  if (scale && cls == CompareClass::rounding && ch.diff.structural.empty()) open_halfwidths(*scale, ch);
  if (f && r) add_hints(ch, slot, *f, *r, fb);  // run and check alike
  return ch;
}


namespace {

/// One MoE layer entry of a case: the pipeline, then the EP and SP
/// invariance checks; the reference chain's integer metadata in `chain`.
bool run_entry(const Case& c, const RunOptions& opt, bool use_mpi, CaseReport& rep, Board& fast, Board& chain) {
  const int R = c.ep;
  std::vector<RankBoard> inputs(static_cast<size_t>(R));
  // Each rank's inputs are a pure function of (seed, stream, rank, row,
  // column): ranks are generated on the run's threads.
  ParallelErrors errors;
  // The global tensors (gate, weights) once, shared by every rank's board.
  std::map<std::string, Tensor> globals;
  try {
    globals = make_global_inputs(c, opt.threads);
  } catch (const std::bad_alloc&) {
    rethrow_out_of_memory(c.name, "input generation");
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, opt.threads)) if (opt.threads > 1 && R > 1)
  for (int r = 0; r < R; ++r) errors.run(r, [&] { inputs[size_t(r)] = make_inputs(c, r, c.tokens_on(r), &globals); });
  try {
    errors.rethrow();
  } catch (const std::bad_alloc&) {
    rethrow_out_of_memory(c.name, "input generation");
  }
  const bool completed = run_pipeline(c, opt, inputs, use_mpi, rep, fast, &chain);
  if (R > 1 && completed && !opt.fast_only) check_ep_invariance(c, opt, inputs, globals, fast, chain, rep);
  if (c.sp > 1 && completed && !opt.fast_only) check_sp_invariance(c, opt, fast, rep);
  return completed;
}

/// Rows each rank's experts received in one entry (the all-to-all's
/// received rows; docs/contract.md §12 "tokens received"), from a board's counts.
std::vector<int64_t> received_rows(const Board& b) {
  std::vector<int64_t> v;
  for (int r = 0; r < int(b.ranks.size()); ++r) {
    int64_t n = 0;
    const char* name = b.has("recv_counts", r) ? "recv_counts" : "counts";
    if (b.has(name, r))
      for (int64_t x : to_ints(b.at(name, r))) n += x;
    v.push_back(n);
  }
  return v;
}

}  // namespace

/// An exact comparison of fast and reference values of the overload factor.
Check overload_check(const std::string& what, const std::vector<double>& fast, const std::vector<double>& ref) {
  Check ch;
  ch.slot = "overload_factor";
  ch.variant = "running_sums";
  ch.tensor = what;
  ch.diff.total = int64_t(ref.size());
  std::ostringstream note;
  note.precision(17);
  for (size_t i = 0; i < ref.size(); ++i) {
    const double f = i < fast.size() ? fast[i] : std::nan("");
    if (std::memcmp(&f, &ref[i], sizeof f) == 0) continue;
    if (ch.diff.mismatches++ == 0) note << "entry " << i << ": fast " << f << ", reference " << ref[i];
    ch.diff.max_abs = std::max(ch.diff.max_abs, std::fabs(f - ref[i]));
  }
  if (ch.diff.mismatches > 0 || fast.size() != ref.size()) {
    ch.outcome = Outcome::INCORRECT;
    ch.note = fast.size() != ref.size() ? "fast has " + std::to_string(fast.size()) + " values, reference " +
                                              std::to_string(ref.size())
                                        : note.str();
  }
  return ch;
}

Check check_output(const Case& c, const std::string& slot, const std::string& variant, const OutputSpec& o,
                   const Tensor* actual, const Tensor* expected, const RankBoard& board, int rank, int ranks,
                   const std::string& against, const Tensor* scale) {
  return make_check(c, slot, variant, o, actual, expected, board, rank, ranks, against, scale);
}
namespace {
/// The body of run_case once the backend is settled (opt.mirror set on a device).
void run_case_on(const Case& c, const RunOptions& opt, CaseReport& rep, std::chrono::steady_clock::time_point t0);
}  // namespace

CaseReport run_case(const Case& c, const RunOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  CaseReport rep;
  rep.c = c;
  // Never a run on another backend in disguise: a case the chosen backend
  // cannot run whole is NOT_SUPPORTED with the reason, and nothing runs.
  // Nor a pass on the forward alone when gradients were asked for and no
  // backward contract covers the case.
  const std::string no_backend = backend_unsupported(c), no_backward = backward_unsupported(c);
  if (!no_backend.empty() || !no_backward.empty()) {
    Check ch;
    ch.slot = no_backend.empty() ? "backward" : "backend";
    ch.variant = no_backend.empty() ? "-" : enum_name(backend_table(), c.backend);
    ch.tensor = "-";
    ch.outcome = Outcome::NOT_SUPPORTED;
    ch.note = no_backend.empty() ? no_backward + "; backward: off checks the forward" : no_backend;
    rep.checks.push_back(ch);
    rep.outcome = Outcome::NOT_SUPPORTED;
    return rep;
  }
  // A device backend: one device and one mirror for the whole case (its
  // layer entries and invariance reruns too), inputs uploaded once.
  std::string why;
  std::unique_ptr<Device> device = make_backend_device(c.backend, opt.threads, why);
  if (c.backend != Backend::host && !device) runtime_error("--backend " + std::string(enum_name(backend_table(), c.backend)) + ": " + why);
  std::unique_ptr<Mirror> mirror = device ? std::make_unique<Mirror>(*device) : nullptr;
  RunOptions dopt = opt;
  dopt.mirror = mirror.get();
  if (device) {
    rep.notes.push_back("fast path on " + device->name());
    if (c.ep > 1)
      rep.notes.push_back(launched_under_mpi()
                              ? (c.backend == Backend::cuda
                                     ? "token all-to-all: NCCL, one GPU per process (metadata over MPI)"
                                     : "token all-to-all: MPI, host-staged (the emulated device is host memory)")
                              : "token all-to-all: in-process ranks, device-to-device copies");
  }
  try {
    run_case_on(c, dopt, rep, t0);
  } catch (const std::bad_alloc&) {
    rethrow_out_of_memory(c.name, "");
  }
  return rep;
}

namespace {

void run_case_on(const Case& c, const RunOptions& opt, CaseReport& rep, std::chrono::steady_clock::time_point t0) {
  const int R = c.ep;
  const bool use_mpi = launched_under_mpi();
  if (use_mpi) mpi_agree_on_case(c.name, config_hash(c, opt.faults), c.summary());  // every rank, same case
  if (use_mpi && mpi_world().size() != R)
    bad_input(c.source + ": case " + c.name + " has ep " + std::to_string(R) + " but mpirun started " +
              std::to_string(mpi_world().size()) + " processes; valid: mpirun -np " + std::to_string(R));
  // MoE layer entries (docs/contract.md §12) run one after another, each its own
  // pipeline with its own router weights; with more than one, an entry's
  // stages are reported as "layer<l>/<slot>".
  OverloadInput ov;
  ov.ranks = R;
  ov.backward = c.backward == Switch::on;
  std::vector<std::vector<int64_t>> ref_actual, ref_balanced;
  bool completed = true;
  for (int l = 0; l < c.layers && completed; ++l) {
    Case cl = c;
    const std::string prefix = c.layers > 1 ? "layer" + std::to_string(l + 1) + "/" : "";
    if (c.layers > 1) {
      cl.layer = l;
      cl.name = c.name + "_layer" + std::to_string(l + 1);  // its own --dump folder
    }
    CaseReport rl;
    rl.c = cl;
    Board fast, chain;
    RunOptions ol = opt;
    if (l > 0) ol.after_slot = nullptr;  // the hook sees layer entry 1 only
    completed = run_entry(cl, ol, use_mpi, rl, fast, chain);
    for (auto& ch : rl.checks) ch.slot = prefix + ch.slot, rep.checks.push_back(std::move(ch));
    for (auto& d : rl.decisions) d.slot = prefix + d.slot, rep.decisions.push_back(std::move(d));
    for (auto& n : rl.notes) rep.notes.push_back(prefix + n);
    if (opt.keep == RunOptions::Keep::fast_board && l == 0) rep.fast = fast;
    if (!completed) break;
    std::vector<int64_t> bal;
    for (int r = 0; r < R; ++r) bal.push_back(c.tokens_on(r) * c.top_k);
    const std::vector<int64_t> got = received_rows(fast);
    ov.actual.insert(ov.actual.end(), got.begin(), got.end());
    ov.balanced.insert(ov.balanced.end(), bal.begin(), bal.end());
    ++ov.entries;
    ref_actual.push_back(received_rows(chain));
    ref_balanced.push_back(bal);
  }
  // The overload factor (docs/contract.md §12): the running sums a training loop
  // keeps, from the fast pipeline's received rows, against the reference's
  // timeline from the reference chain's.
  if (completed && !opt.fast_only && ov.entries > 0) {
    const OverloadFactors f = overload_factors(ov, opt.faults);
    const ref::OverloadRef g = ref::overload_factors(ref_actual, ref_balanced, ov.backward);
    rep.checks.push_back(overload_check("entries", f.entries, g.entries));
    rep.checks.push_back(overload_check("avg", {f.avg}, {g.avg}));
    rep.checks.push_back(overload_check("max", {f.max}, {g.max}));
    rep.checks.push_back(overload_check("max_cum", {f.max_cum}, {g.max_cum}));
    rep.overload = {true, f.entries, f.avg, f.max, f.max_cum};
  }
  if (opt.progress) opt.progress("", "");
  for (const auto& ch : rep.checks) rep.outcome = worst(rep.outcome, ch.outcome);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

}  // namespace moev
