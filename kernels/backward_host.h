// The backward token path on the host executor (docs/contract.md §13, docs/frameworks.md §13):
// the entry points src/paths/stages_backward.cpp calls. Layouts are the forward's:
// dispatch rows (N, D) expert-major, token rows (T, D), assignments (T, K) with
// row_of[t*K + k] the dispatch row of assignment (t, k), all saved from the
// forward (docs/frameworks.md §13 last line: never recomputed). Callers own every buffer.
#pragma once

#include <cstdint>

#include "backward_bodies.h"
#include "host_exec.h"
#include "moe_host.h"

namespace moev {

/// Combine backward: grad_rows (N, D) per k::CombineGradRowsBody; under
/// after_experts also grad_topk_scores (T, K) fp32 per k::ScoreGradBody from
/// grad_out and routed_out. Under before_experts routed_out and
/// grad_topk_scores are not touched (the score gradient is the dispatch's).
void combine_backward(const ExecCtx& ctx, DType dt, k::ScoreApply apply, k::ScoreMultiply smul, const void* grad_out,
                      const void* routed_out, const float* score_sorted, const int32_t* token_sorted,
                      const int32_t* row_of, int64_t T, int64_t N, int64_t D, int K, void* grad_rows,
                      float* grad_topk_scores);

/// Whether the dispatch backward adds a shared expert's input gradient.
enum class SharedGrad : uint8_t { none, add_after };

/// Dispatch backward (docs/contract.md §13: the gather's adjoint is the ordered
/// scatter-add): grad_x[t] = the token's K dispatch-row gradients added in
/// ascending row (= ascending expert) order per the accumulate mode, from
/// zeros, then + grad_shared[t] (one rounding) under SharedGrad::add_after.
/// It is the combine body (k::CombineBody) on the gradient rows: under
/// before_experts each row is first multiplied by its score (round(g * s)),
/// and grad_topk_scores (T, K) = k::ScoreGradBody of x and the gradient rows;
/// under after_experts grad_topk_scores is not touched. No atomics: each
/// token owns its row, so the result does not depend on the thread count.
void dispatch_backward(const ExecCtx& ctx, DType dt, k::ScoreApply apply, k::ScoreMultiply smul, k::Accumulate acc,
                       const void* grad_rows, const float* score_sorted, const int32_t* row_of, const void* x,
                       SharedGrad shared, const void* grad_shared, int64_t T, int64_t D, int K, void* grad_x,
                       float* grad_topk_scores);

/// Router backward (docs/contract.md §13, router): the buffers of one rank.
/// scores, grad_scores, grad_logits (T, E) fp32; ids, grad_topk (T, K);
/// x, grad_x (T, D), wg and grad_wg (E, D) in the activation dtype.
struct RouterGradArgs {
  const float* scores = nullptr;
  const int32_t* ids = nullptr;
  const float* grad_topk = nullptr;
  const void* x = nullptr;
  const void* wg = nullptr;
  int64_t T = 0, D = 0;
  int E = 0, K = 0;
  float route_scale = 1.f;
  k::ScoreFunc score = k::ScoreFunc::softmax;
  k::RouteNorm norm = k::RouteNorm::off;
  bool act_gate = false;  // router.gate_dtype act: grad_logits rounded to act before the gate's GEMMs
  k::ScoreHeld held = k::ScoreHeld::fp32;  // router.score_dtype act: the score steps' gradients held in act
  float* grad_scores = nullptr;
  float* grad_logits = nullptr;
  void* grad_wg = nullptr;
  void* grad_x = nullptr;
};

/// grad_scores and grad_logits per k::RouterGradBody (one token per item),
/// then grad_wg per k::GateGradBody (one expert per item) and grad_x per
/// k::GateInputGradBody (one token per item). Every element is summed in
/// one fixed order, so the host and a device give the same bits.
void router_backward(const ExecCtx& ctx, DType dt, const RouterGradArgs& a);

}  // namespace moev
