// Host implementations of the fast-path entry points: kernel bodies run by the
// host executor, plus the primitives that differ by nature between host and
// device (histogram, stable sort, GEMM; docs/architecture.md idea 2).
#include "moe_host.h"

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "device.h"
#include "parallel_errors.h"

namespace moev {
namespace {

/// The case's activation rounding (docs/contract.md §14), or the planted fault's
/// extra rounding where the case says `fused`.
k::SiluRounding silu_rounding(const ExecCtx& ctx, const SwigluConventions& conv) {
  return ctx.faults.has(Fault::silu_rounded) ? k::SiluRounding::rounded_to_act : conv.rounding;
}

/// H (n, F) = the SwiGLU activation of h13 (n, 2F) on the mirror's device.
template <class T>
void swiglu_act_device(const ExecCtx& ctx, const T* h13, T* H, int64_t n, int64_t F, const SwigluConventions& conv) {
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  m.device().run(k::SwigluBody<T>{static_cast<const T*>(m.in(h13, size_t(n * 2 * F) * sizeof(T))),
                                  static_cast<T*>(m.out(H, size_t(n * F) * sizeof(T))), F, silu_rounding(ctx, conv)},
                 n);
  m.wrote(H, size_t(n * F) * sizeof(T));
}

/// n values of dtype dt rounded to bf16 (ComputeDtype::bf16), on the host
/// or the mirror's device (dt is not bf16).
std::vector<bf16> to_bf16(const ExecCtx& ctx, DType dt, const void* src, int64_t n) {
  std::vector<bf16> out(static_cast<size_t>(n));
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bf16>) {
      if (ctx.mirror && n > 0) {
        Mirror& m = *ctx.mirror;
        Mirror::Scope scope{m};
        m.device().run(ConvertBody<T, bf16>{static_cast<const T*>(m.in(src, size_t(n) * sizeof(T))),
                                            static_cast<bf16*>(m.out(out.data(), size_t(n) * 2)), n},
                       chunks(n));
        m.wrote(out.data(), size_t(n) * 2);
        return;
      }
    }
    const T* s = static_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = from_float<bf16>(to_float(s[i]));
  });
  return out;
}

/// n bf16 values rounded to dtype dt, on the host or the mirror's device.
void from_bf16(const ExecCtx& ctx, DType dt, const std::vector<bf16>& src, void* dst) {
  const int64_t n = int64_t(src.size());
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bf16>) {
      if (ctx.mirror && n > 0) {
        Mirror& m = *ctx.mirror;
        Mirror::Scope scope{m};
        m.device().run(ConvertBody<bf16, T>{static_cast<const bf16*>(m.in(src.data(), size_t(n) * 2)),
                                            static_cast<T*>(m.out(dst, size_t(n) * sizeof(T))), n},
                       chunks(n));
        m.wrote(dst, size_t(n) * sizeof(T));
        return;
      }
    }
    T* d = static_cast<T*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = from_float<T>(to_float(src[size_t(i)]));
  });
}

constexpr int64_t kGemmTile = 64;  // fixed row tile: results independent of thread count

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
void to_float_block(const T* src, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& dst) {
  dst.resize(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[size_t(r * cols + c)] = to_float(src[r * ld + c]);
}

/// How a GEMM's weight is stored: (n, k) rows multiplied transposed (X W^T,
/// the nn.Linear layout) or (k, n) multiplied as is (X W, a cached W2^T).
enum class WeightLayout { n_by_k, k_by_n };

/// The fp32-accumulated product of act-typed X (rows, k; row stride ldx) and
/// W; the result lives in a thread-local buffer until the next call.
template <class T>
const MatF& gemm_fp32(const T* X, int64_t rows, int64_t k, int64_t ldx, const T* W, int64_t n, WeightLayout wl) {
  thread_local std::vector<float> xf, wf;
  thread_local MatF yf;
  const bool nk = wl == WeightLayout::n_by_k;
  try {
    xf.reserve(size_t(rows * k));
    wf.reserve(size_t(n * k));
    yf.resize(rows, n);
  } catch (const std::bad_alloc&) {  // the size asked for, for the report
    throw OutOfMemory(uint64_t(rows * k + n * k + rows * n) * sizeof(float));
  }
  to_float_block(X, rows, k, ldx, xf);
  to_float_block(W, nk ? n : k, nk ? k : n, nk ? k : n, wf);
  Eigen::Map<const MatF> xm(xf.data(), rows, k);
  if (nk) yf.noalias() = xm * Eigen::Map<const MatF>(wf.data(), n, k).transpose();
  else yf.noalias() = xm * Eigen::Map<const MatF>(wf.data(), k, n);
  return yf;
}

/// Y (row stride ldy) = round_act(X W^T) or round_act(X W).
template <class T>
void gemm_typed(const T* X, int64_t rows, int64_t k, int64_t ldx, const T* W, int64_t n, T* Y, int64_t ldy,
                WeightLayout wl = WeightLayout::n_by_k) {
  if (rows == 0 || n == 0) return;
  const MatF& yf = gemm_fp32(X, rows, k, ldx, W, n, wl);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) Y[r * ldy + c] = from_float<T>(yf(r, c));
}

}  // namespace

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

