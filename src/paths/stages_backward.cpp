// Stage variants of the backward token path (`backward: on`; docs/contract.md §13,
// docs/frameworks.md §13): the adjoint of every forward slot, in reverse order, each
// fast stage against its reference on the same inputs (stage isolation).
//
// Slots (after the forward's) and the tensors they write, all prefixed grad_:
//   combine_bwd        grad_out (T, D) -> grad_routed_output (N, D), and under
//                      scores after the experts grad_topk_scores (T, K) fp32
//   shared_experts_bwd grad_out -> grad_x_shared (T, D): the shared expert's
//                      input gradient (identity: grad_out itself)
//   ep_combine_bwd     grad_routed_output -> grad_recv_out (M, D): the forward
//                      all-to-all of the dispatch (the combine's splits swapped)
//   ep_unpermute_bwd   grad_recv_out -> grad_unpadded: the permute (rank-major
//                      -> expert-major)
//   align_unpad_bwd    grad_unpadded -> grad_expert_output: the padding
//                      (padding rows zero)
//   experts_bwd        grad_expert_output -> grad_expert_input, sum(expert_counts)
//                      rows: the rows of some expert group (a padding tail
//                      past the last group belongs to none and gets none)
//   align_pad_bwd      grad_expert_input -> grad_permuted (M, D): each group's
//                      real rows, padding-row gradients dropped
//   ep_permute_bwd     grad_permuted -> grad_recv: the unpermute
//   ep_dispatch_bwd    grad_recv -> grad_routed_input (N, D): the combine's
//                      all-to-all (the dispatch's splits swapped)
//   dispatch_bwd       grad_routed_input -> grad_x (T, D): the ordered
//                      scatter-add, K gradients per token in ascending expert
//                      order, no atomics, + grad_x_shared; under scores before
//                      the experts also grad_topk_scores
//
//   router_bwd         grad_topk_scores -> grad_scores, grad_logits (T, E) fp32,
//                      grad_wg (E, D) and grad_x_router (T, D): the router's
//                      own input gradient, kept apart from grad_x
//
// Saved forward metadata only (docs/frameworks.md §13 last line): splits, counts,
// row_of, token_sorted and score_sorted are read from the forward's board,
// never recomputed from the routing. One backward serves every forward
// variant of a slot: the forward variants are bit-identical data movements
// (docs/contract.md §5, §6, §7), so the backward of the equal-split and force-LB
// all-to-all is the variable all-to-all with swapped splits, and only the
// permute has an equal-count variant of its own.
//
// Numerics (README "Backward"): gradient rows are data movement except where
// a score multiplies them, round_act(float(g) * s) as the forward's multiply;
// the scatter-add is the forward combine's (order; accumulate mode per
// grad_accumulate, by default the combine's), so
// every gradient row is compared bitwise. The score gradient is an fp32
// dot product over D: compared with the half-width of an fp32 summation
// against an fp64 reference (class rounding), which flags act-rounded
// products (TransformerEngine #1336).
//
// SwiGLU experts: their gradients (dX, dW1, dW3, dW2) under the default
// conventions (fused activation, GEMMs in act, fp32 weight gradients) are
// compared within the GEMM bound (variants swiglu, shared_swiglu); under
// experts.rounding torchtitan or experts.compute_dtype bf16 they follow
// autograd's rounding points and are compared with the half-widths of class
// rounding (variants swiglu_autograd, shared_swiglu_autograd, listed only in
// such cases), so that one rounding more or less fails.
#include <cmath>
#include <cstring>
#include <mutex>

#include "../kernels/backward_host.h"
#include "../kernels/ep_host.h"
#include "../kernels/swiglu_bwd_host.h"
#include "../reference/backward.h"
#include "comm.h"
#include "config_hash.h"
#include "stages.h"

namespace moev {

std::string backward_unsupported(const Case&) {
  // Every expert convention has a backward contract (docs/contract.md §13):
  // the SwiGLU experts under experts.rounding, experts.compute_dtype,
  // experts.w13_fused and score_on_hidden, routed and shared alike. A
  // convention added without one must be refused here.
  return "";
}

namespace {

Decision backward_on(const Case& c) {
  if (c.backward != Switch::on) return {false, "backward: off"};
  if (const std::string why = backward_unsupported(c); !why.empty()) return {false, why};
  return {};
}

bool scores_before(const Case& c) { return c.score_before_experts == Switch::on; }
/// score_on_hidden (docs/contract.md §14): the score multiplied the SwiGLU
/// hidden, so its gradient is the experts' (experts_bwd) and the combine
/// added the rows unscaled.
bool on_hidden(const Case& c) { return c.score_on_hidden == Switch::on; }
/// Whether the forward combine multiplied by the score: its backward then
/// scales the rows and gives the score gradient.
bool combine_scaled(const Case& c) { return !scores_before(c) && !on_hidden(c); }
k::ScoreApply apply_of(const Case& c) {
  return scores_before(c) ? k::ScoreApply::before_experts : k::ScoreApply::after_experts;
}
ref::ScoreApply ref_apply(const Case& c) {
  return scores_before(c) ? ref::ScoreApply::before_experts : ref::ScoreApply::after_experts;
}
/// The score multiply as the backward sees it. Under router.score_dtype act
/// (docs/contract.md §14) the score is already an act value, so rounding it
/// changes nothing, and its gradient is rounded to act as autograd rounds
/// the gradient of an act tensor: exactly score_multiply act.
k::ScoreMultiply score_product(const Case& c) {
  return c.router.score_dtype == GateDtype::act ? k::ScoreMultiply::act : c.score_multiply;
}
ref::ScoreMultiply ref_smul(const Case& c) {
  return score_product(c) == k::ScoreMultiply::act ? ref::ScoreMultiply::act : ref::ScoreMultiply::fp32;
}
bool has_shared(const Case& c) { return c.shared.kind != SharedKind::none; }
/// The dispatch backward's accumulation (combine.accumulate's unless grad_accumulate names one).
ref::Accumulate grad_acc(const Case& c) {
  return c.dispatch_grad_accumulate() == k::Accumulate::per_add ? ref::Accumulate::per_add
                                                                  : ref::Accumulate::fp32_accumulate;
}
bool w13_fused(const Case& c) { return c.experts.w13_fused == Switch::on; }
bool routed_swiglu(const Case& c) { return c.experts.kind == ExpertKind::swiglu; }
bool shared_swiglu(const Case& c) { return c.shared.kind == SharedKind::swiglu; }
/// Whether a SwiGLU site runs under autograd's rounding rules (docs/contract.md §13):
/// experts.rounding torchtitan (routed and shared), experts.compute_dtype
/// bf16 (routed only, as the forward, docs/contract.md §14).
bool routed_autograd(const Case& c) {
  return c.experts.rounding != k::SiluRounding::fused || c.experts.compute_dtype != ComputeDtype::act;
}
bool shared_autograd(const Case& c) { return c.experts.rounding != k::SiluRounding::fused; }
ref::SiluRounding ref_rounding(const Case& c) {
  return c.experts.rounding == k::SiluRounding::fused ? ref::SiluRounding::fused : ref::SiluRounding::torchtitan;
}
ref::Compute ref_compute(const Case& c) {
  return c.experts.compute_dtype == ComputeDtype::bf16 ? ref::Compute::bf16 : ref::Compute::act;
}

int64_t sum_of(const Tensor& t) {
  int64_t n = 0;
  for (int64_t v : to_ints(t)) n += v;
  return n;
}

/// A data promise for a stage that moves the rows of `input`: its gradient
/// rows are not all zero when the input's are not (a permute or a drop of
/// zero padding rows keeps every nonzero row).
Promise moves_nonzero(const std::string& input) {
  return [input](const Case&, const RankBoard& b) {
    auto it = b.find(input);
    return it != b.end() && any_nonzero(it->second);
  };
}

Stage make(const std::string& slot, const std::string& variant, const std::string& summary,
           std::vector<std::string> inputs, std::vector<OutputSpec> outputs, std::function<void(FastCtx&)> fast,
           std::function<void(RefCtx&)> ref) {
  return make_stage(slot, variant, summary, backward_on, std::move(inputs), std::move(outputs), std::move(fast),
                    std::move(ref));
}

Tensor& rows_out(FastCtx& ctx, const std::string& name, int64_t rows) {
  return ctx.output(name, act_elem(ctx.c.dtype), {rows, ctx.c.hidden});
}

/// Error scale (class rounding: the half-width) of the score gradient, from
/// the stage's inputs: token rows and dispatch rows per the score position.
Tensor score_grad_scale(const Case& c, const RankBoard& b, int, int) {
  const bool before = scores_before(c);
  const Tensor& row_of = b.at("row_of");
  ref::Vec half;
  ref::score_grad(ref_act(c.dtype), ref_smul(c), rows_of(b.at(before ? "x" : "grad_out")),
                  rows_of(b.at(before ? "grad_routed_input" : "routed_output")), ref_ids(row_of), row_of.shape[0],
                  c.hidden, c.top_k, half);
  return from_floats(half, ElemType::f32, row_of.shape);
}

OutputSpec score_grad_spec() {
  return OutputSpec("grad_topk_scores", CompareClass::rounding, Coords::token_k, nullptr, score_grad_scale);
}

/// The reference score gradient and its half-width onto `out`.
void ref_score_grad(const Case& c, const RankBoard& in, RankBoard& out, const std::string& token_rows,
                    const std::string& dispatch_rows) {
  const Tensor& row_of = in.at("row_of");
  ref::Vec half;
  const ref::Vec g = ref::score_grad(ref_act(c.dtype), ref_smul(c), rows_of(in.at(token_rows)),
                                     rows_of(in.at(dispatch_rows)), ref_ids(row_of), row_of.shape[0], c.hidden,
                                     c.top_k, half);
  out["grad_topk_scores"] = from_floats(g, ElemType::f32, row_of.shape);
  // Kept for the end-to-end check of the chain (registry pipeline_results).
  out["grad_topk_scores_scale"] = from_floats(half, ElemType::f32, row_of.shape);
}

// ---- combine_bwd -------------------------------------------------------------

void fast_combine_bwd(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& g = ctx.input("grad_out");
  const Tensor& tok = ctx.input("token_sorted");
  const int64_t T = g.shape[0], N = tok.numel();
  Tensor& rows = rows_out(ctx, "grad_routed_output", N);
  float* gs = nullptr;
  const void* routed = nullptr;
  if (combine_scaled(c)) {
    gs = ctx.output("grad_topk_scores", ElemType::f32, {T, c.top_k}).as<float>();
    routed = ctx.input("routed_output").data();
  }
  // unscaled rows (the before_experts form) where the combine did not multiply
  const k::ScoreApply apply = combine_scaled(c) ? k::ScoreApply::after_experts : k::ScoreApply::before_experts;
  combine_backward(ctx.exec, c.dtype, apply, score_product(c), g.data(), routed,
                   ctx.input("score_sorted").as<float>(), tok.as<int32_t>(), ctx.input("row_of").as<int32_t>(), T, N,
                   c.hidden, c.top_k, rows.data(), gs);
}

void ref_combine_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    const RankBoard& in = r.in.ranks[q];
    RankBoard& out = r.out.ranks[q];
    out["grad_routed_output"] =
        rows_tensor(ref::combine_grad_rows(ref_act(c.dtype),
                                           combine_scaled(c) ? ref::ScoreApply::after_experts
                                                             : ref::ScoreApply::before_experts,
                                           ref_smul(c), rows_of(in.at("grad_out")), ref_ids(in.at("token_sorted")),
                                           to_floats(in.at("score_sorted"))),
                    act_elem(c.dtype), c.hidden);
    if (combine_scaled(c)) ref_score_grad(c, in, out, "grad_out", "routed_output");
  }
}

