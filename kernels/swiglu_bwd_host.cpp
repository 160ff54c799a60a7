// Host backward of the SwiGLU experts: per expert, row tiles recompute h1, h3
// and H, form dH, dh1, dh3 and dX; then weight-gradient tiles reduce over the
// expert's rows. Every reduction is one Eigen fp32 product of fixed shape
// (EIGEN_DONT_PARALLELIZE), so no sum depends on the thread count. With a
// mirror (ExecCtx::mirror) the same steps run on its device as GEMMs and
// k::SwigluBwdBody; both share the elementwise math (k::swiglu_grad_elem).
#include "swiglu_bwd_host.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "backward_bodies.h"
#include "device.h"

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

k::SiluGrad silu_grad(const ExecCtx& ctx) {
  return ctx.faults.has(Fault::swiglu_bwd_silu_grad) ? k::SiluGrad::sigmoid_only : k::SiluGrad::exact;
}

template <class T>
void backward_typed(const ExecCtx& ctx, const T* X, const T* dY, const int64_t* counts, int E_l, int64_t D,
                    int64_t F, const T* W1, const T* W3, const T* W2, T* dX, float* dW1, float* dW3, float* dW2) {
  const k::SiluGrad sg = silu_grad(ctx);
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
          const k::SwigluGradElem v =
              k::swiglu_grad_elem<T>(round_to<T>(h1(r, f)), round_to<T>(h3(r, f)), round_to<T>(dHf(r, f)), sg);
          const size_t at = size_t((r0 + r) * F + f);
          H[at] = v.H;
          dh3[at] = v.dh3;
          dh1[at] = v.dh1;
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

/// The backward on the mirror's device: per expert, the forward's GEMMs into
/// [h1 | h3] and dH = round(dY W2_j), the elementwise body into H and
/// [dh1 | dh3], dX = round([dh1 | dh3] [W1_j; W3_j]) as one GEMM (one fp32
/// accumulation over 2F, as the contract has it), and the three weight
/// gradients A^T B in fp32; each step an entry point (cuBLAS and a grid on a
/// GPU). The sums run in cuBLAS's order, within the GEMM tolerance of the
/// host's.
void backward_device(const ExecCtx& ctx, DType dt, const uint8_t* X, const uint8_t* dY, const int64_t* counts,
                     int E_l, int64_t D, int64_t F, const uint8_t* W1, const uint8_t* W3, const uint8_t* W2,
                     uint8_t* dX, float* dW1, float* dW3, float* dW2) {
  const size_t eb = dtype_bytes(dt), fd = size_t(F * D) * eb;
  int64_t rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  std::vector<uint8_t> h13(size_t(rows * 2 * F) * eb), dH(size_t(rows * F) * eb), H(size_t(rows * F) * eb),
      dh13(size_t(rows * 2 * F) * eb), w13(2 * fd);
  int64_t r0 = 0;
  for (int j = 0; j < E_l; r0 += counts[j], ++j) {
    const int64_t n = counts[j];
    const uint8_t* x = X + size_t(r0 * D) * eb;
    const uint8_t* dy = dY + size_t(r0 * D) * eb;
    uint8_t* h = h13.data() + size_t(r0 * 2 * F) * eb;
    uint8_t* g = dh13.data() + size_t(r0 * 2 * F) * eb;
    uint8_t* act = H.data() + size_t(r0 * F) * eb;
    if (n > 0) {
      uint8_t* gh = dH.data() + size_t(r0 * F) * eb;
      gemm_nt(ctx, dt, x, n, D, D, W1 + j * fd, F, h, 2 * F);
      gemm_nt(ctx, dt, x, n, D, D, W3 + j * fd, F, h + size_t(F) * eb, 2 * F);
      gemm_nn(ctx, dt, dy, n, D, D, W2 + j * fd, F, gh, F);
      dispatch_dtype(dt, [&](auto tag) {
        using T = decltype(tag);
        Mirror& m = *ctx.mirror;
        Mirror::Scope scope{m};
        const size_t nf = size_t(n * F) * sizeof(T);
        m.device().run(k::SwigluBwdBody<T>{static_cast<const T*>(m.in(h, 2 * nf)), static_cast<const T*>(m.in(gh, nf)),
                                           static_cast<T*>(m.out(act, nf)), static_cast<T*>(m.out(g, 2 * nf)), F,
                                           silu_grad(ctx)},
                       n);
        m.wrote(act, nf);
        m.wrote(g, 2 * nf);
      });
      std::memcpy(w13.data(), W1 + j * fd, fd);
      std::memcpy(w13.data() + fd, W3 + j * fd, fd);
      gemm_nn(ctx, dt, g, n, 2 * F, 2 * F, w13.data(), D, dX + size_t(r0 * D) * eb, D);
    }
    gemm_tn_f32(ctx, dt, g, n, F, 2 * F, x, D, D, dW1 + j * F * D);
    gemm_tn_f32(ctx, dt, g + size_t(F) * eb, n, F, 2 * F, x, D, D, dW3 + j * F * D);
    gemm_tn_f32(ctx, dt, dy, n, D, D, act, F, F, dW2 + j * D * F);
  }
}

}  // namespace

