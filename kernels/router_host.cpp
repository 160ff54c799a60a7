// The router on the host executor (docs/contract.md §1; the `router_logits`
// and `routing` slots, src/paths/stages_local.cpp): the gate GEMM, then
// scores, selection and the per-expert counts through k::RouterBody.
#include "moe_host_detail.h"

namespace moev {
using namespace host_detail;

void router_logits(const ExecCtx& ctx, DType dt, const void* x, const void* wg, int64_t T,
                   int64_t D, int E, float* logits, GateDtype gate) {
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    const size_t eb = dtype_bytes(dt), n = size_t(T) * size_t(E);
    float* dl = static_cast<float*>(m.out(logits, n * 4));
    if (n == 0) return;
    m.device().gemm_logits(dt, m.in(x, size_t(T * D) * eb), m.in(wg, size_t(E) * size_t(D) * eb), T, D, E, dl);
    if (gate == GateDtype::act)
      dispatch_dtype(dt, [&](auto tag) { m.device().run(RoundBody<decltype(tag)>{dl, int64_t(n)}, chunks(int64_t(n))); });
    m.wrote(logits, n * 4);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xs = static_cast<const T_*>(x);
    const int64_t tiles = (T + kGemmTile - 1) / kGemmTile;
    host_run(ctx, tiles, [&](int64_t tile, int, int) {
      const int64_t r0 = tile * kGemmTile, rows = std::min(kGemmTile, T - r0);
      // logits stay fp32 (no rounding to the activation type) unless the
      // case selects gate_dtype act (docs/contract.md §14)
      float* l = logits + r0 * E;
      Eigen::Map<MatF>(l, rows, E) =
          gemm_fp32(xs + r0 * D, rows, D, D, static_cast<const T_*>(wg), E, WeightLayout::n_by_k);
      if (gate == GateDtype::act)
        for (int64_t i = 0; i < rows * E; ++i) l[i] = round_to<T_>(l[i]);
    });
  });
}

void router_route(const ExecCtx& ctx, const RouterConfig& cfg, const float* logits,
                  const float* bias, int64_t T, float* scores, float* choice, int32_t* ids,
                  float* topk_scores, int64_t* counts) {
  k::RouterBody body{logits, bias, scores, choice, ids, topk_scores, T, cfg.E, cfg.K,
                     cfg.groups, cfg.limited_groups, cfg.route_scale, cfg.score,
                     cfg.selection, cfg.norm,
                     ctx.faults.has(Fault::highest_id_tiebreak) ? k::TieBreak::higher_id
                                                                : k::TieBreak::lower_id,
                     ctx.faults.has(Fault::softmax_no_max) ? k::SoftmaxShift::none : k::SoftmaxShift::subtract_max,
                     ctx.faults.has(Fault::group_tie_higher) ? k::GroupTie::higher_group : k::GroupTie::lower_group,
                     cfg.held, cfg.biased,
                     ctx.faults.has(Fault::scores_not_held)     ? k::HeldFault::scores_fp32
                     : ctx.faults.has(Fault::norm_sum_not_held) ? k::HeldFault::norm_sum_fp32
                                                                : k::HeldFault::none};
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    const size_t te = size_t(T) * size_t(cfg.E) * 4, tk = size_t(T) * size_t(cfg.K) * 4;
    k::RouterBody d = body;
    d.logits = static_cast<const float*>(m.in(logits, te));
    d.bias = static_cast<const float*>(m.in(bias, size_t(cfg.E) * 4));
    d.scores = static_cast<float*>(m.out(scores, te));
    d.choice = static_cast<float*>(m.out(choice, te));
    d.ids = static_cast<int32_t*>(m.out(ids, tk));
    d.topk_scores = static_cast<float*>(m.out(topk_scores, tk));
    int64_t* dc = static_cast<int64_t*>(m.out(counts, size_t(cfg.E) * 8));
    // On a device: the choice values expert-major (a warp's tokens read
    // neighbouring floats), and sigmoid's scores in a pass of their own
    // (RouterScoresBody, every expert of every token in parallel) before the
    // thread-per-token selection. The same values as the host's one pass.
    d.choice_expert_major = true;
    if (T > 0 && cfg.score == k::ScoreFunc::sigmoid) {
      m.device().run(k::RouterScoresBody{d}, T);
      d.scores_given = true;
    }
    if (T > 0) m.device().run(d, T);
    m.device().run(HistogramBody{d.ids, T * cfg.K, dc}, cfg.E);
    m.wrote(scores, te);
    m.wrote(choice, te);
    m.wrote(ids, tk);
    m.wrote(topk_scores, tk);
    m.wrote(counts, size_t(cfg.E) * 8);
    return;
  }
  host_run(ctx, T, body);
  expert_histogram(ctx, ids, T * cfg.K, cfg.E, counts);
}

}  // namespace moev