// ---- shared_experts_bwd --------------------------------------------------------

void fast_shared_identity_bwd(FastCtx& ctx) {
  const Tensor& g = ctx.input("grad_out");
  Tensor& o = ctx.output("grad_x_shared", g.type, g.shape);
  copy_bytes(ctx.exec, o.data(), g.data(), g.bytes());
}

void ref_shared_identity_bwd(RefCtx& r) {
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    const Tensor& g = r.in.at("grad_out", int(q));
    r.out.ranks[q]["grad_x_shared"] = from_floats(to_floats(g), g.type, g.shape);
  }
}

// ---- all-to-all backward (docs/frameworks.md §13, §3.5) -----------------------------------

/// Sends `in` with send splits `send` and receives `recv` splits into `out`:
/// the all-to-all of a gradient, whose splits are the forward's swapped. The
/// planted fault bwd_unswapped_splits swaps them back (the forward's roles).
void a2a_rows(FastCtx& ctx, const std::string& in_name, std::vector<int64_t> send, std::vector<int64_t> recv,
              const std::string& out_name, const char* what) {
  if (ctx.exec.faults.has(Fault::bwd_unswapped_splits)) std::swap(send, recv);
  const Tensor& in = ctx.input(in_name);
  int64_t rows = 0;
  for (int64_t v : recv) rows += v;
  Tensor& out = rows_out(ctx, out_name, rows);
  ctx.exchange_rows(in, send, out, recv, what);
}

/// The combine's all-to-all sent recv_out with output_splits and received
/// input_splits; its gradient goes the dispatch's way.
void fast_ep_combine_bwd(FastCtx& ctx) {
  a2a_rows(ctx, "grad_routed_output", to_ints(ctx.input("input_splits")), to_ints(ctx.input("output_splits")),
           "grad_recv_out", "gradient all-to-all (combine backward)");
}

void ref_ep_combine_bwd(RefCtx& r) {
  const int R = int(r.in.ranks.size()), E_l = r.c.num_experts / R;
  std::vector<ref::RowsRef> rows;
  std::vector<ref::Counts> counts;
  for (int q = 0; q < R; ++q) {
    rows.push_back(rows_of(r.in.at("grad_routed_output", q)));
    counts.push_back(ref_counts(r.in.at("counts", q)));
  }
  std::vector<ref::Bytes> got = ref::ep_send_rows(rows, counts, R, E_l);
  for (int q = 0; q < R; ++q)
    r.out.ranks[size_t(q)]["grad_recv_out"] = rows_tensor(std::move(got[size_t(q)]), act_elem(r.c.dtype), r.c.hidden);
}

/// The dispatch's all-to-all sent routed_input with input_splits; its
/// gradient goes back with the splits swapped.
void fast_ep_dispatch_bwd(FastCtx& ctx) {
  a2a_rows(ctx, "grad_recv", to_ints(ctx.input("output_splits")), to_ints(ctx.input("input_splits")),
           "grad_routed_input", "gradient all-to-all (dispatch backward)");
}

void ref_ep_dispatch_bwd(RefCtx& r) {
  const int R = int(r.in.ranks.size()), E_l = r.c.num_experts / R;
  std::vector<ref::RowsRef> rows;
  std::vector<ref::Counts> rc;
  for (int q = 0; q < R; ++q) {
    rows.push_back(rows_of(r.in.at("grad_recv", q)));
    rc.push_back(ref_counts(r.in.at("recv_counts", q)));
  }
  std::vector<ref::Bytes> back = ref::ep_return(rows, rc, R, E_l);
  for (int p = 0; p < R; ++p)
    r.out.ranks[size_t(p)]["grad_routed_input"] =
        rows_tensor(std::move(back[size_t(p)]), act_elem(r.c.dtype), r.c.hidden);
}

// ---- permutes (docs/contract.md §3, §7; docs/frameworks.md §13 "permute by bijection") -------

/// Equal-count precondition (docs/contract.md §7) on every rank's received counts;
/// the ranks agree before any declines, as in the forward.
bool equal_count_ready(FastCtx& ctx, int64_t& cnt) {
  cnt = uniform_count(to_ints(ctx.input("recv_counts")));
  int64_t not_ready = cnt == 0;
  ctx.comm->allreduce_max(&not_ready, 1, "equal-count precondition (backward)");
  if (not_ready) ctx.skip("received segment counts are not all equal and > 0 on every rank");
  return !not_ready;
}

/// Rank-major -> expert-major (the unpermute's backward, inverse = 0) or back
/// (the permute's backward, inverse = 1), by the generic table or the
/// equal-count transpose.
void fast_permute_rows(FastCtx& ctx, PermuteMode mode, int inverse, const std::string& in_name,
                       const std::string& out_name) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E_l = c.num_experts / R;
  const Tensor& in = ctx.input(in_name);
  if (mode == PermuteMode::equal_count) {
    int64_t cnt = 0;
    if (!equal_count_ready(ctx, cnt)) return;
    Tensor& out = rows_out(ctx, out_name, in.shape[0]);
    apply_equal_count(ctx.exec, c.dtype, in.data(), EqualCountMap{R, E_l, cnt, inverse}, in.shape[0], c.hidden,
                      out.data());
    return;
  }
  const std::vector<int64_t> rc = to_ints(ctx.input("recv_counts"));
  std::vector<int64_t> map = permute_map_generic(rc.data(), R, E_l);
  if (inverse) map = invert_map(map);
  Tensor& out = rows_out(ctx, out_name, in.shape[0]);
  apply_row_map(ctx.exec, c.dtype, in.data(), map.data(), int64_t(map.size()), c.hidden, out.data());
}

void ref_unpermute_bwd(RefCtx& r) {
  const int R = int(r.in.ranks.size()), E_l = r.c.num_experts / R;
  for (int q = 0; q < R; ++q)
    r.out.ranks[size_t(q)]["grad_unpadded"] =
        rows_tensor(ref::permute_to_expert_major(rows_of(r.in.at("grad_recv_out", q)),
                                                 ref_counts(r.in.at("recv_counts", q)), R, E_l),
                    act_elem(r.c.dtype), r.c.hidden);
}

void ref_permute_bwd(RefCtx& r) {
  const int R = int(r.in.ranks.size()), E_l = r.c.num_experts / R;
  for (int q = 0; q < R; ++q)
    r.out.ranks[size_t(q)]["grad_recv"] =
        rows_tensor(ref::permute_to_rank_major(rows_of(r.in.at("grad_permuted", q)),
                                               ref_counts(r.in.at("recv_counts", q)), R, E_l),
                    act_elem(r.c.dtype), r.c.hidden);
}