void expert_histogram(const ExecCtx&, const int32_t* ids, int64_t N, int E, int64_t* counts) {
  std::fill(counts, counts + E, int64_t(0));
  for (int64_t a = 0; a < N; ++a) ++counts[ids[a]];
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
                     ctx.faults.has(Fault::group_tie_higher) ? k::GroupTie::higher_group : k::GroupTie::lower_group};
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

// Parallel stable counting sort: chunk c of the assignments is handled by one
// worker; worker c's rows for expert e start after every earlier chunk's rows
// for e, so equal keys keep ascending a. The planted fault fills each expert's
// rows from the back (descending a), an unstable order.
void expert_sort(const ExecCtx& ctx, const int32_t* ids, int64_t N, int E, int32_t* perm) {
  if (ctx.mirror) {  // a device sort has no chunks: sort_chunk_offset has no device form
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    int32_t* dp = static_cast<int32_t*>(m.out(perm, size_t(N) * 4));
    if (N > 0) m.device().sort(static_cast<const int32_t*>(m.in(ids, size_t(N) * 4)), N, E, dp, ctx.faults.has(Fault::unstable_sort));
    m.wrote(perm, size_t(N) * 4);
    return;
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(ctx.threads, N / 4096 + 1));
  const int64_t per = (N + chunks - 1) / chunks;
  std::vector<int64_t> hist(size_t(chunks * E), 0);
  host_run(ctx, chunks, [&](int64_t c, int, int) {
    int64_t* h = hist.data() + c * E;
    for (int64_t a = c * per; a < std::min(N, (c + 1) * per); ++a) ++h[ids[a]];
  });
  // exclusive scan in (expert, chunk) order. The planted fault scans in
  // (chunk, expert) order: with one chunk (N < 4096 or one thread) the two
  // agree, with two or more the rows stop being expert-major (docs/frameworks.md §2.1).
  int64_t run = 0;
  if (ctx.faults.has(Fault::sort_chunk_offset)) {
    for (int64_t c = 0; c < chunks; ++c)
      for (int e = 0; e < E; ++e) {
        const int64_t v = hist[size_t(c * E + e)];
        hist[size_t(c * E + e)] = run;
        run += v;
      }
  } else {
    for (int e = 0; e < E; ++e)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t v = hist[size_t(c * E + e)];
        hist[size_t(c * E + e)] = run;
        run += v;
      }
  }
  if (ctx.faults.has(Fault::unstable_sort)) {
    std::vector<int64_t> count(size_t(E), 0), start(size_t(E), 0);
    for (int64_t a = 0; a < N; ++a) ++count[size_t(ids[a])];
    for (int e = 1; e < E; ++e) start[size_t(e)] = start[size_t(e - 1)] + count[size_t(e - 1)];
    for (int64_t a = 0; a < N; ++a) {
      const int e = ids[a];
      perm[start[size_t(e)] + --count[size_t(e)]] = int32_t(a);
    }
    return;
  }
  host_run(ctx, chunks, [&](int64_t c, int, int) {
    int64_t* h = hist.data() + c * E;
    for (int64_t a = c * per; a < std::min(N, (c + 1) * per); ++a) perm[h[ids[a]]++] = int32_t(a);
  });
}

