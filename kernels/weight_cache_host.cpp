// The batched equal-count SwiGLU experts on the host executor and their
// weight cache (docs/contract.md §8, docs/frameworks.md §8.1; the `experts`
// slot's batched variant, src/paths/stages_local.cpp): fused [W1; W3] and
// W2^T built once per weight version.
#include "moe_host_detail.h"

namespace moev {
using namespace host_detail;

void experts_swiglu_batched(const ExecCtx& ctx, DType dt, const void* X, int64_t c, int E_l, int64_t D, int64_t F,
                            const void* W1, const void* W3, const void* W2, uint64_t version,
                            BatchedWeightCache& cache, void* Y) {
  std::vector<uint8_t> h13_buf(size_t(E_l * c * 2 * F) * dtype_bytes(dt)), H_buf(size_t(E_l * c * F) * dtype_bytes(dt));
  experts_swiglu_batched(ctx, dt, X, c, E_l, D, F, W1, W3, W2, version, cache, Y,
                         SwigluIntermediates{h13_buf.data(), H_buf.data()});
}

void experts_swiglu_batched(const ExecCtx& ctx, DType dt, const void* X, int64_t c, int E_l, int64_t D, int64_t F,
                            const void* W1, const void* W3, const void* W2, uint64_t version,
                            BatchedWeightCache& cache, void* Y, const SwigluIntermediates& mid,
                            SwigluConventions conv) {
  if (conv.compute == ComputeDtype::bf16 && dt != DType::bf16) {
    // As experts_swiglu: bf16 inputs and weights. The cache then holds bf16
    // weights: a caller must not share one cache between compute dtypes
    // under one weight version (the stage uses a fresh cache per run).
    const std::vector<bf16> xb = to_bf16(ctx, dt, X, E_l * c * D), w1 = to_bf16(ctx, dt, W1, E_l * F * D),
                            w3 = to_bf16(ctx, dt, W3, E_l * F * D), w2 = to_bf16(ctx, dt, W2, E_l * D * F);
    std::vector<bf16> yb(static_cast<size_t>(E_l * c * D));
    experts_swiglu_batched(ctx, DType::bf16, xb.data(), c, E_l, D, F, w1.data(), w3.data(), w2.data(), version, cache,
                           yb.data(), mid, SwigluConventions{conv.rounding, ComputeDtype::act, conv.row_scale});
    from_bf16(ctx, dt, yb, Y);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const size_t fd = size_t(F * D);
    // The planted fault keys the cache on "built at all", not on the version.
    const bool stale = ctx.faults.has(Fault::stale_weight_cache) ? cache.version == 0 : cache.version != version;
    if (stale) {
      cache.w13.resize(size_t(E_l) * 2 * fd * sizeof(T));
      cache.w2t.resize(size_t(E_l) * fd * sizeof(T));
      T* w13 = reinterpret_cast<T*>(cache.w13.data());
      T* w2t = reinterpret_cast<T*>(cache.w2t.data());
      const T* w1 = static_cast<const T*>(W1);
      const T* w3 = static_cast<const T*>(W3);
      const T* w2 = static_cast<const T*>(W2);
      for (int j = 0; j < E_l; ++j) {
        std::copy(w1 + j * fd, w1 + (j + 1) * fd, w13 + size_t(j) * 2 * fd);
        std::copy(w3 + j * fd, w3 + (j + 1) * fd, w13 + size_t(j) * 2 * fd + fd);
        for (int64_t d = 0; d < D; ++d)
          for (int64_t f = 0; f < F; ++f) w2t[size_t(j) * fd + size_t(f * D + d)] = w2[size_t(j) * fd + size_t(d * F + f)];
      }
      cache.version = version;
      ++cache.builds;
    }
    const T* w13 = reinterpret_cast<const T*>(cache.w13.data());
    const T* w2t = reinterpret_cast<const T*>(cache.w2t.data());
    const T* xs = static_cast<const T*>(X);
    T* ys = static_cast<T*>(Y);
    T* const h13 = static_cast<T*>(mid.h13);
    T* const H = static_cast<T*>(mid.H);
    if (ctx.mirror) {
      // On a device, for every expert at once: the fused [W1; W3] GEMMs (NT)
      // as one grouped GEMM, the activation body over all rows, and H times
      // the cached W2^T (NN) as another. The cache is built on the host and
      // uploaded with each call.
      std::vector<GemmJob> up, down;
      for (int j = 0; j < E_l; ++j) {
        const int64_t r = j * c;
        up.push_back({GemmOp::nt, xs + r * D, w13 + size_t(j) * 2 * fd, h13 + r * 2 * F, c, D, 2 * F, D, 0, 2 * F});
        down.push_back({GemmOp::nn, H + r * F, w2t + size_t(j) * fd, ys + r * D, c, F, D, F, 0, D});
      }
      const int64_t rows = int64_t(E_l) * c;
      gemm_group(ctx, dt, up, {{X, size_t(rows * D) * sizeof(T)}, {w13, cache.w13.size()}},
                 {{h13, size_t(rows * 2 * F) * sizeof(T)}});
      swiglu_act_device(ctx, h13, H, rows, F, conv, 0);
      gemm_group(ctx, dt, down, {{H, size_t(rows * F) * sizeof(T)}, {w2t, cache.w2t.size()}},
                 {{Y, size_t(rows * D) * sizeof(T)}});
      return;
    }
    const int64_t tiles = (c + kGemmTile - 1) / kGemmTile;
    host_run(ctx, E_l * tiles, [&](int64_t item, int, int) {
      const int64_t j = item / tiles, r = j * c + (item % tiles) * kGemmTile;
      const int64_t n = std::min(kGemmTile, (j + 1) * c - r);
      gemm_typed(xs + r * D, n, D, D, w13 + size_t(j) * 2 * fd, 2 * F, h13 + r * 2 * F, 2 * F);
      const k::SwigluBody<T> act = swiglu_body(ctx, conv, h13, H, F, 0);
      for (int64_t q = r; q < r + n; ++q) act(q, 0, 1);
      gemm_typed(H + r * F, n, F, F, w2t + size_t(j) * fd, D, ys + r * D, D, WeightLayout::k_by_n);
    });
  });
}

}  // namespace moev