// ---- padding (docs/contract.md §4; docs/frameworks.md §13 "pad backward = slice") -----------------

PadLayout layout_of(FastCtx& ctx, const std::vector<int64_t>& real) {
  const Case& c = ctx.c;
  return pad_layout(real.data(), int(real.size()), c.align,
                    c.empty_groups == EmptyGroups::pad ? EmptyGroupRows::align : EmptyGroupRows::zero, FaultSet{});
}

/// The unpad's backward: the forward padding of the gradient, padding rows
/// zero, over the groups' rows (sum of expert_counts).
void fast_unpad_bwd(FastCtx& ctx) {
  const std::vector<int64_t> real = to_ints(ctx.input("expert_counts_real"));
  const PadLayout l = layout_of(ctx, real);
  const std::vector<int64_t> map = pad_map(real.data(), l, FaultSet{});
  const int64_t rows = sum_of(ctx.input("expert_counts"));
  Tensor& out = rows_out(ctx, "grad_expert_output", rows);
  apply_row_map(ctx.exec, ctx.c.dtype, ctx.input("grad_unpadded").data(), map.data(), rows, ctx.c.hidden, out.data());
}

void ref_unpad_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    ref::Counts sizes;
    ref::Bytes b = ref::pad_groups(rows_of(r.in.at("grad_unpadded", int(q))),
                                   ref_counts(r.in.at("expert_counts_real", int(q))), c.align,
                                   c.empty_groups == EmptyGroups::pad, sizes);
    int64_t rows = 0;
    for (int64_t n : sizes) rows += n;
    b.resize(size_t(rows * c.hidden) * elem_bytes(act_elem(c.dtype)));  // the zero tail is no group's
    r.out.ranks[q]["grad_expert_output"] = rows_tensor(std::move(b), act_elem(c.dtype), c.hidden);
  }
}

/// The pad's backward: each group's real rows, the padding rows' gradients
/// dropped. The planted fault bwd_pad_grad_kept slices the first M rows of
/// the padded gradient instead, padding rows in place of real ones.
void fast_pad_bwd(FastCtx& ctx) {
  const std::vector<int64_t> real = to_ints(ctx.input("expert_counts_real"));
  const PadLayout l = layout_of(ctx, real);
  std::vector<int64_t> map = unpad_map(real.data(), l);
  if (ctx.exec.faults.has(Fault::bwd_pad_grad_kept))
    for (size_t i = 0; i < map.size(); ++i) map[i] = int64_t(i);
  Tensor& out = rows_out(ctx, "grad_permuted", int64_t(map.size()));
  apply_row_map(ctx.exec, ctx.c.dtype, ctx.input("grad_expert_input").data(), map.data(), int64_t(map.size()),
                ctx.c.hidden, out.data());
}

void ref_pad_bwd(RefCtx& r) {
  for (size_t q = 0; q < r.in.ranks.size(); ++q)
    r.out.ranks[q]["grad_permuted"] =
        rows_tensor(ref::unpad_groups(rows_of(r.in.at("grad_expert_input", int(q))),
                                      ref_counts(r.in.at("expert_counts_real", int(q))),
                                      ref_counts(r.in.at("expert_counts", int(q)))),
                    act_elem(r.c.dtype), r.c.hidden);
}

// ---- experts_bwd -----------------------------------------------------------------

void fast_experts_identity_bwd(FastCtx& ctx) {
  const Tensor& g = ctx.input("grad_expert_output");
  Tensor& o = rows_out(ctx, "grad_expert_input", g.shape[0]);
  copy_bytes(ctx.exec, o.data(), g.data(), g.bytes());
}

void ref_experts_identity_bwd(RefCtx& r) {
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    const ref::RowsRef g = rows_of(r.in.at("grad_expert_output", int(q)));
    r.out.ranks[q]["grad_expert_input"] =
        rows_tensor(ref::Bytes(g.data, g.data + size_t(g.rows) * g.row_bytes), act_elem(r.c.dtype), r.c.hidden);
  }
}

// ---- SwiGLU experts and shared experts backward (kernels/swiglu_bwd_host.h) ------

const void* weight_ptr(const FastCtx& ctx, const std::string& name, int64_t first) {
  const Tensor& w = ctx.input(name);
  return static_cast<const uint8_t*>(w.data()) + size_t(first) * size_t(w.numel() / w.shape[0]) * elem_bytes(w.type);
}

/// One SwiGLU backward problem in reference values: rows grouped by counts,
/// the weights of the experts concerned.
struct SwigluBwdArgs {
  ref::Vec X, dY;
  ref::WeightView W1, W3, W2;  // in place on the board
  ref::Counts counts;
  int64_t rows = 0;
  ref::Vec scores;  // score_on_hidden: one per row (routed_row_scores); else empty
  const float* scale() const { return scores.empty() ? nullptr : scores.data(); }
};

/// Per-row values (a row's score gradient) onto the (T, K) assignments: row
/// i of expert group e (expert_counts) holds token t = token_sorted[i] for
/// the k with ids[t, k] = e. Read from the rows themselves, not row_of, so
/// that an outside implementation that kept other tokens of an exact tie at
/// a capacity (which the capacity check accepts) is judged on its own rows.
/// An assignment no row holds (dropped) gets 0: it scaled nothing; a filler
/// row (token -1) reaches no assignment.
Tensor rows_to_assignments(const ref::Vec& v, const RankBoard& b) {
  const Tensor& ids = b.at("ids");
  const std::vector<int64_t> id = to_ints(ids), tok = to_ints(b.at("token_sorted")),
                             counts = to_ints(b.at("expert_counts"));
  const int64_t K = ids.shape.size() > 1 ? ids.shape[1] : 0;
  ref::Vec a(id.size(), 0.f);
  int64_t i = 0;
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t j = 0; j < counts[e]; ++j, ++i) {
      const int64_t t = tok[size_t(i)];
      for (int64_t k = 0; t >= 0 && k < K; ++k)
        if (id[size_t(t * K + k)] == int64_t(e)) a[size_t(t * K + k)] = v[size_t(i)];
    }
  return from_floats(a, ElemType::f32, ids.shape);
}

ref::HiddenScale hidden_scale(const Case& c, const SwigluBwdArgs& a) {
  ref::HiddenScale hs;
  hs.s = a.scale();
  hs.round_grad = score_product(c) == k::ScoreMultiply::act;
  return hs;
}

/// Routed experts of rank `rank`: experts [rank*E_l, (rank+1)*E_l) over the
/// groups of expert_input (rows past the last group are no expert's).
SwigluBwdArgs routed_args(const Case& c, const RankBoard& b, int rank) {
  SwigluBwdArgs a;
  a.counts = ref_counts(b.at("expert_counts"));
  for (int64_t n : a.counts) a.rows += n;
  a.X = to_floats(b.at("expert_input"));
  a.X.resize(size_t(a.rows * c.hidden));
  a.dY = to_floats(b.at("grad_expert_output"));
  a.dY.resize(size_t(a.rows * c.hidden));
  const int64_t E_l = int64_t(a.counts.size()), first = int64_t(rank) * E_l;
  a.W1 = weight_view(b.at("w1"), first);
  a.W3 = weight_view(b.at("w3"), first);
  a.W2 = weight_view(b.at("w2"), first);
  if (on_hidden(c)) a.scores = routed_row_scores(c, b);
  return a;
}

/// The shared expert: one group of every token.
SwigluBwdArgs shared_args(const Case&, const RankBoard& b) {
  SwigluBwdArgs a;
  a.X = to_floats(b.at("x"));
  a.dY = to_floats(b.at("grad_out"));
  a.rows = b.at("x").shape[0];
  a.counts = {a.rows};
  a.W1 = weight_view(b.at("shared_w1"), 0);
  a.W3 = weight_view(b.at("shared_w3"), 0);
  a.W2 = weight_view(b.at("shared_w2"), 0);
  return a;
}

/// Half-widths (class rounding) of the gradients under the case's rules
/// (fused, or autograd's), of the routed (shared = false) or the shared
/// expert (which: 0 dX, 1 dW1, 2 dW3, 3 dW2).
Magnitude autograd_halfwidth(bool shared, int which) {
  return [shared, which](const Case& c, const RankBoard& b, int rank, int) {
    const SwigluBwdArgs a = shared ? shared_args(c, b) : routed_args(c, b, rank);
    const ref::SwigluGrads g =
        ref::swiglu_experts_backward(ref_act(c.dtype), a.X, a.dY, a.counts, c.hidden, c.ffn, a.W1, a.W3, a.W2,
                                     ref_rounding(c), shared ? ref::Compute::act : ref_compute(c), 1, true, w13_fused(c),
                                     hidden_scale(c, a));
    const int64_t E_l = int64_t(a.counts.size()), D = c.hidden, F = c.ffn;
    const std::vector<int64_t> w13 = shared ? std::vector<int64_t>{F, D} : std::vector<int64_t>{E_l, F, D};
    const std::vector<int64_t> w2 = shared ? std::vector<int64_t>{D, F} : std::vector<int64_t>{E_l, D, F};
    switch (which) {
      case 0: return from_floats(g.mdX, ElemType::f32, {a.rows, D});
      case 1: return from_floats(g.mdW1, ElemType::f32, w13);
      case 2: return from_floats(g.mdW3, ElemType::f32, w13);
      default: return from_floats(g.mdW2, ElemType::f32, w2);
    }
  };
}