void dispatch_gather(const ExecCtx& ctx, DType dt, k::ScoreApply apply, const void* x,
                     const int32_t* perm, const float* topk_scores, int64_t N, int64_t D, int K,
                     void* routed, int32_t* token_sorted, float* score_sorted, int32_t* row_of,
                     k::ScoreMultiply smul) {
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    k::GatherBody<T> body{static_cast<const T*>(x), perm, topk_scores, static_cast<T*>(routed),
                          token_sorted, score_sorted, row_of, D, K, apply, smul};
    if (ctx.mirror) {
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      if (N == 0) return;
      const int64_t tokens = N / K;
      const size_t rb = size_t(N * D) * sizeof(T);
      k::GatherBody<T> d = body;
      d.x = static_cast<const T*>(m.in(x, size_t(tokens * D) * sizeof(T)));
      d.perm = static_cast<const int32_t*>(m.in(perm, size_t(N) * 4));
      d.topk_scores = static_cast<const float*>(m.in(topk_scores, size_t(N) * 4));
      d.routed = static_cast<T*>(m.out(routed, rb));
      d.token_sorted = static_cast<int32_t*>(m.out(token_sorted, size_t(N) * 4));
      d.score_sorted = static_cast<float*>(m.out(score_sorted, size_t(N) * 4));
      d.row_of = static_cast<int32_t*>(m.out(row_of, size_t(N) * 4));
      m.device().run(d, N);
      m.wrote(routed, rb);
      m.wrote(token_sorted, size_t(N) * 4);
      m.wrote(score_sorted, size_t(N) * 4);
      m.wrote(row_of, size_t(N) * 4);
      return;
    }
    host_run(ctx, N, body);
  });
}

void experts_swiglu(const ExecCtx& ctx, DType dt, ExpertsImpl impl, const void* X,
                    const int64_t* counts, int E_l, int64_t D, int64_t F, const void* W1,
                    const void* W3, const void* W2, void* Y) {
  int64_t rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  std::vector<uint8_t> h13_buf(size_t(rows * 2 * F) * dtype_bytes(dt)), H_buf(size_t(rows * F) * dtype_bytes(dt));
  experts_swiglu(ctx, dt, impl, X, counts, E_l, D, F, W1, W3, W2, Y, SwigluIntermediates{h13_buf.data(), H_buf.data()});
}

