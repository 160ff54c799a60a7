#include "fp8_host.h"

#include "device.h"
#include "ep_host.h"

namespace moev {

void fp8_quantise(const ExecCtx& ctx, DType dt, const void* x, int64_t T, int64_t D, const Fp8Params& p, void* q,
                  float* scale) {
  const int64_t items = T * (D / p.block);
  k::Fp8QuantFaults f;
  f.round_down = ctx.faults.has(Fault::fp8_ue8m0_round_down);
  f.straddle = ctx.faults.has(Fault::fp8_block_straddle);
  f.store_inverse = ctx.faults.has(Fault::fp8_scale_inverse);
  dispatch_dtype(dt, [&](auto tag) {
    using A = decltype(tag);
    if (ctx.mirror) {
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      if (items == 0) return;
      const size_t n = size_t(T * D);
      m.device().run(k::Fp8QuantBody<A>{static_cast<const A*>(m.in(x, n * sizeof(A))), static_cast<e4m3*>(m.out(q, n)),
                                        static_cast<float*>(m.out(scale, size_t(items) * 4)), T, D, p.block, p.clamp,
                                        p.scale, p.quotient, f},
                     items);
      m.wrote(q, n);
      m.wrote(scale, size_t(items) * 4);
      return;
    }
    host_run(ctx, items,
             k::Fp8QuantBody<A>{static_cast<const A*>(x), static_cast<e4m3*>(q), scale, T, D, p.block, p.clamp, p.scale,
                                p.quotient, f});
  });
}

void fp8_dequantise(const ExecCtx& ctx, DType dt, const void* q, const float* scale, int64_t rows, int64_t D,
                    int64_t block, void* out) {
  dispatch_dtype(dt, [&](auto tag) {
    using A = decltype(tag);
    if (ctx.mirror) {
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      if (rows == 0) return;
      const size_t n = size_t(rows * D);
      m.device().run(k::Fp8DequantBody<A>{static_cast<const e4m3*>(m.in(q, n)),
                                          static_cast<const float*>(m.in(scale, size_t(rows * (D / block)) * 4)),
                                          static_cast<A*>(m.out(out, n * sizeof(A))), D, block},
                     rows);
      m.wrote(out, n * sizeof(A));
      return;
    }
    host_run(ctx, rows, k::Fp8DequantBody<A>{static_cast<const e4m3*>(q), scale, static_cast<A*>(out), D, block});
  });
}

void fp8_gather(const ExecCtx& ctx, const int32_t* perm, int64_t N, int K, const float* topk_scores, const void* q,
                const float* scale, int64_t D, int64_t nb, void* q_out, float* scale_out, int32_t* token_sorted,
                float* score_sorted, int32_t* row_of) {
  std::vector<int64_t> token(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    const int32_t a = perm[i];
    token[size_t(i)] = a / K;
    token_sorted[i] = int32_t(a / K);
    score_sorted[i] = topk_scores[a];
    row_of[a] = int32_t(i);
  }
  apply_row_map_e4m3(ctx, q, token.data(), N, D, q_out);
  apply_row_map(ctx, DType::fp32, scale, token.data(), N, nb, scale_out);
}

std::vector<int64_t> scale_row_map(const std::vector<int64_t>& row_map, const FaultSet& faults) {
  if (!faults.has(Fault::fp8_scales_unmoved)) return row_map;
  std::vector<int64_t> same(row_map.size());
  for (size_t i = 0; i < same.size(); ++i) same[i] = int64_t(i);
  return same;
}

}  // namespace moev