/// Half-width (class rounding) of the score gradient under score_on_hidden,
/// per assignment, under the case's rules, fused or autograd's: the
/// spread the rounding ambiguities of H and dH' (their GEMMs within the
/// fp32 accumulation bound) and any fp32 summation order allow
/// (ref::swiglu_backward_autograd, which enumerates them under both). A
/// magnitude bound (class gemm) would be some hundred times |ds| in bf16,
/// wide enough to pass a score gradient off by the score itself.
Tensor hidden_score_halfwidth(const Case& c, const RankBoard& b, int rank, int) {
  const SwigluBwdArgs a = routed_args(c, b, rank);
  const ref::SwigluGrads g =
      ref::swiglu_backward_autograd(ref_act(c.dtype), a.X, a.dY, a.counts, c.hidden, c.ffn, a.W1, a.W3, a.W2,
                                    ref_rounding(c), ref_compute(c), 1, true, w13_fused(c), hidden_scale(c, a));
  return rows_to_assignments(g.mdS, b);
}

/// Realistic data with a gradient that is not all zero gives a nonzero input gradient.
Promise swiglu_grad_promise(const std::string& g) {
  return [g](const Case& c, const RankBoard& b) {
    auto it = b.find(g);
    return promise_realistic(c, b) && it != b.end() && any_nonzero(it->second);
  };
}

void fast_experts_swiglu_bwd(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& cnt = ctx.input("expert_counts");
  const int E_l = int(cnt.numel());
  const int64_t D = c.hidden, F = c.ffn, e0 = int64_t(ctx.rank) * E_l;
  Tensor& dx = rows_out(ctx, "grad_expert_input", sum_of(cnt));
  Tensor& g1 = ctx.output("grad_w1", ElemType::f32, {E_l, F, D});
  Tensor& g3 = ctx.output("grad_w3", ElemType::f32, {E_l, F, D});
  Tensor& g2 = ctx.output("grad_w2", ElemType::f32, {E_l, D, F});
  // score_on_hidden: each row's score gradient, then onto the assignments
  const ref::Vec scores = on_hidden(c) ? routed_row_scores(c, ctx.in) : ref::Vec{};
  std::vector<float> ds(scores.size());
  experts_swiglu_backward(ctx.exec, c.dtype, ctx.input("expert_input").data(), ctx.input("grad_expert_output").data(),
                          cnt.as<int64_t>(), E_l, D, F, weight_ptr(ctx, "w1", e0), weight_ptr(ctx, "w3", e0),
                          weight_ptr(ctx, "w2", e0), dx.data(), g1.as<float>(), g3.as<float>(), g2.as<float>(),
                          SwigluConventions{c.experts.rounding, c.experts.compute_dtype,
                                            scores.empty() ? nullptr : scores.data(), w13_fused(c)},
                          ds.empty() ? nullptr : ds.data());
  if (!on_hidden(c)) return;
  // the gradient of an act score is act (a held score)
  if (score_product(c) == k::ScoreMultiply::act)
    dispatch_dtype(c.dtype, [&](auto tag) {
      for (float& v : ds) v = round_to<decltype(tag)>(v);
    });
  const Tensor g = rows_to_assignments(ds, ctx.in);
  Tensor& gs = ctx.output("grad_topk_scores", ElemType::f32, g.shape);
  if (g.bytes()) std::memcpy(gs.data(), g.data(), g.bytes());  // T = 0: no storage to copy
}

void ref_experts_swiglu_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    const SwigluBwdArgs a = routed_args(c, r.in.ranks[q], int(q));
    // With scales, the half-widths of class rounding under the case's
    // rules (autograd_halfwidth's, from the same GEMMs).
    const ref::SwigluGrads g =
        ref::swiglu_experts_backward(ref_act(c.dtype), a.X, a.dY, a.counts, c.hidden, c.ffn, a.W1, a.W3, a.W2,
                                     ref_rounding(c), ref_compute(c), r.threads, r.wants_scales(), w13_fused(c),
                                     hidden_scale(c, a));
    const int64_t E_l = int64_t(a.counts.size());
    RankBoard& out = r.out.ranks[q];
    if (on_hidden(c)) {
      out["grad_topk_scores"] = rows_to_assignments(g.dS, r.in.ranks[q]);
      if (r.wants_scales())
        r.scales->ranks[q]["grad_topk_scores"] = rows_to_assignments(g.mdS, r.in.ranks[q]);
    }
    out["grad_expert_input"] = from_floats(g.dX, act_elem(c.dtype), {a.rows, c.hidden});
    out["grad_w1"] = from_floats(g.dW1, ElemType::f32, {E_l, c.ffn, c.hidden});
    out["grad_w3"] = from_floats(g.dW3, ElemType::f32, {E_l, c.ffn, c.hidden});
    out["grad_w2"] = from_floats(g.dW2, ElemType::f32, {E_l, c.hidden, c.ffn});
    if (r.wants_scales()) {
      RankBoard& sc = r.scales->ranks[q];
      sc["grad_expert_input"] = from_floats(g.mdX, ElemType::f32, {a.rows, c.hidden});
      sc["grad_w1"] = from_floats(g.mdW1, ElemType::f32, {E_l, c.ffn, c.hidden});
      sc["grad_w3"] = from_floats(g.mdW3, ElemType::f32, {E_l, c.ffn, c.hidden});
      sc["grad_w2"] = from_floats(g.mdW2, ElemType::f32, {E_l, c.hidden, c.ffn});
    }
  }
}

void fast_shared_swiglu_bwd(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& x = ctx.input("x");
  const int64_t T = x.shape[0], D = c.hidden, F = c.ffn;
  Tensor& dx = rows_out(ctx, "grad_x_shared", T);
  // This rank's share of the weight gradients (its tokens' sum, fp32), as
  // the routed experts' (a data-parallel all-reduce would add the ranks').
  Tensor& dw1 = ctx.output("grad_shared_w1", ElemType::f32, {F, D});
  Tensor& dw3 = ctx.output("grad_shared_w3", ElemType::f32, {F, D});
  Tensor& dw2 = ctx.output("grad_shared_w2", ElemType::f32, {D, F});
  experts_swiglu_backward(ctx.exec, c.dtype, x.data(), ctx.input("grad_out").data(), &T, 1, D, F,
                          ctx.input("shared_w1").data(), ctx.input("shared_w3").data(), ctx.input("shared_w2").data(),
                          dx.data(), dw1.as<float>(), dw3.as<float>(), dw2.as<float>(),
                          SwigluConventions{c.experts.rounding, ComputeDtype::act, nullptr, w13_fused(c)});
}

void ref_shared_swiglu_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    const SwigluBwdArgs a = shared_args(c, r.in.ranks[q]);
    const ref::SwigluGrads g =
        ref::swiglu_experts_backward(ref_act(c.dtype), a.X, a.dY, a.counts, c.hidden, c.ffn, a.W1, a.W3, a.W2,
                                     ref_rounding(c), ref::Compute::act, r.threads, r.wants_scales(), w13_fused(c));
    const int64_t D = c.hidden, F = c.ffn;
    RankBoard& out = r.out.ranks[q];
    out["grad_x_shared"] = from_floats(g.dX, act_elem(c.dtype), {a.rows, D});
    out["grad_shared_w1"] = from_floats(g.dW1, ElemType::f32, {F, D});
    out["grad_shared_w3"] = from_floats(g.dW3, ElemType::f32, {F, D});
    out["grad_shared_w2"] = from_floats(g.dW2, ElemType::f32, {D, F});
    if (r.wants_scales()) {
      RankBoard& sc = r.scales->ranks[q];
      sc["grad_x_shared"] = from_floats(g.mdX, ElemType::f32, {a.rows, D});
      sc["grad_shared_w1"] = from_floats(g.mdW1, ElemType::f32, {F, D});
      sc["grad_shared_w3"] = from_floats(g.mdW3, ElemType::f32, {F, D});
      sc["grad_shared_w2"] = from_floats(g.mdW2, ElemType::f32, {D, F});
    }
  }
}