void experts_swiglu(const ExecCtx& ctx, DType dt, ExpertsImpl impl, const void* X,
                    const int64_t* counts, int E_l, int64_t D, int64_t F, const void* W1,
                    const void* W3, const void* W2, void* Y, const SwigluIntermediates& mid,
                    SwigluConventions conv) {
  if (conv.compute == ComputeDtype::bf16 && dt != DType::bf16) {
    // X and the weights rounded to bf16, the whole SwiGLU in bf16, Y rounded back.
    int64_t rows = 0;
    for (int j = 0; j < E_l; ++j) rows += counts[j];
    const std::vector<bf16> xb = to_bf16(ctx, dt, X, rows * D), w1 = to_bf16(ctx, dt, W1, E_l * F * D),
                            w3 = to_bf16(ctx, dt, W3, E_l * F * D), w2 = to_bf16(ctx, dt, W2, E_l * D * F);
    std::vector<bf16> yb(static_cast<size_t>(rows * D));
    experts_swiglu(ctx, DType::bf16, impl, xb.data(), counts, E_l, D, F, w1.data(), w3.data(), w2.data(), yb.data(),
                   mid, SwigluConventions{conv.rounding, ComputeDtype::act});
    from_bf16(ctx, dt, yb, Y);
    return;
  }
  if (ctx.mirror) {
    // On a device: per expert, the two GEMMs into [h1 | h3], the activation
    // body, the W2 GEMM, each through the entry points (cuBLAS, a grid).
    // Loop and grouped are the same calls here (compute_dtype bf16 came
    // through the conversions above, on the device too).
    const size_t eb = dtype_bytes(dt);
    const auto* x = static_cast<const uint8_t*>(X);
    auto* y = static_cast<uint8_t*>(Y);
    auto* h13 = static_cast<uint8_t*>(mid.h13);
    auto* H = static_cast<uint8_t*>(mid.H);
    int64_t r0 = 0;
    for (int j = 0; j < E_l; r0 += counts[j], ++j) {
      const int64_t n = counts[j];
      if (n == 0) continue;
      const size_t wo = size_t(j) * size_t(F * D) * eb;
      gemm_nt(ctx, dt, x + size_t(r0 * D) * eb, n, D, D, static_cast<const uint8_t*>(W1) + wo, F, h13 + size_t(r0 * 2 * F) * eb, 2 * F);
      gemm_nt(ctx, dt, x + size_t(r0 * D) * eb, n, D, D, static_cast<const uint8_t*>(W3) + wo, F,
              h13 + size_t(r0 * 2 * F + F) * eb, 2 * F);
      dispatch_dtype(dt, [&](auto tag) {
        using T = decltype(tag);
        swiglu_act_device(ctx, reinterpret_cast<const T*>(h13 + size_t(r0 * 2 * F) * eb),
                          reinterpret_cast<T*>(H + size_t(r0 * F) * eb), n, F, conv);
      });
      gemm_nt(ctx, dt, H + size_t(r0 * F) * eb, n, F, F, static_cast<const uint8_t*>(W2) + wo, D, y + size_t(r0 * D) * eb, D);
    }
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(X);
    T* ys = static_cast<T*>(Y);
    std::vector<int64_t> off(size_t(E_l) + 1, 0);
    for (int j = 0; j < E_l; ++j) off[size_t(j) + 1] = off[size_t(j)] + counts[j];
    T* const h13 = static_cast<T*>(mid.h13);
    T* const H = static_cast<T*>(mid.H);
    const T* w1 = static_cast<const T*>(W1);
    const T* w3 = static_cast<const T*>(W3);
    const T* w2 = static_cast<const T*>(W2);
    if (impl == ExpertsImpl::batched)
      throw std::invalid_argument("experts_swiglu: the batched impl is experts_swiglu_batched (it needs a weight cache)");
    if (impl == ExpertsImpl::loop) {
      // One expert at a time, each GEMM tiled over rows (the per-expert loop).
      for (int j = 0; j < E_l; ++j) {
        const int64_t r0 = off[size_t(j)], n = counts[j];
        const int64_t tiles = (n + kGemmTile - 1) / kGemmTile;
        auto tile_rows = [&](int64_t t) { return std::min(kGemmTile, n - t * kGemmTile); };
        host_run(ctx, tiles, [&](int64_t t, int, int) {
          const int64_t r = r0 + t * kGemmTile;
          gemm_typed(xs + r * D, tile_rows(t), D, D, w1 + j * F * D, F, h13 + r * 2 * F, 2 * F);
          gemm_typed(xs + r * D, tile_rows(t), D, D, w3 + j * F * D, F, h13 + r * 2 * F + F, 2 * F);
        });
        host_run(ctx, n, k::SwigluBody<T>{h13 + r0 * 2 * F, H + r0 * F, F, silu_rounding(ctx, conv)});
        host_run(ctx, tiles, [&](int64_t t, int, int) {
          const int64_t r = r0 + t * kGemmTile;
          gemm_typed(H + r * F, tile_rows(t), F, F, w2 + j * D * F, D, ys + r * D, D);
        });
      }
    } else {
      // Grouped: one work list of (expert, tile) items over all groups, each
      // item runs both GEMMs and the activation for its tile.
      std::vector<int64_t> item_row, item_expert;
      for (int j = 0; j < E_l; ++j)
        for (int64_t r = off[size_t(j)]; r < off[size_t(j) + 1]; r += kGemmTile) {
          item_row.push_back(r);
          item_expert.push_back(j);
        }
      host_run(ctx, int64_t(item_row.size()), [&](int64_t it, int, int) {
        const int64_t r = item_row[size_t(it)], j = item_expert[size_t(it)];
        const int64_t n = std::min(kGemmTile, off[size_t(j) + 1] - r);
        gemm_typed(xs + r * D, n, D, D, w1 + j * F * D, F, h13 + r * 2 * F, 2 * F);
        gemm_typed(xs + r * D, n, D, D, w3 + j * F * D, F, h13 + r * 2 * F + F, 2 * F);
        const k::SwigluBody<T> act{h13, H, F, silu_rounding(ctx, conv)};
        for (int64_t q = r; q < r + n; ++q) act(q, 0, 1);
        gemm_typed(H + r * F, n, F, F, w2 + j * D * F, D, ys + r * D, D);
      });
    }
  });
}

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
                           yb.data(), mid, SwigluConventions{conv.rounding, ComputeDtype::act});
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
      // On a device, per expert: the fused [W1; W3] GEMM (NT), the activation
      // body, and H times the cached W2^T (NN), each through the entry points.
      // The cache is built on the host and uploaded with each call.
      for (int j = 0; j < E_l; ++j) {
        const int64_t r = j * c;
        gemm_nt(ctx, dt, xs + r * D, c, D, D, w13 + size_t(j) * 2 * fd, 2 * F, h13 + r * 2 * F, 2 * F);
        swiglu_act_device(ctx, h13 + r * 2 * F, H + r * F, c, F, conv);
        gemm_nn(ctx, dt, H + r * F, c, F, F, w2t + size_t(j) * fd, D, ys + r * D, D);
      }
      return;
    }
    const int64_t tiles = (c + kGemmTile - 1) / kGemmTile;
    host_run(ctx, E_l * tiles, [&](int64_t item, int, int) {
      const int64_t j = item / tiles, r = j * c + (item % tiles) * kGemmTile;
      const int64_t n = std::min(kGemmTile, (j + 1) * c - r);
      gemm_typed(xs + r * D, n, D, D, w13 + size_t(j) * 2 * fd, 2 * F, h13 + r * 2 * F, 2 * F);
      const k::SwigluBody<T> act{h13, H, F, silu_rounding(ctx, conv)};
      for (int64_t q = r; q < r + n; ++q) act(q, 0, 1);
      gemm_typed(H + r * F, n, F, F, w2t + size_t(j) * fd, D, ys + r * D, D, WeightLayout::k_by_n);
    });
  });
}

