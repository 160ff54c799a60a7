// SwiGLU experts on the host executor (docs/contract.md §8; the `experts`
// slot, src/paths/stages_local.cpp), loop and grouped, and the GEMM
// primitive they and the device mirror share (gemm_nt, gemm_nn: Eigen on the
// host, cuBLAS on a device; docs/architecture.md idea 2). The batched
// experts and their weight cache are in weight_cache_host.cpp.
#include "moe_host_detail.h"
#include "swiglu_bwd_host.h"

#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace moev {
using namespace host_detail;

namespace host_detail {

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

}  // namespace host_detail

namespace {

/// experts_swiglu on the mirror's device: the GEMMs into [h1 | h3], the
/// activation body, the W2 GEMMs (compute_dtype bf16 came through the
/// conversions, on the device too). `loop` runs them expert by expert, one
/// cuBLAS call each; `grouped` runs each step for every expert at once: one
/// grouped GEMM for the 2 E_l GEMMs of h13, one activation launch over all
/// rows, one grouped GEMM for the E_l W2 GEMMs (issue 36 item 3: an
/// expert's 512 rows alone leave most of a GPU idle).
void experts_device(const ExecCtx& ctx, DType dt, ExpertsImpl impl, const void* X, const int64_t* counts, int E_l,
                    int64_t D, int64_t F, const void* W1, const void* W3, const void* W2, void* Y,
                    const SwigluIntermediates& mid, const SwigluConventions& conv) {
  const size_t eb = dtype_bytes(dt);
  const auto* x = static_cast<const uint8_t*>(X);
  auto* y = static_cast<uint8_t*>(Y);
  auto* h13 = static_cast<uint8_t*>(mid.h13);
  auto* H = static_cast<uint8_t*>(mid.H);
  const auto* w1 = static_cast<const uint8_t*>(W1);
  const auto* w3 = static_cast<const uint8_t*>(W3);
  const auto* w2 = static_cast<const uint8_t*>(W2);
  auto act = [&](int64_t r0, int64_t n) {
    dispatch_dtype(dt, [&](auto tag) {
      using T = decltype(tag);
      swiglu_act_device(ctx, reinterpret_cast<const T*>(h13 + size_t(r0 * 2 * F) * eb),
                        reinterpret_cast<T*>(H + size_t(r0 * F) * eb), n, F, conv, r0);
    });
  };
  std::vector<GemmJob> up, down;
  int64_t r0 = 0, rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  for (int j = 0; j < E_l; r0 += counts[j], ++j) {
    const int64_t n = counts[j];
    if (n == 0) continue;
    const size_t wo = size_t(j) * size_t(F * D) * eb;
    const uint8_t* xj = x + size_t(r0 * D) * eb;
    up.push_back({GemmOp::nt, xj, w1 + wo, h13 + size_t(r0 * 2 * F) * eb, n, D, F, D, 0, 2 * F});
    up.push_back({GemmOp::nt, xj, w3 + wo, h13 + size_t(r0 * 2 * F + F) * eb, n, D, F, D, 0, 2 * F});
    down.push_back({GemmOp::nt, H + size_t(r0 * F) * eb, w2 + wo, y + size_t(r0 * D) * eb, n, F, D, F, 0, D});
    if (impl != ExpertsImpl::grouped) {
      for (size_t i = up.size() - 2; i < up.size(); ++i) gemm_job(ctx, dt, up[i]);
      act(r0, n);
      gemm_job(ctx, dt, down.back());
    }
  }
  if (impl != ExpertsImpl::grouped || rows == 0) return;
  const size_t wb = size_t(E_l) * size_t(F * D) * eb;
  gemm_group(ctx, dt, up, {{X, size_t(rows * D) * eb}, {W1, wb}, {W3, wb}}, {{h13, size_t(rows * 2 * F) * eb}});
  act(0, rows);
  gemm_group(ctx, dt, down, {{H, size_t(rows * F) * eb}, {W2, wb}}, {{Y, size_t(rows * D) * eb}});
}

}  // namespace

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
                   mid, SwigluConventions{conv.rounding, ComputeDtype::act, conv.row_scale});
    from_bf16(ctx, dt, yb, Y);
    return;
  }
  if (ctx.mirror) return experts_device(ctx, dt, impl, X, counts, E_l, D, F, W1, W3, W2, Y, mid, conv);
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
        host_run(ctx, n, swiglu_body(ctx, conv, h13 + r0 * 2 * F, H + r0 * F, F, r0));
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
        const k::SwigluBody<T> act = swiglu_body(ctx, conv, h13, H, F, 0);
        for (int64_t q = r; q < r + n; ++q) act(q, 0, 1);
        gemm_typed(H + r * F, n, F, F, w2 + j * D * F, D, ys + r * D, D);
      });
    }
  });
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