/// End-to-end error scales (docs/contract.md, comparison classes and tolerances) of grad_x and grad_topk_scores
/// with SwiGLU experts, from the tokens, the forward metadata and the
/// weights of one rank: each dispatch row i (token t, expert e by the counts,
/// score s) is the expert's input x[t] (times s before the experts) with the
/// output gradient grad_out[t] (times s after). grad_x: sum over the token's
/// rows of the dX scale (times |s| before the experts) + the shared expert's.
/// grad_topk_scores: sum_d |grad_out| * forward scale of the row (after) or
/// sum_d |x| * dX scale (before). Written onto `out` as grad_x_scale and,
/// with routed SwiGLU experts, grad_topk_scores_scale. The SwiGLU scales run
/// on `threads` threads.
void swiglu_end_to_end_scales(const Case& c, const RankBoard& in, RankBoard& out, int threads) {
  const int64_t T = in.at("row_of").shape[0], D = c.hidden, K = c.top_k;
  const ref::Vec x = to_floats(in.at("x")), g = to_floats(in.at("grad_out"));
  ref::Vec scale(size_t(T * D), 0.f);
  if (routed_swiglu(c)) {
    const bool before = scores_before(c);
    const ref::Ids tok = ref_ids(in.at("token_sorted"));
    const ref::Vec sc = to_floats(in.at("score_sorted"));
    const ref::Counts counts = ref_counts(in.at("counts"));
    const int64_t N = int64_t(tok.size());
    ref::Vec X(size_t(N * D)), dY(size_t(N * D));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D && tok[size_t(i)] >= 0; ++d) {  // a capacity filler row stays zero
        const float s = sc[size_t(i)];
        X[size_t(i * D + d)] = x[size_t(tok[size_t(i)] * D + d)] * (before ? s : 1.f);
        dY[size_t(i * D + d)] = g[size_t(tok[size_t(i)] * D + d)] * (before ? 1.f : s);
      }
    const ref::WeightView w1 = weight_view(in.at("w1"), 0), w3 = weight_view(in.at("w3"), 0),
                          w2 = weight_view(in.at("w2"), 0);
    const ref::SwigluGrads m = ref::swiglu_backward_magnitude(X, dY, counts, D, c.ffn, w1, w3, w2, threads);
    const ref::Vec fwd = before ? ref::Vec{} : ref::swiglu_magnitude(X, counts, D, c.ffn, w1, w3, w2, threads);
    // the row's (t, k): row_of maps assignment a = t*K + k to its row
    const ref::Ids row_of = ref_ids(in.at("row_of"));
    std::vector<int64_t> assignment(size_t(N), -1);
    for (size_t a = 0; a < row_of.size(); ++a)
      if (row_of[a] >= 0 && row_of[a] < N) assignment[size_t(row_of[a])] = int64_t(a);
    ref::Vec sscale(size_t(T * K), 0.f);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = tok[size_t(i)];
      if (t < 0) continue;  // a capacity filler row reaches no token
      const double w = before ? std::fabs(sc[size_t(i)]) : 1.0;
      double ss = 0;
      for (int64_t d = 0; d < D; ++d) {
        scale[size_t(t * D + d)] += float(w * m.dX[size_t(i * D + d)]);
        ss += before ? std::fabs(x[size_t(t * D + d)]) * m.dX[size_t(i * D + d)]
                     : std::fabs(g[size_t(t * D + d)]) * fwd[size_t(i * D + d)];
      }
      if (assignment[size_t(i)] >= 0) sscale[size_t(assignment[size_t(i)])] = float(ss);
    }
    out["grad_topk_scores_scale"] = from_floats(sscale, ElemType::f32, {T, K});
  } else {
    // identity experts: the rows themselves (as ref_dispatch_bwd)
    const ref::Vec gx = to_floats(in.at("grad_routed_input"));
    const ref::Ids tok = ref_ids(in.at("token_sorted"));
    const ref::Vec sc = to_floats(in.at("score_sorted"));
    for (size_t i = 0; i < tok.size(); ++i) {
      if (tok[i] < 0) continue;  // a capacity filler row
      const float w = scores_before(c) ? std::fabs(sc[i]) : 1.f;
      for (int64_t d = 0; d < D; ++d) scale[size_t(tok[i] * D + d)] += w * std::fabs(gx[i * size_t(D) + size_t(d)]);
    }
  }
  if (shared_swiglu(c)) {
    const SwigluBwdArgs a = shared_args(c, in);
    const ref::SwigluGrads m =
        ref::swiglu_backward_magnitude(a.X, a.dY, a.counts, c.hidden, c.ffn, a.W1, a.W3, a.W2, 1, a.scale());
    for (size_t e = 0; e < scale.size(); ++e) scale[e] += m.dX[e];
  } else if (has_shared(c)) {
    const ref::Vec sh = to_floats(in.at("grad_x_shared"));
    for (size_t e = 0; e < scale.size(); ++e) scale[e] += std::fabs(sh[e]);
  }
  out["grad_x_scale"] = from_floats(scale, ElemType::f32, {T, D});
}

// ---- dispatch_bwd ----------------------------------------------------------------

/// The sum of |terms| behind each element of grad_x (T, D): each row
/// gradient (times |score| where scores were multiplied at dispatch) and the
/// shared expert's gradient.
ref::Vec grad_x_terms(const Case& c, const RankBoard& in, int64_t T) {
  const ref::RowsRef g = rows_of(in.at("grad_routed_input"));
  const ref::Ids tok = ref_ids(in.at("token_sorted"));
  const ref::Vec sc = to_floats(in.at("score_sorted"));
  const size_t eb = elem_bytes(act_elem(c.dtype));
  ref::Vec scale(size_t(T * c.hidden), 0.f);
  for (size_t i = 0; i < tok.size(); ++i) {
    if (tok[i] < 0) continue;  // a capacity filler row
    const float w = scores_before(c) ? std::fabs(sc[i]) : 1.f;
    for (int64_t d = 0; d < c.hidden; ++d)
      scale[size_t(tok[i] * c.hidden + d)] += w * std::fabs(ref::decode_act(ref_act(c.dtype), g.row(int64_t(i)) + size_t(d) * eb));
  }
  if (has_shared(c)) {
    const ref::Vec sh = to_floats(in.at("grad_x_shared"));
    for (size_t e = 0; e < sh.size(); ++e) scale[e] += std::fabs(sh[e]);
  }
  return scale;
}

std::vector<std::string> dispatch_bwd_inputs(const Case& c) {
  std::vector<std::string> v = {"grad_routed_input", "row_of", "token_sorted", "score_sorted"};
  if (scores_before(c)) v.push_back("x");
  if (has_shared(c)) v.push_back("grad_x_shared");
  // the SwiGLU end-to-end error scales (swiglu_end_to_end_scales)
  if (routed_swiglu(c) || shared_swiglu(c))
    for (const char* n : {"x", "grad_out"}) v.push_back(n);
  if (routed_swiglu(c))
    for (const char* n : {"counts", "w1", "w3", "w2"}) v.push_back(n);
  if (shared_swiglu(c))
    for (const char* n : {"shared_w1", "shared_w3", "shared_w2"}) v.push_back(n);
  return v;
}

void fast_dispatch_bwd(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& row_of = ctx.input("row_of");
  const int64_t T = row_of.shape[0];
  Tensor& gx = rows_out(ctx, "grad_x", T);
  float* gs = scores_before(c) ? ctx.output("grad_topk_scores", ElemType::f32, {T, c.top_k}).as<float>() : nullptr;
  const bool shared = has_shared(c);
  dispatch_backward(ctx.exec, c.dtype, apply_of(c), score_product(c), c.dispatch_grad_accumulate(),
                    ctx.input("grad_routed_input").data(), ctx.input("score_sorted").as<float>(),
                    row_of.as<int32_t>(), scores_before(c) ? ctx.input("x").data() : nullptr,
                    shared ? SharedGrad::add_after : SharedGrad::none,
                    shared ? ctx.input("grad_x_shared").data() : nullptr, T, c.hidden, c.top_k, gx.data(), gs);
}

void ref_dispatch_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    const RankBoard& in = r.in.ranks[q];
    RankBoard& out = r.out.ranks[q];
    const int64_t T = in.at("row_of").shape[0];
    const ref::Vec shared = has_shared(c) ? to_floats(in.at("grad_x_shared")) : ref::Vec{};
    out["grad_x"] = from_floats(ref::scatter_add_grad(ref_act(c.dtype), ref_apply(c), ref_smul(c), grad_acc(c),
                                                      rows_of(in.at("grad_routed_input")),
                                                      ref_ids(in.at("token_sorted")), to_floats(in.at("score_sorted")),
                                                      shared, T, c.hidden),
                                act_elem(c.dtype), {T, c.hidden});
    if (scores_before(c)) ref_score_grad(c, in, out, "x", "grad_routed_input");
    if (routed_swiglu(c) || shared_swiglu(c)) {
      swiglu_end_to_end_scales(c, in, out, r.threads);
      continue;
    }
    // The end-to-end error scale (docs/contract.md, comparison classes) of
    // grad_x: the chain's routing scores may differ from the fast path's in
    // the last fp32 bits (a routing tolerance), and every gradient row
    // carries its score.
    out["grad_x_scale"] = from_floats(grad_x_terms(c, in, T), ElemType::f32, {T, c.hidden});
  }
}