namespace {

/// The combine on the mirror's device: one column per lane (W = 1), the same
/// operations per column as the host's spans, so the bytes agree.
void combine_device(const ExecCtx& ctx, const CombineArgs& a, k::CombineInit init_from, const void* init, void* out) {
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  dispatch_dtype(a.dt, [&](auto tag) {
    using T = decltype(tag);
    const size_t td = size_t(a.T * a.D) * sizeof(T);
    if (td == 0) return;
    const bool shared = a.shared_add == k::SharedAdd::add_after;
    k::CombineBody<T, 1> d{static_cast<const T*>(m.in(a.routed_out, size_t(a.rows * a.D) * sizeof(T))),
                           static_cast<const float*>(m.in(a.score_sorted, size_t(a.rows) * 4)),
                           static_cast<const int32_t*>(m.in(a.row_of, size_t(a.T * a.K) * 4)),
                           init_from == k::CombineInit::buffer ? static_cast<const T*>(m.in(init, td)) : nullptr,
                           shared ? static_cast<const T*>(m.in(a.shared, td)) : nullptr,
                           static_cast<T*>(m.out(out, td)),
                           a.D, a.K, a.apply, a.acc, a.shared_add,
                           ctx.faults.has(Fault::unordered_combine) ? k::CombineOrder::descending_row
                                                                    : k::CombineOrder::ascending_row,
                           a.smul, init_from};
    m.device().run(d, a.T);
    m.wrote(out, td);
  });
}

// One token of the host combine, compiled for the baseline ISA and for AVX2
// and AVX-512 (GCC function multi-versioning: the loader picks the widest
// the CPU has), so the span loops run 8 or 16 fp32 lanes wide without a
// -march build. The bytes are the same on every ISA: the operations are IEEE
// fp32 ones and the kernels build with -ffp-contract=off (CMakeLists.txt).
#define MOEV_COMBINE_TOKEN(T)                                                                       \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), flatten)) void combine_token( \
      const k::CombineBody<T, k::kCombineSpan>& body, int64_t t) {                                  \
    body(t, 0, 1);                                                                                  \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
MOEV_COMBINE_TOKEN(float)
MOEV_COMBINE_TOKEN(bf16)
MOEV_COMBINE_TOKEN(fp16)
#else
template <class T>
void combine_token(const k::CombineBody<T, k::kCombineSpan>& body, int64_t t) {
  body(t, 0, 1);
}
#endif
#undef MOEV_COMBINE_TOKEN

void combine_impl(const ExecCtx& ctx, const CombineArgs& a, k::CombineInit init_from, const void* init, void* out) {
  if (ctx.mirror) return combine_device(ctx, a, init_from, init, out);
  dispatch_dtype(a.dt, [&](auto tag) {
    using T = decltype(tag);
    k::CombineBody<T, k::kCombineSpan> body{static_cast<const T*>(a.routed_out), a.score_sorted, a.row_of,
                                            static_cast<const T*>(init), static_cast<const T*>(a.shared),
                                            static_cast<T*>(out), a.D, a.K, a.apply, a.acc, a.shared_add,
                                            ctx.faults.has(Fault::unordered_combine) ? k::CombineOrder::descending_row
                                                                                     : k::CombineOrder::ascending_row,
                                            a.smul, init_from};
    host_run(ctx, a.T, [&](int64_t t, int, int) { combine_token(body, t); });
  });
}

}  // namespace

