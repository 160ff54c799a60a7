// Internals shared by the host files that implement moe_host.h (the local
// path's fast entry points, one file per stage family: router_host.cpp,
// dispatch_host.cpp, experts_host.cpp, weight_cache_host.cpp,
// combine_host.cpp; docs/architecture.md "Layout"). Not for use outside
// kernels/: the runner and the tests call the entry points of moe_host.h.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <new>
#include <vector>

#include "device.h"
#include "moe_host.h"
#include "parallel_errors.h"

namespace moev {
namespace host_detail {

/// The case's activation rounding (docs/contract.md §14), or the planted fault's
/// extra rounding where the case says `fused`.
inline k::SiluRounding silu_rounding(const ExecCtx& ctx, const SwigluConventions& conv) {
  return ctx.faults.has(Fault::silu_rounded) ? k::SiluRounding::rounded_to_act : conv.rounding;
}

/// The activation body over h13 and H whose row 0 is row `row0` of the call
/// (the row of conv.row_scale it takes).
template <class T>
k::SwigluBody<T> swiglu_body(const ExecCtx& ctx, const SwigluConventions& conv, const T* h13, T* H, int64_t F,
                             int64_t row0) {
  return {h13, H, F, silu_rounding(ctx, conv), conv.row_scale ? conv.row_scale + row0 : nullptr};
}

/// H (n, F) = the SwiGLU activation of h13 (n, 2F) on the mirror's device,
/// rows [row0, row0 + n) of the call.
template <class T>
void swiglu_act_device(const ExecCtx& ctx, const T* h13, T* H, int64_t n, int64_t F, const SwigluConventions& conv,
                       int64_t row0) {
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  k::SwigluBody<T> b = swiglu_body(ctx, conv, static_cast<const T*>(m.in(h13, size_t(n * 2 * F) * sizeof(T))),
                                   static_cast<T*>(m.out(H, size_t(n * F) * sizeof(T))), F, row0);
  if (b.row_scale) b.row_scale = static_cast<const float*>(m.in(b.row_scale, size_t(n) * 4));
  m.device().run(b, n);
  m.wrote(H, size_t(n * F) * sizeof(T));
}

/// n values of dtype dt rounded to bf16 (ComputeDtype::bf16), on the host
/// or the mirror's device (dt is not bf16). Defined in experts_host.cpp.
std::vector<bf16> to_bf16(const ExecCtx& ctx, DType dt, const void* src, int64_t n);

/// n bf16 values rounded to dtype dt, on the host or the mirror's device.
void from_bf16(const ExecCtx& ctx, DType dt, const std::vector<bf16>& src, void* dst);

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

}  // namespace host_detail
}  // namespace moev