/// grad_x of one dispatch_bwd stage (docs/contract.md §13): bitwise under
/// combine.order ascending; under `any` (atomics add a token's row gradients
/// in no fixed order) in the rounding class, with the half-width any order of
/// the same terms can reach (ref::any_order_halfwidth).
OutputSpec grad_x_spec() {
  OutputSpec o("grad_x", CompareClass::exact, Coords::token_col, nullptr, [](const Case& c, const RankBoard& b, int, int) {
    const int64_t T = b.at("row_of").shape[0];
    const ref::RowsRef g = rows_of(b.at("grad_routed_input"));
    const ref::Ids tok = ref_ids(b.at("token_sorted"));
    const ref::Vec scores = to_floats(b.at("score_sorted"));
    const ref::Vec shared = has_shared(c) ? to_floats(b.at("grad_x_shared")) : ref::Vec{};
    const ref::Vec ascending =
        ref::scatter_add_grad(ref_act(c.dtype), ref_apply(c), ref_smul(c), grad_acc(c), g, tok, scores, shared, T, c.hidden);
    const ref::AnyOrderSum sum{ref_act(c.dtype), grad_acc(c), scores_before(c), ref_smul(c)};
    return from_floats(ref::any_order_halfwidth(sum, g, tok, scores, {}, shared, ascending, T, c.hidden),
                       ElemType::f32, {T, c.hidden});
  });
  judged_in_any_order(o);
  return o;
}

}  // namespace

std::vector<EndToEndOutput> backward_end_to_end(const Case& c) {
  if (!backward_on(c).applies) return {};
  // grad_x in the end-to-end class with its error scale: the chain's routing
  // scores may differ from the fast ones in the last bits (the routing check's
  // tolerance). The score gradient of identity experts does not depend on the
  // scores: the sums of the same rows, within an fp32 summation's half-width.
  // With SwiGLU experts the chain's expert outputs and gradients differ from
  // the fast ones within the GEMM bound, and so do the score gradients made
  // from them: end_to_end class with the scale of swiglu_end_to_end_scales.
  if (routed_swiglu(c))
    return {{OutputSpec("grad_x", CompareClass::end_to_end, Coords::token_col, nullptr), "grad_x_scale"},
            {OutputSpec("grad_topk_scores", CompareClass::end_to_end, Coords::token_k, nullptr),
             "grad_topk_scores_scale"}};
  return {{OutputSpec("grad_x", CompareClass::end_to_end, Coords::token_col, nullptr), "grad_x_scale"},
          {score_grad_spec(), "grad_topk_scores_scale"}};
}

namespace {

// One descriptor per stage variant (docs/architecture.md idea 4);
// register_backward_stages lists them in slot order.

/// combine_bwd, scores multiplied after the experts: row gradients and the score gradient.
Stage combine_bwd_scores_after_stage() {
  Stage s = make("combine_bwd", "scores_after",
                 "grad rows round(G[token] * s) in dispatch order; grad_topk_scores = fp32 sum_d G * y (docs/frameworks.md §13)",
                 {"grad_out", "routed_output", "score_sorted", "token_sorted", "row_of"},
                 {{"grad_routed_output", CompareClass::exact, Coords::dispatch_row, nullptr}, score_grad_spec()},
                 fast_combine_bwd, ref_combine_bwd);
  s.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    if (scores_before(c)) return Decision{false, "score_before_experts: on (the score gradient is the dispatch's)"};
    return Decision{!on_hidden(c), "score_on_hidden: on (the score gradient is the experts')"};
  };
  return s;
}

/// combine_bwd where the combine did not multiply (the score at dispatch or
/// on the hidden): the row gradients alone.
Stage combine_bwd_scores_before_stage() {
  Stage s = make("combine_bwd", "scores_before",
                 "grad rows G[token] in dispatch order (the score multiply was at dispatch or on the experts' hidden)",
                 {"grad_out", "score_sorted", "token_sorted", "row_of"},
                 {{"grad_routed_output", CompareClass::exact, Coords::dispatch_row, moves_nonzero("grad_out")}}, fast_combine_bwd,
                 ref_combine_bwd);
  s.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{!combine_scaled(c), "the combine multiplied by the score (score_before_experts and "
                                        "score_on_hidden off)"};
  };
  return s;
}

/// shared_experts_bwd of an identity shared expert.
Stage shared_identity_bwd_stage() {
  Stage s = make("shared_experts_bwd", "shared_identity", "grad_x_shared = grad_out (shared(x) = x)", {"grad_out"},
                 {{"grad_x_shared", CompareClass::exact, Coords::token_col, moves_nonzero("grad_out")}}, fast_shared_identity_bwd,
                 ref_shared_identity_bwd);
  s.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{c.shared.kind == SharedKind::identity, "shared_experts.kind is not identity"};
  };
  return s;
}

/// shared_experts_bwd of a SwiGLU shared expert: the fused activation's
/// backward, or under experts.rounding torchtitan autograd's (`autograd`);
/// both in class rounding (autograd_halfwidth).
Stage shared_swiglu_bwd_stage(bool autograd) {
  const CompareClass cls = CompareClass::rounding;
  auto scale = [](int which) { return autograd_halfwidth(true, which); };
  Stage s = make("shared_experts_bwd", autograd ? "shared_swiglu_autograd" : "shared_swiglu",
                 autograd ? "grad_x_shared = dX of the shared SwiGLU expert at autograd's rounding points (docs/contract.md §13)"
                          : "grad_x_shared = dX of the shared SwiGLU expert over every token (ref::swiglu_experts_backward)",
                 {"x", "shared_w1", "shared_w3", "shared_w2", "grad_out"},
                 {{"grad_x_shared", cls, Coords::token_col, swiglu_grad_promise("grad_out"), scale(0)},
                  {"grad_shared_w1", cls, Coords::flat, nullptr, scale(1)},
                  {"grad_shared_w3", cls, Coords::flat, nullptr, scale(2)},
                  {"grad_shared_w2", cls, Coords::flat, nullptr, scale(3)}},
                 fast_shared_swiglu_bwd, ref_shared_swiglu_bwd);
  s.ref_per_rank = true;  // ref_shared_swiglu_bwd honours RefCtx::rank
  s.applies = [autograd](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    if (!shared_swiglu(c)) return Decision{false, "shared_experts.kind is not swiglu"};
    if (shared_autograd(c) != autograd)
      return Decision{false, autograd ? "experts.rounding: fused" : "experts.rounding: torchtitan (shared_swiglu_autograd)"};
    return Decision{};
  };
  if (autograd) s.listed = [](const Case& c) { return shared_swiglu(c) && shared_autograd(c); };
  return s;
}

/// experts_bwd of identity experts.
Stage experts_identity_bwd_stage() {
  Stage s = make("experts_bwd", "identity", "grad_expert_input = grad_expert_output (Y = X)",
                 {"grad_expert_output", "expert_counts"},
                 {{"grad_expert_input", CompareClass::exact, Coords::padded_row, moves_nonzero("grad_expert_output")}},
                 fast_experts_identity_bwd, ref_experts_identity_bwd);
  s.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{c.experts.kind == ExpertKind::identity, "experts.kind is not identity"};
  };
  return s;
}

/// experts_bwd of SwiGLU experts: dX and the weight gradients, under the
/// default conventions or, `autograd`, under experts.rounding torchtitan or
/// experts.compute_dtype bf16; both in class rounding with the half-widths
/// of their rules' rounding points (autograd_halfwidth). `hidden`: the score_on_hidden twin, which also gives
/// the score gradient (grad_topk_scores, per assignment) and is listed only
/// in such cases.
Stage experts_swiglu_bwd_stage(bool autograd, bool hidden) {
  const CompareClass cls = CompareClass::rounding;
  auto scale = [](int which) { return autograd_halfwidth(false, which); };
  const std::string variant = std::string(autograd ? "swiglu_autograd" : "swiglu") + (hidden ? "_hidden" : "");
  std::string summary =
      autograd ? "autograd's rounding points: dH, dh1, dh3, dX, dW rounded to the compute dtype (docs/contract.md §13)"
               : "dX = round(dh1 W1 + dh3 W3), dW1 = dh1^T X, dW3 = dh3^T X, dW2 = dY^T H in fp32 (reference/reference.h)";
  if (hidden) summary += "; the score on the hidden: dH = round(dH' s), dW2 from H', grad_topk_scores = fp32 sum_f dH' H";
  std::vector<OutputSpec> outs = {
      {"grad_expert_input", cls, Coords::padded_row, swiglu_grad_promise("grad_expert_output"), scale(0)},
      {"grad_w1", cls, Coords::flat, nullptr, scale(1)},
      {"grad_w3", cls, Coords::flat, nullptr, scale(2)},
      {"grad_w2", cls, Coords::flat, nullptr, scale(3)}};
  std::vector<std::string> ins = {"expert_input", "expert_counts", "w1", "w3", "w2", "grad_expert_output"};
  if (hidden) {
    outs.push_back({"grad_topk_scores", CompareClass::rounding, Coords::token_k, nullptr, hidden_score_halfwidth});
    ins.insert(ins.end(), {"score_sorted", "token_sorted", "ids"});
  }
  Stage s = make("experts_bwd", variant, summary, ins, outs, fast_experts_swiglu_bwd, ref_experts_swiglu_bwd);
  s.ref_per_rank = true;  // ref_experts_swiglu_bwd honours RefCtx::rank
  s.applies = [autograd, hidden](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    if (!routed_swiglu(c)) return Decision{false, "experts.kind is not swiglu"};
    if (routed_autograd(c) != autograd)
      return Decision{false, autograd ? "experts.rounding fused, experts.compute_dtype act"
                                      : "experts.rounding or experts.compute_dtype not the default (swiglu_autograd)"};
    if (on_hidden(c) != hidden) return Decision{false, hidden ? "score_on_hidden: off" : "score_on_hidden: on"};
    return Decision{};
  };
  // the default variant is listed in every case; the others where their mode is used
  if (autograd && !hidden) s.listed = [](const Case& c) { return routed_swiglu(c) && routed_autograd(c); };
  if (hidden)
    s.listed = [autograd](const Case& c) {
      return routed_swiglu(c) && on_hidden(c) && routed_autograd(c) == autograd;
    };
  return s;
}

