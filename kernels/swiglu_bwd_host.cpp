// Host backward of the SwiGLU experts: per expert, row tiles recompute h1, h3
// and H, form dH, dh1, dh3 and dX; then weight-gradient tiles reduce over the
// expert's rows. Every reduction is one Eigen fp32 product of fixed shape
// (EIGEN_DONT_PARALLELIZE), so no sum depends on the thread count.
#include "swiglu_bwd_host.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace moev {
namespace {

constexpr int64_t kTile = 64;  // fixed tile of rows (row pass) or of weight rows (reduction pass)

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapF = Eigen::Map<MatF>;
using CMapF = Eigen::Map<const MatF>;

template <class T>
void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <class T>
float rnd(float v) {
  return to_float(from_float<T>(v));
}

template <class T>
void backward_typed(const ExecCtx& ctx, const T* X, const T* dY, const int64_t* counts, int E_l, int64_t D,
                    int64_t F, const T* W1, const T* W3, const T* W2, T* dX, float* dW1, float* dW3, float* dW2) {
  const bool fault = ctx.faults.has(Fault::swiglu_bwd_silu_grad);
  int64_t row = 0;
  std::vector<float> x, dy, w1, w3, w2, dh1, dh3, H;
  for (int j = 0; j < E_l; ++j) {
    const int64_t n = counts[j];
    float* gw1 = dW1 + int64_t(j) * F * D;
    float* gw3 = dW3 + int64_t(j) * F * D;
    float* gw2 = dW2 + int64_t(j) * D * F;
    if (n == 0) {
      std::fill(gw1, gw1 + F * D, 0.f);
      std::fill(gw3, gw3 + F * D, 0.f);
      std::fill(gw2, gw2 + D * F, 0.f);
      continue;
    }
    // The expert's operands widened to fp32 once (exact).
    x.resize(size_t(n * D));
    dy.resize(size_t(n * D));
    w1.resize(size_t(F * D));
    w3.resize(size_t(F * D));
    w2.resize(size_t(D * F));
    dh1.resize(size_t(n * F));
    dh3.resize(size_t(n * F));
    H.resize(size_t(n * F));
    widen(X + row * D, n * D, x.data());
    widen(dY + row * D, n * D, dy.data());
    widen(W1 + int64_t(j) * F * D, F * D, w1.data());
    widen(W3 + int64_t(j) * F * D, F * D, w3.data());
    widen(W2 + int64_t(j) * D * F, D * F, w2.data());
    const CMapF mw1(w1.data(), F, D), mw3(w3.data(), F, D), mw2(w2.data(), D, F);
    // Row pass: tile t owns rows [t*kTile, ...) of the expert.
    const int64_t tiles = (n + kTile - 1) / kTile;
    host_run(ctx, tiles, [&](int64_t t, int, int) {
      const int64_t r0 = t * kTile, m = std::min(kTile, n - r0);
      const CMapF xt(x.data() + r0 * D, m, D), dyt(dy.data() + r0 * D, m, D);
      const MatF h1 = xt * mw1.transpose(), h3 = xt * mw3.transpose(), dHf = dyt * mw2;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t f = 0; f < F; ++f) {
          const float a = rnd<T>(h1(r, f)), b = rnd<T>(h3(r, f)), dH = rnd<T>(dHf(r, f));
          const float e = std::exp(-a);
          const float sig = 1.f / (1.f + e);
          const float silu = a / (1.f + e);  // the forward's formulation (kernels/bodies.h)
          const float dsilu = fault ? sig : sig * (1.f + a * (1.f - sig));
          const size_t at = size_t((r0 + r) * F + f);
          H[at] = rnd<T>(silu * b);
          dh3[at] = rnd<T>(dH * silu);
          dh1[at] = rnd<T>(dH * b * dsilu);
        }
      const CMapF g1(dh1.data() + r0 * F, m, F), g3(dh3.data() + r0 * F, m, F);
      const MatF dx = g1 * mw1 + g3 * mw3;  // (m, D): one fp32 sum over 2F terms
      T* out = dX + (row + r0) * D;
      for (int64_t i = 0; i < m * D; ++i) out[i] = from_float<T>(dx.data()[i]);
    });
    // Reduction pass over the expert's n rows: item i < fa writes rows of
    // dW1 and dW3 (tile of F), the rest rows of dW2 (tile of D).
    const CMapF mx(x.data(), n, D), mdy(dy.data(), n, D), mg1(dh1.data(), n, F), mg3(dh3.data(), n, F),
        mH(H.data(), n, F);
    const int64_t fa = (F + kTile - 1) / kTile, da = (D + kTile - 1) / kTile;
    host_run(ctx, fa + da, [&](int64_t it, int, int) {
      if (it < fa) {
        const int64_t f0 = it * kTile, m = std::min(kTile, F - f0);
        MapF(gw1 + f0 * D, m, D).noalias() = mg1.middleCols(f0, m).transpose() * mx;
        MapF(gw3 + f0 * D, m, D).noalias() = mg3.middleCols(f0, m).transpose() * mx;
      } else {
        const int64_t d0 = (it - fa) * kTile, m = std::min(kTile, D - d0);
        MapF(gw2 + d0 * F, m, F).noalias() = mdy.middleCols(d0, m).transpose() * mH;
      }
    });
    row += n;
  }
}

}  // namespace

void experts_swiglu_backward(const ExecCtx& ctx, DType dt, const void* X, const void* dY, const int64_t* counts,
                             int E_l, int64_t D, int64_t F, const void* W1, const void* W3, const void* W2, void* dX,
                             float* dW1, float* dW3, float* dW2, SwigluConventions conv) {
  if (conv.rounding != k::SiluRounding::fused)
    throw std::invalid_argument("experts_swiglu_backward: experts.rounding torchtitan has no backward contract");
  if (conv.compute != ComputeDtype::act)
    throw std::invalid_argument("experts_swiglu_backward: experts.compute_dtype bf16 has no backward contract");
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    backward_typed<T>(ctx, static_cast<const T*>(X), static_cast<const T*>(dY), counts, E_l, D, F,
                      static_cast<const T*>(W1), static_cast<const T*>(W3), static_cast<const T*>(W2),
                      static_cast<T*>(dX), dW1, dW3, dW2);
  });
}

}  // namespace moev
