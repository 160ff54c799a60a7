// Host executor of the backward token path (kernels/backward_host.h).
#include "backward_host.h"

#include <algorithm>
#include <vector>

#include "device.h"

namespace moev {
namespace {

/// Rows of the dispatch-ordered gradient that row_of names (its largest
/// entry + 1): what a device copy of it must hold.
int64_t grad_rows_count(const int32_t* row_of, int64_t n) {
  int64_t rows = 0;
  for (int64_t a = 0; a < n; ++a) rows = std::max<int64_t>(rows, int64_t(row_of[a]) + 1);
  return rows;
}

k::ProductRounding product_rounding(const ExecCtx& ctx) {
  return ctx.faults.has(Fault::bwd_score_grad_rounded) ? k::ProductRounding::act : k::ProductRounding::fp32;
}

k::DroppedGrad dropped_grad(const ExecCtx& ctx) {
  return ctx.faults.has(Fault::bwd_dropped_grad) ? k::DroppedGrad::clamped_row0 : k::DroppedGrad::zero;
}

template <class V>
void score_grad(const ExecCtx& ctx, const void* token_rows, const void* dispatch_rows, const int32_t* row_of, int64_t T,
                int64_t N, int64_t D, int K, k::ScoreMultiply smul, float* grad) {
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    if (T * K == 0) return;
    const size_t gb = size_t(T * K) * 4;
    m.device().run(k::ScoreGradBody<V>{static_cast<const V*>(m.in(token_rows, size_t(T * D) * sizeof(V))),
                                       static_cast<const V*>(m.in(dispatch_rows, size_t(N * D) * sizeof(V))),
                                       static_cast<const int32_t*>(m.in(row_of, size_t(T * K) * 4)),
                                       static_cast<float*>(m.out(grad, gb)), D, K, smul, product_rounding(ctx),
                                       dropped_grad(ctx)},
                   T * K);
    m.wrote(grad, gb);
    return;
  }
  const k::ScoreGradBody<V> body{static_cast<const V*>(token_rows), static_cast<const V*>(dispatch_rows), row_of, grad,
                                 D, K, smul, product_rounding(ctx), dropped_grad(ctx)};
  host_run(ctx, T * K, body);
}

}  // namespace

void combine_backward(const ExecCtx& ctx, DType dt, k::ScoreApply apply, k::ScoreMultiply smul, const void* grad_out,
                      const void* routed_out, const float* score_sorted, const int32_t* token_sorted,
                      const int32_t* row_of, int64_t T, int64_t N, int64_t D, int K, void* grad_rows,
                      float* grad_topk_scores) {
  dispatch_dtype(dt, [&](auto tag) {
    using V = decltype(tag);
    if (ctx.mirror) {
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      const size_t rb = size_t(N * D) * sizeof(V);
      if (N > 0) {
        m.device().run(k::CombineGradRowsBody<V>{static_cast<const V*>(m.in(grad_out, size_t(T * D) * sizeof(V))),
                                                 static_cast<const int32_t*>(m.in(token_sorted, size_t(N) * 4)),
                                                 static_cast<const float*>(m.in(score_sorted, size_t(N) * 4)),
                                                 static_cast<V*>(m.out(grad_rows, rb)), D, apply, smul},
                       N);
        m.wrote(grad_rows, rb);
      }
    } else {
      const k::CombineGradRowsBody<V> rows{static_cast<const V*>(grad_out), token_sorted, score_sorted,
                                           static_cast<V*>(grad_rows), D, apply, smul};
      host_run(ctx, N, rows);
    }
    if (apply == k::ScoreApply::after_experts)
      score_grad<V>(ctx, grad_out, routed_out, row_of, T, N, D, K, smul, grad_topk_scores);
  });
}