/// dispatch_bwd: the ordered scatter of the row gradients into grad_x, and
/// its variant with the score gradient when scores were multiplied at dispatch.
void add_dispatch_bwd(std::vector<Stage>& reg) {
  Stage s = make("dispatch_bwd", "ordered_scatter",
                 "grad_x = ordered scatter-add of the K row gradients per token, ascending expert, no atomics; + shared",
                 {}, {grad_x_spec()}, fast_dispatch_bwd, ref_dispatch_bwd);
  s.inputs = dispatch_bwd_inputs;
  s.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{!scores_before(c), "score_before_experts: on"};
  };
  reg.push_back(s);
  Stage b = s;
  b.variant = "ordered_scatter_scores";
  b.summary = "score_before_experts: grad_x from round(g * s) rows, ordered; grad_topk_scores = fp32 sum_d g * x";
  b.outputs.push_back(score_grad_spec());
  b.applies = [](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{scores_before(c), "score_before_experts: off"};
  };
  reg.push_back(b);
}

/// ep_unpermute_bwd and ep_permute_bwd of permute mode m (generic or equal_count).
void add_permute_bwd(std::vector<Stage>& reg, PermuteMode m) {
  const bool eq = m == PermuteMode::equal_count;
  const auto primary = [m](const Case& c) {
    return c.permute == m || (c.permute == PermuteMode::auto_ && m == PermuteMode::equal_count);
  };
  const auto applies = [eq](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies || !eq) return d;
    return Decision{c.permute != PermuteMode::generic, "permute: generic"};
  };
  Stage u = make("ep_unpermute_bwd", eq ? "equal_count" : "generic",
                 eq ? "transpose (R, E_l, c) -> (E_l, R, c) of the gradient" : "the permute's table on the gradient",
                 {"grad_recv_out", "recv_counts"}, {{"grad_unpadded", CompareClass::exact, Coords::expert_row, nullptr}},
                 [m](FastCtx& ctx) { fast_permute_rows(ctx, m, 0, "grad_recv_out", "grad_unpadded"); },
                 ref_unpermute_bwd);
  u.primary = primary;
  u.asked = [m](const Case& c) { return c.permute == m; };
  u.applies = applies;
  reg.push_back(u);
  Stage p = make("ep_permute_bwd", eq ? "equal_count" : "generic",
                 eq ? "inverse transpose (E_l, R, c) -> (R, E_l, c) of the gradient"
                    : "the inverse table on the gradient (inverse scatter, no duplicates)",
                 {"grad_permuted", "recv_counts"}, {{"grad_recv", CompareClass::exact, Coords::rank_major_row, nullptr}},
                 [m](FastCtx& ctx) { fast_permute_rows(ctx, m, 1, "grad_permuted", "grad_recv"); }, ref_permute_bwd);
  p.primary = primary;
  p.asked = u.asked;
  p.applies = applies;
  reg.push_back(p);
}

/// ep_combine_bwd: the gradient all-to-all of the combine, splits swapped.
Stage ep_combine_bwd_stage() {
  return make("ep_combine_bwd", "a2a_swapped",
              "gradient all-to-all-v: send input_splits, receive output_splits (the combine's swapped, docs/frameworks.md §13)",
              {"grad_routed_output", "input_splits", "output_splits", "counts"},
              {{"grad_recv_out", CompareClass::exact, Coords::rank_major_row, nullptr}}, fast_ep_combine_bwd,
              ref_ep_combine_bwd);
}

/// align_unpad_bwd: the gradient padded like the forward.
Stage align_unpad_bwd_stage() {
  return make("align_unpad_bwd", "zero_fill", "the gradient padded like the forward: padding rows zero (docs/frameworks.md §13)",
              {"grad_unpadded", "expert_counts", "expert_counts_real"},
              {{"grad_expert_output", CompareClass::exact, Coords::padded_row, moves_nonzero("grad_unpadded")}},
              fast_unpad_bwd, ref_unpad_bwd);
}

/// align_pad_bwd: padding-row gradients dropped.
Stage align_pad_bwd_stage() {
  return make("align_pad_bwd", "drop_padding", "each group's real rows; padding-row gradients dropped (docs/frameworks.md §13)",
              {"grad_expert_input", "expert_counts", "expert_counts_real"},
              {{"grad_permuted", CompareClass::exact, Coords::expert_row, moves_nonzero("grad_expert_input")}},
              fast_pad_bwd, ref_pad_bwd);
}

/// ep_dispatch_bwd: the gradient all-to-all of the dispatch, splits swapped.
Stage ep_dispatch_bwd_stage() {
  return make("ep_dispatch_bwd", "a2a_swapped",
              "gradient all-to-all-v: send output_splits, receive input_splits (the dispatch's swapped, docs/frameworks.md §13)",
              {"grad_recv", "input_splits", "output_splits", "recv_counts"},
              {{"grad_routed_input", CompareClass::exact, Coords::dispatch_row, nullptr}}, fast_ep_dispatch_bwd,
              ref_ep_dispatch_bwd);
}


// ---- router_bwd (docs/contract.md §13, router) ------------------------------------------

/// The reference router backward of one rank's board, with half-widths.
/// `own_scores` false (`check` of an implementation that wrote no scores):
/// the board's scores are the reference's, and the half-widths carry the
/// scores tolerance's relative part (its own scores may differ within it).
ref::RouterGrad ref_router_grad(const Case& c, const RankBoard& b, bool want_half, bool own_scores = true) {
  const Tensor& x = b.at("x");
  const double srtol = own_scores ? 0.0 : tolerance_for(c, CompareClass::scores).rtol;
  return ref::router_backward(ref_router_spec(c),
                              c.router.gate_dtype == GateDtype::act ? ref::GateDtype::act : ref::GateDtype::fp32,
                              ref_act(c.dtype), to_floats(b.at("scores")), ref_ids(b.at("ids")),
                              to_floats(b.at("grad_topk_scores")), to_floats(x), to_floats(b.at("wg")), x.shape[0],
                              c.hidden, srtol, want_half);
}

/// One half-width of the reference router backward (member `half`),
/// computed once for the four outputs `check` judges one after another
/// (each asks for its own: four reference runs were most of `check`'s time
/// on a large router). The last board's half-widths wait for their outputs,
/// each handed over (moved out) once, so that no more memory stays than
/// the halves not yet asked for; keyed by the case, own_scores and an FNV-1a
/// of the five inputs' bytes, so that a board at the same address with
/// other values is never served a stale result.
ref::Vec router_half_once(const Case& c, const RankBoard& b, bool own_scores, ref::Vec ref::RouterGrad::*half) {
  uint64_t key = config_hash(c) ^ (own_scores ? 0x9e3779b97f4a7c15ull : 0);
  for (const char* name : {"scores", "ids", "grad_topk_scores", "x", "wg"}) {
    const Tensor& t = b.at(name);
    const auto* p = static_cast<const unsigned char*>(t.data());
    for (size_t i = 0; i < t.bytes(); ++i) key = (key ^ p[i]) * 0x100000001b3ull;
    key = (key ^ t.bytes()) * 0x100000001b3ull;
  }
  static std::mutex m;
  static uint64_t kept_key = 0;
  static ref::RouterGrad kept;  // its half-widths only
  std::unique_lock<std::mutex> lk(m);
  if (kept_key != key || (kept.*half).empty()) {
    lk.unlock();
    ref::RouterGrad g = ref_router_grad(c, b, true, own_scores);
    g.grad_scores = g.grad_logits = g.grad_wg = g.grad_x = {};
    lk.lock();
    kept = std::move(g);
    kept_key = key;
  }
  ref::Vec out = std::move(kept.*half);
  kept.*half = {};
  return out;
}