namespace {

/// A GemmOp::nn_f32 job on the host executor (on a device it runs inside
/// gemm_group): Y (rows, n; row stride ldy) fp32 = X W, W (k, n) row-major.
void gemm_nn_f32(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W,
                 int64_t n, float* Y, int64_t ldy) {
  if (ctx.mirror) throw std::logic_error("gemm_nn_f32 runs on the host executor; on a device it is a gemm_group job");
  if (rows == 0 || n == 0) return;
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    const int64_t tiles = (rows + kGemmTile - 1) / kGemmTile;
    host_run(ctx, tiles, [&](int64_t t, int, int) {
      const int64_t r = t * kGemmTile, nr = std::min(kGemmTile, rows - r);
      Eigen::Map<MatF, 0, Eigen::OuterStride<>>(Y + r * ldy, nr, n, Eigen::OuterStride<>(ldy)) =
          gemm_fp32(static_cast<const T*>(X) + r * ldx, nr, k, ldx, static_cast<const T*>(W), n, WeightLayout::k_by_n);
    });
  });
}

}  // namespace

void gemm_job(const ExecCtx& ctx, DType dt, const GemmJob& j) {
  if (j.op == GemmOp::nt) gemm_nt(ctx, dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.c, j.ldc);
  else if (j.op == GemmOp::nn) gemm_nn(ctx, dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.c, j.ldc);
  else if (j.op == GemmOp::nn_f32) gemm_nn_f32(ctx, dt, j.a, j.rows, j.k, j.lda, j.b, j.n, static_cast<float*>(j.c), j.ldc);
  else gemm_tn_f32(ctx, dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.ldb, static_cast<float*>(j.c));
}

void gemm_group(const ExecCtx& ctx, DType dt, const std::vector<GemmJob>& jobs, std::initializer_list<ByteRange> inputs,
                std::initializer_list<ByteRange> outputs) {
  if (jobs.empty()) return;
  if (!ctx.mirror) {
    for (const GemmJob& j : jobs) gemm_job(ctx, dt, j);
    return;
  }
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  // Each buffer moves once; a job's device address is its offset in the
  // buffer that holds it.
  struct Buffer {
    const uint8_t* host;
    size_t bytes;
    uint8_t* dev;
  };
  std::vector<Buffer> bufs;
  for (const ByteRange& r : inputs)
    if (r.bytes) bufs.push_back({static_cast<const uint8_t*>(r.p), r.bytes, static_cast<uint8_t*>(const_cast<void*>(m.in(r.p, r.bytes)))});
  for (const ByteRange& r : outputs)
    if (r.bytes) bufs.push_back({static_cast<const uint8_t*>(r.p), r.bytes, static_cast<uint8_t*>(m.out(const_cast<void*>(r.p), r.bytes))});
  auto dev = [&](const void* p, size_t bytes) -> uint8_t* {
    const auto* h = static_cast<const uint8_t*>(p);
    for (const Buffer& b : bufs)
      if (h >= b.host && h + bytes <= b.host + b.bytes) return b.dev + (h - b.host);
    throw std::logic_error("gemm_group: a job's operand lies in none of the buffers given");
  };
  const size_t eb = dtype_bytes(dt);
  std::vector<GemmJob> on_device;
  for (const GemmJob& j : jobs) {
    if (j.k == 0 || j.n == 0) continue;
    if (j.op == GemmOp::tn_f32) {
      const size_t cb = size_t(j.k * j.n) * 4;
      if (j.rows == 0) {
        m.device().fill_timed(dev(j.c, cb), 0, cb);  // fp32 0 is all-zero bytes
        continue;
      }
      on_device.push_back({j.op, dev(j.a, size_t((j.rows - 1) * j.lda + j.k) * eb),
                           dev(j.b, size_t((j.rows - 1) * j.ldb + j.n) * eb), dev(j.c, cb), j.rows, j.k, j.n, j.lda,
                           j.ldb, j.ldc});
      continue;
    }
    if (j.rows == 0) continue;
    // the byte extents of the strided blocks: the last row ends at its last column
    const size_t cb = j.op == GemmOp::nn_f32 ? 4 : eb;
    on_device.push_back({j.op, dev(j.a, size_t((j.rows - 1) * j.lda + j.k) * eb), dev(j.b, size_t(j.n * j.k) * eb),
                         dev(j.c, size_t((j.rows - 1) * j.ldc + j.n) * cb), j.rows, j.k, j.n, j.lda, j.ldb, j.ldc});
  }
  if (!on_device.empty()) m.device().gemm_group(dt, on_device);
  for (const ByteRange& r : outputs) m.wrote(const_cast<void*>(r.p), r.bytes);
}

void copy_bytes(const ExecCtx& ctx, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    m.device().copy_timed(m.out(dst, bytes), m.in(src, bytes), bytes);
    m.wrote(dst, bytes);
    return;
  }
  std::memcpy(dst, src, bytes);
}

}  // namespace moev