void gemm_tn_f32(const ExecCtx& ctx, DType dt, const void* A, int64_t rows, int64_t m, int64_t lda, const void* B,
                 int64_t n, int64_t ldb, float* C) {
  if (m == 0 || n == 0) return;
  const size_t cb = size_t(m * n) * 4;
  if (ctx.mirror) {
    Mirror& mi = *ctx.mirror;
    Mirror::Scope scope{mi};
    void* c = mi.out(C, cb);
    if (rows == 0) {
      mi.device().fill(c, 0, cb);  // fp32 0 is all-zero bytes
    } else {
      const size_t eb = dtype_bytes(dt);
      // the byte extents of the strided blocks: the last row ends at its last column
      mi.device().gemm_tn_f32(dt, mi.in(A, size_t((rows - 1) * lda + m) * eb), rows, m, lda,
                              mi.in(B, size_t((rows - 1) * ldb + n) * eb), n, ldb, static_cast<float*>(c));
    }
    mi.wrote(C, cb);
    return;
  }
  if (rows == 0) {
    std::fill(C, C + m * n, 0.f);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    MatF a(rows, m), b(rows, n);
    for (int64_t r = 0; r < rows; ++r) {
      widen(static_cast<const T*>(A) + r * lda, m, &a(r, 0));
      widen(static_cast<const T*>(B) + r * ldb, n, &b(r, 0));
    }
    const int64_t tiles = (m + kTile - 1) / kTile;
    host_run(ctx, tiles, [&](int64_t t, int, int) {
      const int64_t i0 = t * kTile, mm = std::min(kTile, m - i0);
      MapF(C + i0 * n, mm, n).noalias() = a.middleCols(i0, mm).transpose() * b;
    });
  });
}

void experts_swiglu_backward(const ExecCtx& ctx, DType dt, const void* X, const void* dY, const int64_t* counts,
                             int E_l, int64_t D, int64_t F, const void* W1, const void* W3, const void* W2, void* dX,
                             float* dW1, float* dW3, float* dW2, SwigluConventions conv) {
  if (conv.rounding != k::SiluRounding::fused)
    throw std::invalid_argument("experts_swiglu_backward: experts.rounding torchtitan has no backward contract");
  if (conv.compute != ComputeDtype::act)
    throw std::invalid_argument("experts_swiglu_backward: experts.compute_dtype bf16 has no backward contract");
  if (ctx.mirror) {
    backward_device(ctx, dt, static_cast<const uint8_t*>(X), static_cast<const uint8_t*>(dY), counts, E_l, D, F,
                    static_cast<const uint8_t*>(W1), static_cast<const uint8_t*>(W3), static_cast<const uint8_t*>(W2),
                    static_cast<uint8_t*>(dX), dW1, dW3, dW2);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    backward_typed<T>(ctx, static_cast<const T*>(X), static_cast<const T*>(dY), counts, E_l, D, F,
                      static_cast<const T*>(W1), static_cast<const T*>(W3), static_cast<const T*>(W2),
                      static_cast<T*>(dX), dW1, dW3, dW2);
  });
}

}  // namespace moev