void dispatch_backward(const ExecCtx& ctx, DType dt, k::ScoreApply apply, k::ScoreMultiply smul, k::Accumulate acc,
                       const void* grad_rows, const float* score_sorted, const int32_t* row_of, const void* x,
                       SharedGrad shared, const void* grad_shared, int64_t T, int64_t D, int K, void* grad_x,
                       float* grad_topk_scores) {
  // The combine body adds the score multiply where the forward's dispatch
  // had it (before_experts), and none where the combine had it.
  CombineArgs a;
  a.dt = dt;
  a.routed_out = grad_rows;
  a.score_sorted = score_sorted;
  a.row_of = row_of;
  a.rows = grad_rows_count(row_of, T * K);
  a.shared = grad_shared;
  a.T = T;
  a.D = D;
  a.K = K;
  a.apply = apply == k::ScoreApply::before_experts ? k::ScoreApply::after_experts : k::ScoreApply::before_experts;
  a.acc = acc;
  a.shared_add = shared == SharedGrad::add_after ? k::SharedAdd::add_after : k::SharedAdd::none;
  a.smul = smul;
  // The scatter's order comes from this path's own fault, not the forward
  // combine's (unordered_combine), so each fault names one stage.
  ExecCtx sc = ctx;
  sc.faults.bits &= ~uint64_t(Fault::unordered_combine);
  if (ctx.faults.has(Fault::bwd_unordered_scatter)) sc.faults.bits |= uint64_t(Fault::unordered_combine);
  combine_from_zeros(sc, a, grad_x);
  if (apply == k::ScoreApply::before_experts)
    dispatch_dtype(dt, [&](auto tag) {
      score_grad<decltype(tag)>(ctx, x, grad_rows, row_of, T, a.rows, D, K, smul, grad_topk_scores);
    });
}

void router_backward(const ExecCtx& ctx, DType dt, const RouterGradArgs& a) {
  const k::RouterGradFault fault = ctx.faults.has(Fault::router_bwd_norm_detached)     ? k::RouterGradFault::norm_detached
                                   : ctx.faults.has(Fault::router_bwd_softmax_diagonal) ? k::RouterGradFault::softmax_diagonal
                                                                                        : k::RouterGradFault::none;
  dispatch_dtype(dt, [&](auto tag) {
    using V = decltype(tag);
    const size_t te = size_t(a.T) * size_t(a.E) * 4, tk = size_t(a.T) * size_t(a.K) * 4;
    const size_t xb = size_t(a.T * a.D) * sizeof(V), wb = size_t(int64_t(a.E) * a.D) * sizeof(V),
                 accb = size_t(int64_t(a.E) * a.D) * 4;
    // GateGradBody's fp32 sums: scratch, on a device never read back (no wrote())
    std::vector<float> acc(size_t(int64_t(a.E) * a.D));
    k::RouterGradBody scores_body{a.scores, a.ids, a.grad_topk, a.grad_scores, a.grad_logits, a.E, a.K,
                                  a.route_scale, a.score, a.norm, fault};
    scores_body.held = a.held;
    // under held scores the act gate's logits are an act tensor: their gradient is one too
    scores_body.hold_logits = a.held != k::ScoreHeld::fp32 && a.act_gate;
    if (ctx.mirror) {
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      float* gl = nullptr;
      if (a.T > 0) {
        gl = static_cast<float*>(m.out(a.grad_logits, te));
        k::RouterGradBody b = scores_body;
        b.scores = static_cast<const float*>(m.in(a.scores, te));
        b.ids = static_cast<const int32_t*>(m.in(a.ids, tk));
        b.grad_topk = static_cast<const float*>(m.in(a.grad_topk, tk));
        b.grad_scores = static_cast<float*>(m.out(a.grad_scores, te));
        b.grad_logits = gl;
        m.device().run(b, a.T);
        m.wrote(a.grad_scores, te);
        m.wrote(a.grad_logits, te);
        m.device().run(k::GateInputGradBody<V>{gl, static_cast<const V*>(m.in(a.wg, wb)),
                                               static_cast<V*>(m.out(a.grad_x, xb)), a.D, a.E, a.act_gate},
                       a.T);
        m.wrote(a.grad_x, xb);
      }
      m.device().run(k::GateGradBody<V>{gl, a.T > 0 ? static_cast<const V*>(m.in(a.x, xb)) : nullptr,
                                        static_cast<float*>(m.out(acc.data(), accb)),
                                        static_cast<V*>(m.out(a.grad_wg, wb)), a.T, a.D, a.E, a.act_gate},
                     a.E);
      m.wrote(a.grad_wg, wb);
      return;
    }
    host_run(ctx, a.T, scores_body);
    host_run(ctx, a.E,
             k::GateGradBody<V>{a.grad_logits, static_cast<const V*>(a.x), acc.data(), static_cast<V*>(a.grad_wg), a.T,
                                a.D, a.E, a.act_gate});
    host_run(ctx, a.T,
             k::GateInputGradBody<V>{a.grad_logits, static_cast<const V*>(a.wg), static_cast<V*>(a.grad_x), a.D, a.E,
                                     a.act_gate});
  });
}

}  // namespace moev