void combine(const ExecCtx& ctx, const CombineArgs& a, const void* init, void* out) {
  combine_impl(ctx, a, k::CombineInit::buffer, init, out);
}

void combine_from_zeros(const ExecCtx& ctx, const CombineArgs& a, void* out) {
  combine_impl(ctx, a, k::CombineInit::zeros, nullptr, out);
}

namespace {

/// gemm_nt and gemm_nn: W (n, k) or (k, n) row-major.
void gemm_layout(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W,
                 int64_t n, void* Y, int64_t ldy, WeightLayout layout) {
  if (rows == 0 || n == 0) return;
  const size_t eb = dtype_bytes(dt);
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    // the byte extents of the strided blocks: the last row ends at its last column
    const size_t xb = size_t((rows - 1) * ldx + k) * eb, yb = size_t((rows - 1) * ldy + n) * eb;
    const void* xd = m.in(X, xb);
    const void* wd = m.in(W, size_t(n * k) * eb);
    void* yd = m.out(Y, yb);
    if (layout == WeightLayout::n_by_k) m.device().gemm_nt(dt, xd, rows, k, ldx, wd, n, yd, ldy);
    else m.device().gemm_nn(dt, xd, rows, k, ldx, wd, n, yd, ldy);
    m.wrote(Y, yb);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const int64_t tiles = (rows + kGemmTile - 1) / kGemmTile;
    host_run(ctx, tiles, [&](int64_t t, int, int) {
      const int64_t r = t * kGemmTile;
      gemm_typed(static_cast<const T*>(X) + r * ldx, std::min(kGemmTile, rows - r), k, ldx, static_cast<const T*>(W), n,
                 static_cast<T*>(Y) + r * ldy, ldy, layout);
    });
  });
}

}  // namespace

void gemm_nt(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n,
             void* Y, int64_t ldy) {
  gemm_layout(ctx, dt, X, rows, k, ldx, W, n, Y, ldy, WeightLayout::n_by_k);
}

void gemm_nn(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n,
             void* Y, int64_t ldy) {
  gemm_layout(ctx, dt, X, rows, k, ldx, W, n, Y, ldy, WeightLayout::k_by_n);
}

void copy_bytes(const ExecCtx& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    m.device().copy(m.out(dst, bytes), m.in(src, bytes), bytes);
    m.wrote(dst, bytes);
    return;
  }
  std::memcpy(dst, src, bytes);
}

bool ranges_overlap(ByteRange a, ByteRange b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a.p), pb = reinterpret_cast<uintptr_t>(b.p);
  return pa < pb + b.bytes && pb < pa + a.bytes;
}

InPlaceResult combine_in_place(const ExecCtx& ctx, const CombineArgs& a, void* buf,
                               void* fallback, const ByteRange* inputs,
                               const char* const* names, int num_inputs) {
  // On a device the guard compares the device byte ranges: the buffers the
  // kernel really reads and writes (a view keeps its offset in its storage's
  // device copy, so overlap there is overlap on the host and back).
  Mirror* m = ctx.mirror;
  auto on_device = [m](ByteRange r) { return m && r.bytes ? ByteRange{m->in(r.p, r.bytes), r.bytes} : r; };
  const ByteRange out = on_device({buf, size_t(a.T * a.D) * dtype_bytes(a.dt)});
  for (int i = 0; i < num_inputs; ++i) {
    // The planted fault reproduces a data-pointer comparison (docs/frameworks.md §9.2
    // pitfall): a view at an offset inside the same allocation slips through.
    const bool hit = ctx.faults.has(Fault::pointer_alias_guard)
                         ? (out.bytes && inputs[i].bytes && out.p == on_device(inputs[i]).p)
                         : ranges_overlap(out, on_device(inputs[i]));
    if (hit) {
      combine(ctx, a, buf, fallback);
      return {Placement::out_of_place_fallback,
              std::string("output buffer overlaps input '") + names[i] + "'"};
    }
  }
  combine(ctx, a, buf, buf);
  return {Placement::in_place, ""};
}

}  // namespace moev