/// Whether the router's gradients are promised nonzero (OutputSpec::promised):
/// some token's top-K score gradient moves its scores. Under route_norm the
/// normalised scores sum to route_scale whatever the scores, so a token
/// whose K gradients are all equal (K = 1, or identity experts: every row
/// of the token is x) gives its scores no gradient. A softmax's logits
/// (`logits_side`) have none where the score gradient is the same at every
/// expert: with K = E and equal gradients too. Nor do the logits of a
/// saturated score: s (1 - s) = 0 for sigmoid, and a softmax whose chosen
/// scores are each 0 or 1 (held fp16 scores of exact data get there).
bool router_grad_promised(const Case& c, const RankBoard& b, bool logits_side) {
  auto it = b.find("grad_topk_scores");
  if (it == b.end()) return false;
  const bool need_differ = c.router.route_norm == Switch::on ||
                           (logits_side && c.router.score == k::ScoreFunc::softmax && c.top_k == c.num_experts);
  const std::vector<float> g = to_floats(it->second), s = to_floats(b.at("scores"));
  const ref::Ids ids = ref_ids(b.at("ids"));
  const size_t K = size_t(c.top_k), E = size_t(c.num_experts);
  for (size_t t = 0; (t + 1) * K <= g.size(); ++t) {
    bool moves = false, open = !logits_side;
    for (size_t k = 0; k < K; ++k) {
      const float gk = g[t * K + k];
      moves = moves || (gk != 0 && (!need_differ || gk != g[t * K]));
      const int32_t e = ids[t * K + k];
      if (e >= 0 && size_t(e) < E && (t + 1) * E <= s.size()) {
        const float se = s[t * E + size_t(e)];
        open = open || (se > 0 && se < 1);
      }
    }
    if (moves && open) return true;
  }
  return false;
}

/// Whether a gate GEMM's other operand (`times`: x or wg, which exact data
/// may make all zero) can carry the logits' gradient. A softmax's logit
/// gradients sum to 0 over the experts, so grad_logits wg is 0 wherever
/// every row of wg is the same (likely with a few small integers).
bool gate_operand_moves(const Case& c, const RankBoard& b, const std::string& times) {
  const Tensor& t = b.at(times);
  if (times != "wg" || c.router.score != k::ScoreFunc::softmax) return any_nonzero(t);
  const std::vector<float> w = to_floats(t);
  const size_t D = size_t(c.hidden);
  for (size_t i = D; i < w.size(); ++i)
    if (w[i] != w[i % D]) return true;
  return false;
}

/// An output of router_bwd in class rounding: its half-width (member `half`
/// of the reference's result) is shaped like the input `like`; a gate GEMM's
/// output is promised where its other operand `times` can carry data.
OutputSpec router_grad_spec(const char* name, Coords coords, ref::Vec ref::RouterGrad::*half, const char* like,
                            const char* times = nullptr) {
  const bool logits_side = std::string(name) != "grad_scores";
  auto halfwidth = [half, like](const Case& c, const RankBoard& b, int, int, bool own_scores) {
    return from_floats(router_half_once(c, b, own_scores, half), ElemType::f32, b.at(like).shape);
  };
  OutputSpec o(name, CompareClass::rounding, coords,
               [logits_side, times](const Case& c, const RankBoard& b) {
                 return router_grad_promised(c, b, logits_side) && (!times || gate_operand_moves(c, b, times));
               },
               [halfwidth](const Case& c, const RankBoard& b, int r, int R) { return halfwidth(c, b, r, R, true); });
  o.own_input = "scores";
  o.magnitude_own = halfwidth;
  return o;
}

void fast_router_bwd(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& x = ctx.input("x");
  const int64_t T = x.shape[0], E = c.num_experts;
  RouterGradArgs a;
  a.scores = ctx.input("scores").as<float>();
  a.ids = ctx.input("ids").as<int32_t>();
  a.grad_topk = ctx.input("grad_topk_scores").as<float>();
  a.x = x.data();
  a.wg = ctx.input("wg").data();
  a.T = T;
  a.D = c.hidden;
  a.E = c.num_experts;
  a.K = c.top_k;
  a.route_scale = c.router.route_scale;
  a.score = c.router.score;
  a.norm = c.router.route_norm == Switch::on ? k::RouteNorm::on : k::RouteNorm::off;
  a.act_gate = c.router.gate_dtype == GateDtype::act;
  a.held = score_held(c);
  a.grad_scores = ctx.output("grad_scores", ElemType::f32, {T, E}).as<float>();
  a.grad_logits = ctx.output("grad_logits", ElemType::f32, {T, E}).as<float>();
  a.grad_wg = ctx.output("grad_wg", act_elem(c.dtype), {E, c.hidden}).data();
  a.grad_x = ctx.output("grad_x_router", act_elem(c.dtype), {T, c.hidden}).data();
  router_backward(ctx.exec, c.dtype, a);
}

void ref_router_bwd(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    const RankBoard& in = r.in.ranks[q];
    const Tensor& x = in.at("x");
    ref::RouterGrad g = ref_router_grad(c, in, r.wants_scales());
    const std::vector<int64_t> te{x.shape[0], c.num_experts}, ed{c.num_experts, c.hidden};
    RankBoard& out = r.out.ranks[q];
    out["grad_scores"] = from_floats(g.grad_scores, ElemType::f32, te);
    out["grad_logits"] = from_floats(g.grad_logits, ElemType::f32, te);
    out["grad_wg"] = from_floats(g.grad_wg, x.type, ed);
    out["grad_x_router"] = from_floats(g.grad_x, x.type, x.shape);
    if (!r.wants_scales()) continue;
    RankBoard& sc = r.scales->ranks[q];
    sc["grad_scores"] = from_floats(g.half_scores, ElemType::f32, te);
    sc["grad_logits"] = from_floats(g.half_logits, ElemType::f32, te);
    sc["grad_wg"] = from_floats(g.half_wg, ElemType::f32, ed);
    sc["grad_x_router"] = from_floats(g.half_x, ElemType::f32, x.shape);
  }
}

/// router_bwd: the gradient of the top-K scores back to the gate: the
/// scores, the logits, the gate weight and the router's share of x's
/// gradient (not added into grad_x, which is the token path's). `held`:
/// the variant of scores held in act (router.score_dtype act), whose
/// gradients are act values (docs/contract.md §13).
Stage router_bwd_stage(bool held) {
  Stage s = make("router_bwd", held ? "held_scores" : "fp32_scores",
                 held ? "grad_topk_scores -> route_scale, route_norm, gather, softmax/sigmoid with the score gradients "
                        "rounded to act (autograd of held scores) -> grad_logits; grad_wg, grad_x_router as fp32_scores "
                        "(docs/contract.md §13)"
                      : "grad_topk_scores -> route_scale, route_norm (den's gradient included), gather, softmax/sigmoid "
                        "-> grad_logits; grad_wg = grad_logits^T x, grad_x_router = round(grad_logits wg) "
                        "(docs/contract.md §13)",
                 {"grad_topk_scores", "scores", "ids", "x", "wg"},
                 {router_grad_spec("grad_scores", Coords::token_expert, &ref::RouterGrad::half_scores, "scores"),
                  router_grad_spec("grad_logits", Coords::token_expert, &ref::RouterGrad::half_logits, "scores"),
                  router_grad_spec("grad_wg", Coords::expert_col, &ref::RouterGrad::half_wg, "wg", "x"),
                  router_grad_spec("grad_x_router", Coords::token_col, &ref::RouterGrad::half_x, "x", "wg")},
                 fast_router_bwd, ref_router_bwd);
  s.applies = [held](const Case& c) {
    const Decision d = backward_on(c);
    if (!d.applies) return d;
    return Decision{(c.router.score_dtype == GateDtype::act) == held,
                    held ? "router.score_dtype: fp32 (held_scores is the variant of act scores)"
                         : "router.score_dtype: act (fp32_scores is the variant of fp32 scores)"};
  };
  s.ref_per_rank = true;
  return s;
}

}  // namespace

void register_backward_stages(std::vector<Stage>& reg) {
  const size_t first = reg.size();
  reg.push_back(combine_bwd_scores_after_stage());
  reg.push_back(combine_bwd_scores_before_stage());
  reg.push_back(shared_identity_bwd_stage());
  reg.push_back(shared_swiglu_bwd_stage(false));
  reg.push_back(shared_swiglu_bwd_stage(true));
  reg.push_back(ep_combine_bwd_stage());
  for (PermuteMode m : {PermuteMode::generic, PermuteMode::equal_count}) add_permute_bwd(reg, m);
  reg.push_back(align_unpad_bwd_stage());
  reg.push_back(experts_identity_bwd_stage());
  for (bool hidden : {false, true}) {
    reg.push_back(experts_swiglu_bwd_stage(false, hidden));
    reg.push_back(experts_swiglu_bwd_stage(true, hidden));
  }
  reg.push_back(align_pad_bwd_stage());
  reg.push_back(ep_dispatch_bwd_stage());
  add_dispatch_bwd(reg);
  for (bool held : {false, true}) reg.push_back(router_bwd_stage(held));
  // Device forms (issue 12): every variant runs its bodies through entry
  // points that take the mirror (row maps, the combine body, copy_bytes,
  // CombineGradRowsBody, ScoreGradBody, the SwiGLU backward's GEMMs and
  // SwigluBwdBody) or is the forward's all-to-all (FastCtx::exchange_rows).
  for (size_t i = first; i < reg.size(); ++i) reg[i].backends = kHostAndDevice;
}

}  // namespace moev
