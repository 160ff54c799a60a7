// Reference of the backward token path (docs/contract.md §13, docs/frameworks.md §13). Like
// the rest of reference/, Eigen and the standard library only; written from
// the contract, in the global view. The backward of a pure data movement is
// the inverse data movement (the adjoint of a permutation is its inverse,
// of a zero-padding the slice, of a slice the zero-padding): those stages use
// the forward references of the inverse operation (permute_to_expert_major,
// pad_groups, ...); only the steps that compute, and the all-to-all in the
// forward direction on gradient rows, are written here.
#pragma once

#include "reference.h"

namespace ref {

/// Combine backward rows (docs/contract.md §13): dispatch row i of the gradient of
/// routed_output is round_act(float(G[token_sorted[i]]) * s_i) under
/// after_experts (s_i the fp32 score, or round_act(s_i) under
/// ScoreMultiply::act), G[token_sorted[i]] itself under before_experts; a
/// pad_to_capacity filler row (token -1) gets a zero row.
/// G is (T, D) in act; returns (N, D) act bytes.
Bytes combine_grad_rows(Act act, ScoreApply apply, ScoreMultiply smul, RowsRef grad_out, const Ids& token_sorted,
                        const Vec& score_sorted);

/// Score gradient (docs/frameworks.md §13): 0 for an assignment capacity dropped
/// (row_of -1); otherwise, with dispatch row i = row_of[t*K + k], sum_d token_rows[t, d] * dispatch_rows[i, d] in fp64,
/// rounded to fp32, then to act under ScoreMultiply::act. (T, K). Writes in
/// `halfwidth` how far a correct fp32 summation (any order) may land: any
/// rounding of a value within (D + 2) 2^-24 sum_d |terms| of the exact sum.
Vec score_grad(Act act, ScoreMultiply smul, RowsRef token_rows, RowsRef dispatch_rows, const Ids& row_of, int64_t T,
               int64_t D, int K, Vec& halfwidth);

/// Dispatch backward (docs/contract.md §13: the gather's adjoint is the ordered
/// scatter-add, §2's combine order): grad_x[t] starts at 0; for every
/// dispatch row i in ascending order with token_sorted[i] = t, the row's
/// contribution c_i (the gradient row, or round_act(g_i * s_i) under
/// before_experts) is added: per_add rounds after each addition,
/// fp32_accumulate sums in fp32 and rounds once. Then grad_shared[t] is added
/// with one rounding when it is not empty. Filler rows (token -1) add nothing.
/// (T, D) values.
Vec scatter_add_grad(Act act, ScoreApply apply, ScoreMultiply smul, Accumulate acc, RowsRef grad_rows,
                     const Ids& token_sorted, const Vec& score_sorted, const Vec& grad_shared, int64_t T, int64_t D);

/// Router backward (docs/contract.md §13, router): from the gradient of the
/// top-K scores g (T, K) fp32, back through route_scale, route_norm, the
/// gather at ids, the score function and the gate GEMM. Scores are fp32
/// (router.score_dtype fp32; spec.held must be fp32). Values in fp64:
///   gp_k = g_k * route_scale; under route_norm, with the K selected scores
///   s_k and den = sum_k s_k + 1e-20: gs_k = gp_k / den - (sum_j gp_j s_j) / den^2,
///   else gs_k = gp_k; grad_scores[t, ids_k] = gs_k, 0 at the other experts;
///   grad_logits = gs * s * (1 - s) (sigmoid) or s * (gs - sum_e gs_e s_e) (softmax);
///   a = grad_logits, rounded to act under GateDtype::act (the cast's backward);
///   grad_wg (E, D) = round_act(a^T x) and grad_x (T, D) = round_act(a wg):
///   the gradients of the act tensors wg and x, each one rounding of an fp32
///   accumulation.
/// With want_half, the class-rounding half-widths of each (the same shapes):
/// any fp32 evaluation order, plus what scores known only within
/// score_rtol |s| + 2^-126 may move (score_rtol > 0: `check` of an
/// implementation that runs its router backward on scores of its own it did
/// not write, which may differ from these within the scores tolerance's
/// relative part; 0 where the scores are its own), carried to first order
/// with a factor 2 to spare, and through the GEMMs' fp32 accumulation bound
/// (n + 2) 2^-24 sum |terms|. A token whose selected scores sum to less than
/// twice their uncertainty (route_norm) gets an infinite half-width: its
/// normalisation is not known.
struct RouterGrad {
  Vec grad_scores, grad_logits;  // (T, E) fp32
  Vec grad_wg;                   // (E, D) act values
  Vec grad_x;                    // (T, D) act values
  Vec half_scores, half_logits, half_wg, half_x;
};
RouterGrad router_backward(const RouterSpec& spec, GateDtype gate, Act act, const Vec& scores, const Ids& ids,
                           const Vec& grad_topk, const Vec& x, const Vec& wg, int64_t T, int64_t D, double score_rtol,
                           bool want_half);

/// The forward all-to-all on any rows in the dispatch layout (docs/contract.md §3):
/// rank p holds rows expert-major over all E experts, counts[p][e] of expert
/// e; rank q receives, for each source p ascending and local expert j
/// ascending, p's rows of expert q*E_l + j in p's order (rank-major). The
/// combine's all-to-all backward (docs/frameworks.md §13: roles swapped).
std::vector<Bytes> ep_send_rows(const std::vector<RowsRef>& rows, const std::vector<Counts>& counts, int R, int E_l);

}  // namespace ref
