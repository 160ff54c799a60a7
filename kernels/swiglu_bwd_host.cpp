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
#include "moe_host_detail.h"

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

/// src (in O) widened to fp32 after a rounding to the compute type T: the
/// operands of the GEMMs under experts.compute_dtype bf16 (exact when T = O).
template <class T, class O>
void widen_to(const O* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = round_to<T>(to_float(src[i]));
}

k::SiluGrad silu_grad(const ExecCtx& ctx) {
  return ctx.faults.has(Fault::swiglu_bwd_silu_grad) ? k::SiluGrad::sigmoid_only : k::SiluGrad::exact;
}

/// The rounding rules of one backward (docs/contract.md §13): the fused
/// activation with fp32 weight gradients (the default), or autograd's on
/// compute-dtype tensors (experts.rounding torchtitan or experts.compute_dtype
/// bf16): dX from two GEMMs each rounded (torchtitan), weight gradients
/// rounded to the compute dtype and then to act.
struct BwdRules {
  k::SiluGrad sg = k::SiluGrad::exact;
  k::SiluRounding rounding = k::SiluRounding::fused;
  bool fused_grad = false;   // the planted fault swiglu_bwd_fused_rounding
  bool split_dx = false;     // dX = round(round(dh1 W1) + round(dh3 W3))
  bool round_wgrad = false;  // dW = round_act(round_compute(sum))
  // score_on_hidden (conv.row_scale): the planted faults hidden_grad_unscaled
  // and score_grad_scaled_hidden
  bool scale_grad_kept = true, ds_from_scaled = false;
};

BwdRules rules_of(const ExecCtx& ctx, const SwigluConventions& conv) {
  BwdRules r;
  r.sg = silu_grad(ctx);
  r.rounding = conv.rounding;
  const bool unfused = conv.rounding == k::SiluRounding::rounded_to_act;
  r.fused_grad = unfused && ctx.faults.has(Fault::swiglu_bwd_fused_rounding);
  r.split_dx = unfused && !conv.w13_fused;
  r.round_wgrad = (unfused || conv.compute == ComputeDtype::bf16) && !ctx.faults.has(Fault::swiglu_bwd_wgrad_fp32);
  r.scale_grad_kept = !ctx.faults.has(Fault::hidden_grad_unscaled);
  r.ds_from_scaled = ctx.faults.has(Fault::score_grad_scaled_hidden);
  return r;
}

/// The expert's operands, widened to fp32 once (rounded to T first), and its
/// intermediates (values of T in fp32).
struct ExpertBufs {
  std::vector<float> x, dy, w1, w3, w2, dh1, dh3, H;
};

/// Row pass of one expert's n rows (tile t owns rows [t*kTile, ...)):
/// h1, h3, dH in fp32 rounded to T, the elementwise step, and dX in O.
/// With row scores sc (score_on_hidden) the GEMM's dH is dH', the step
/// starts from k::hidden_grad, dS gets each row's score gradient (fp32, f
/// ascending, from the unscaled H) and b.H the scaled H', as
/// k::HiddenScoreGradBody on a device.
template <class T, class O>
void row_pass(const ExecCtx& ctx, const BwdRules& ru, ExpertBufs& b, int64_t n, int64_t D, int64_t F, O* dX,
              const float* sc, float* dS) {
  const CMapF mw1(b.w1.data(), F, D), mw3(b.w3.data(), F, D), mw2(b.w2.data(), D, F);
  const int64_t tiles = (n + kTile - 1) / kTile;
  host_run(ctx, tiles, [&](int64_t t, int, int) {
    const int64_t r0 = t * kTile, m = std::min(kTile, n - r0);
    const CMapF xt(b.x.data() + r0 * D, m, D), dyt(b.dy.data() + r0 * D, m, D);
    const MatF h1 = xt * mw1.transpose(), h3 = xt * mw3.transpose(), dHf = dyt * mw2;
    for (int64_t r = 0; r < m; ++r) {
      const float s = sc ? sc[r0 + r] : 1.f;
      float ds = 0.f;
      for (int64_t f = 0; f < F; ++f) {
        const float gp = round_to<T>(dHf(r, f));
        const float g = sc && ru.scale_grad_kept ? k::hidden_grad<T>(gp, s) : gp;
        const k::SwigluGradElem v =
            k::swiglu_grad_elem<T>(round_to<T>(h1(r, f)), round_to<T>(h3(r, f)), g, ru.sg, ru.rounding, ru.fused_grad);
        const size_t at = size_t((r0 + r) * F + f);
        b.H[at] = v.H;
        if (sc) {
          const float hs = round_to<T>(v.H * s);
          ds += gp * (ru.ds_from_scaled ? hs : v.H);
          b.H[at] = hs;
        }
        b.dh3[at] = v.dh3;
        b.dh1[at] = v.dh1;
      }
      if (sc) dS[r0 + r] = ds;
    }
    const CMapF g1(b.dh1.data() + r0 * F, m, F), g3(b.dh3.data() + r0 * F, m, F);
    O* out = dX + r0 * D;
    if (ru.split_dx) {
      // x feeds two GEMMs: each gradient rounded to T (then to O), summed in fp32, rounded to O
      const MatF A = g1 * mw1, B = g3 * mw3;
      for (int64_t i = 0; i < m * D; ++i)
        out[i] = from_float<O>(round_to<O>(round_to<T>(A.data()[i])) + round_to<O>(round_to<T>(B.data()[i])));
    } else {
      const MatF dx = g1 * mw1 + g3 * mw3;  // (m, D): one fp32 sum over 2F terms
      for (int64_t i = 0; i < m * D; ++i) out[i] = from_float<O>(round_to<T>(dx.data()[i]));
    }
  });
}

/// Reduction pass over one expert's n rows: item i < fa writes rows of dW1
/// and dW3 (tile of F), the rest rows of dW2 (tile of D); each value rounded
/// to T, then O, under round_wgrad.
template <class T, class O>
void wgrad_pass(const ExecCtx& ctx, const BwdRules& ru, const ExpertBufs& b, int64_t n, int64_t D, int64_t F,
                float* gw1, float* gw3, float* gw2) {
  const CMapF mx(b.x.data(), n, D), mdy(b.dy.data(), n, D), mg1(b.dh1.data(), n, F), mg3(b.dh3.data(), n, F),
      mH(b.H.data(), n, F);
  const int64_t fa = (F + kTile - 1) / kTile, da = (D + kTile - 1) / kTile;
  auto round_block = [&](float* p, int64_t count) {
    if (ru.round_wgrad)
      for (int64_t i = 0; i < count; ++i) p[i] = round_to<O>(round_to<T>(p[i]));
  };
  host_run(ctx, fa + da, [&](int64_t it, int, int) {
    if (it < fa) {
      const int64_t f0 = it * kTile, m = std::min(kTile, F - f0);
      MapF(gw1 + f0 * D, m, D).noalias() = mg1.middleCols(f0, m).transpose() * mx;
      MapF(gw3 + f0 * D, m, D).noalias() = mg3.middleCols(f0, m).transpose() * mx;
      round_block(gw1 + f0 * D, m * D);
      round_block(gw3 + f0 * D, m * D);
    } else {
      const int64_t d0 = (it - fa) * kTile, m = std::min(kTile, D - d0);
      MapF(gw2 + d0 * F, m, F).noalias() = mdy.middleCols(d0, m).transpose() * mH;
      round_block(gw2 + d0 * F, m * F);
    }
  });
}

/// The host backward: operands in O (the activation type), GEMMs on their
/// values rounded to T (the compute type; T = O unless compute_dtype bf16).
template <class T, class O>
void backward_typed(const ExecCtx& ctx, const BwdRules& ru, const O* X, const O* dY, const int64_t* counts, int E_l,
                    int64_t D, int64_t F, const O* W1, const O* W3, const O* W2, O* dX, float* dW1, float* dW3,
                    float* dW2, const float* row_scale, float* dS) {
  int64_t row = 0;
  ExpertBufs b;
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
    for (auto* v : {&b.x, &b.dy}) v->resize(size_t(n * D));
    for (auto* v : {&b.w1, &b.w3, &b.w2}) v->resize(size_t(F * D));
    for (auto* v : {&b.dh1, &b.dh3, &b.H}) v->resize(size_t(n * F));
    widen_to<T>(X + row * D, n * D, b.x.data());
    widen_to<T>(dY + row * D, n * D, b.dy.data());
    widen_to<T>(W1 + int64_t(j) * F * D, F * D, b.w1.data());
    widen_to<T>(W3 + int64_t(j) * F * D, F * D, b.w3.data());
    widen_to<T>(W2 + int64_t(j) * D * F, D * F, b.w2.data());
    row_pass<T>(ctx, ru, b, n, D, F, dX + row * D, row_scale ? row_scale + row : nullptr, dS ? dS + row : nullptr);
    wgrad_pass<T, O>(ctx, ru, b, n, D, F, gw1, gw3, gw2);
    row += n;
  }
}

/// n fp32 values on the mirror's device rounded to T, then to O, in place
/// (the weight gradients under BwdRules::round_wgrad).
void round_device(const ExecCtx& ctx, DType ct, DType dt, float* v, int64_t n) {
  if (n == 0) return;
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  float* d = static_cast<float*>(m.out(v, size_t(n) * 4));
  for (DType t : {ct, dt})
    dispatch_dtype(t, [&](auto tag) { m.device().run(RoundBody<decltype(tag)>{d, n}, chunks(n)); });
  m.wrote(v, size_t(n) * 4);
}

/// out = round_T(a + b) elementwise on the device (GradSumBody), a and b n
/// values of In: T (split_dx's two rounded gradients) or float (the fused
/// dX's fp32 halves, rounded once).
template <class T, class In>
void device_grad_sum(const ExecCtx& ctx, const In* a, const In* b, void* out, int64_t n) {
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  const size_t in_bytes = size_t(n) * sizeof(In), out_bytes = size_t(n) * sizeof(T);
  m.device().run(k::GradSumBody<T, In>{static_cast<const In*>(m.in(a, in_bytes)),
                                       static_cast<const In*>(m.in(b, in_bytes)),
                                       static_cast<T*>(m.out(out, out_bytes)), n},
                 chunks(n));
  m.wrote(out, out_bytes);
}

/// On the mirror's device, all in the compute type ct, each step for every
/// expert at once (issue 36 item 3): the forward's GEMMs into [h1 | h3] and
/// dH = round(dY W2_j) as one grouped GEMM; the elementwise body into H and
/// [dh1 | dh3] over all rows; dX; the three weight gradients A^T B in fp32
/// as one grouped GEMM (rounded under round_wgrad). dX in ct: the fused
/// [dh1 | dh3] [W1_j; W3_j] (one fp32 accumulation over 2F, one rounding) as
/// the fp32 partial sums of its two halves, dh1 W1_j and dh3 W3_j, in one
/// grouped GEMM (GemmOp::nn_f32: W1_j and W3_j are separate blocks, and
/// stacking them for every expert would double their device memory), added
/// and rounded once by GradSumBody<T, float>; or under split_dx the two
/// GEMMs into dx (the W1 part) and dx3 (the W3 part), each rounded, as one
/// grouped GEMM, summed by the caller. With row scores
/// (score_on_hidden) SwigluBwdBody starts from the scaled gradient and
/// HiddenScoreGradBody then writes dS and turns H into H'.
void device_experts(const ExecCtx& ctx, DType ct, DType dt, const BwdRules& ru, const uint8_t* X, const uint8_t* dY,
                    const int64_t* counts, int E_l, int64_t D, int64_t F, const uint8_t* W1, const uint8_t* W3,
                    const uint8_t* W2, uint8_t* dx, uint8_t* dx3, float* dW1, float* dW3, float* dW2,
                    const float* row_scale, float* dS) {
  const size_t eb = dtype_bytes(ct), fd = size_t(F * D) * eb;
  int64_t rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  const size_t rd = size_t(rows * D) * eb, rf = size_t(rows * F) * eb, wb = size_t(E_l) * fd;
  const size_t wgb = size_t(E_l) * size_t(F * D) * 4;
  std::vector<uint8_t> h13(2 * rf), dH(rf), H(rf), dh13(2 * rf);
  // the fused dX's fp32 halves (rows, D) each
  std::vector<float> dxf(ru.split_dx ? 0 : size_t(rows * D)), dx3f(dxf.size());
  std::vector<GemmJob> fwd, dxs, wg;
  int64_t r0 = 0;
  for (int j = 0; j < E_l; r0 += counts[j], ++j) {
    const int64_t n = counts[j];
    const uint8_t* x = X + size_t(r0 * D) * eb;
    const uint8_t* dy = dY + size_t(r0 * D) * eb;
    uint8_t* h = h13.data() + size_t(r0 * 2 * F) * eb;
    uint8_t* g = dh13.data() + size_t(r0 * 2 * F) * eb;
    uint8_t* act = H.data() + size_t(r0 * F) * eb;
    if (n > 0) {
      fwd.push_back({GemmOp::nt, x, W1 + j * fd, h, n, D, F, D, 0, 2 * F});
      fwd.push_back({GemmOp::nt, x, W3 + j * fd, h + size_t(F) * eb, n, D, F, D, 0, 2 * F});
      fwd.push_back({GemmOp::nn, dy, W2 + j * fd, dH.data() + size_t(r0 * F) * eb, n, D, F, D, 0, F});
      if (ru.split_dx) {
        dxs.push_back({GemmOp::nn, g, W1 + j * fd, dx + size_t(r0 * D) * eb, n, F, D, 2 * F, 0, D});
        dxs.push_back({GemmOp::nn, g + size_t(F) * eb, W3 + j * fd, dx3 + size_t(r0 * D) * eb, n, F, D, 2 * F, 0, D});
      } else {
        dxs.push_back({GemmOp::nn_f32, g, W1 + j * fd, dxf.data() + r0 * D, n, F, D, 2 * F, 0, D});
        dxs.push_back({GemmOp::nn_f32, g + size_t(F) * eb, W3 + j * fd, dx3f.data() + r0 * D, n, F, D, 2 * F, 0, D});
      }
    }
    // rows == 0 gives a zero gradient (gemm_group fills it)
    wg.push_back({GemmOp::tn_f32, g, x, dW1 + j * F * D, n, F, D, 2 * F, D, 0});
    wg.push_back({GemmOp::tn_f32, g + size_t(F) * eb, x, dW3 + j * F * D, n, F, D, 2 * F, D, 0});
    wg.push_back({GemmOp::tn_f32, dy, act, dW2 + j * D * F, n, D, F, D, F, 0});
  }
  gemm_group(ctx, ct, fwd, {{X, rd}, {dY, rd}, {W1, wb}, {W3, wb}, {W2, wb}}, {{h13.data(), 2 * rf}, {dH.data(), rf}});
  if (rows > 0)
    dispatch_dtype(ct, [&](auto tag) {
      using T = decltype(tag);
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      const float* s = row_scale ? static_cast<const float*>(m.in(row_scale, size_t(rows) * 4)) : nullptr;
      const T* dHp = static_cast<const T*>(m.in(dH.data(), rf));
      T* Hd = static_cast<T*>(m.out(H.data(), rf));
      m.device().run(k::SwigluBwdBody<T>{static_cast<const T*>(m.in(h13.data(), 2 * rf)), dHp, Hd,
                                         static_cast<T*>(m.out(dh13.data(), 2 * rf)), F, ru.sg, ru.rounding,
                                         ru.fused_grad, s, ru.scale_grad_kept},
                     rows);
      if (s) {
        float* ds = static_cast<float*>(m.out(dS, size_t(rows) * 4));
        m.device().run(k::HiddenScoreGradBody<T>{dHp, Hd, s, ds, F, ru.ds_from_scaled}, rows);
        m.wrote(dS, size_t(rows) * 4);
      }
      m.wrote(H.data(), rf);
      m.wrote(dh13.data(), 2 * rf);
    });
  if (ru.split_dx) {
    gemm_group(ctx, ct, dxs, {{dh13.data(), 2 * rf}, {W1, wb}, {W3, wb}}, {{dx, rd}, {dx3, rd}});
  } else if (rows > 0) {
    const size_t fb = dxf.size() * 4;
    gemm_group(ctx, ct, dxs, {{dh13.data(), 2 * rf}, {W1, wb}, {W3, wb}}, {{dxf.data(), fb}, {dx3f.data(), fb}});
    dispatch_dtype(ct, [&](auto tag) { device_grad_sum<decltype(tag)>(ctx, dxf.data(), dx3f.data(), dx, rows * D); });
  }
  gemm_group(ctx, ct, wg, {{dh13.data(), 2 * rf}, {X, rd}, {dY, rd}, {H.data(), rf}},
             {{dW1, wgb}, {dW3, wgb}, {dW2, wgb}});
  if (ru.round_wgrad)
    for (float* w : {dW1, dW3, dW2}) round_device(ctx, ct, dt, w, int64_t(E_l) * F * D);
}

/// The backward on the mirror's device (each step an entry point: cuBLAS and
/// a grid on a GPU; the sums run in cuBLAS's order, within the contract's
/// bounds of the host's). Under compute_dtype bf16 with another act, the
/// operands are converted to bf16 first and dX back (ConvertBody); under
/// split_dx the two GEMM gradients, each in act, are added by GradSumBody.
void backward_device(const ExecCtx& ctx, DType dt, const SwigluConventions& conv, const BwdRules& ru, const void* X,
                     const void* dY, const int64_t* counts, int E_l, int64_t D, int64_t F, const void* W1,
                     const void* W3, const void* W2, void* dX, float* dW1, float* dW3, float* dW2, float* dS) {
  using host_detail::from_bf16;
  using host_detail::to_bf16;
  int64_t rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  const bool convert = conv.compute == ComputeDtype::bf16 && dt != DType::bf16;
  const DType ct = convert ? DType::bf16 : dt;
  const size_t n = size_t(rows * D), wn = size_t(int64_t(E_l) * F * D);
  std::vector<bf16> xb, dyb, w1b, w3b, w2b;
  if (convert) {
    xb = to_bf16(ctx, dt, X, int64_t(n));
    dyb = to_bf16(ctx, dt, dY, int64_t(n));
    w1b = to_bf16(ctx, dt, W1, int64_t(wn));
    w3b = to_bf16(ctx, dt, W3, int64_t(wn));
    w2b = to_bf16(ctx, dt, W2, int64_t(wn));
  }
  auto pick = [&](const std::vector<bf16>& v, const void* p) {
    return convert ? reinterpret_cast<const uint8_t*>(v.data()) : static_cast<const uint8_t*>(p);
  };
  std::vector<bf16> dxb(convert ? n : 0), dx3b(convert && ru.split_dx ? n : 0);
  std::vector<uint8_t> dx3(!convert && ru.split_dx ? n * dtype_bytes(dt) : 0), sum_a, sum_b;
  uint8_t* dx = convert ? reinterpret_cast<uint8_t*>(dxb.data()) : static_cast<uint8_t*>(dX);
  uint8_t* dx3p = convert ? reinterpret_cast<uint8_t*>(dx3b.data()) : dx3.data();
  device_experts(ctx, ct, dt, ru, pick(xb, X), pick(dyb, dY), counts, E_l, D, F, pick(w1b, W1), pick(w3b, W3),
                 pick(w2b, W2), dx, dx3p, dW1, dW3, dW2, conv.row_scale, dS);
  if (!ru.split_dx) {
    if (convert) from_bf16(ctx, dt, dxb, dX);
    return;
  }
  // the two GEMM gradients in act, then their sum
  const uint8_t* a = dx;
  const uint8_t* b = dx3p;
  if (convert) {
    sum_a.resize(n * dtype_bytes(dt));
    sum_b.resize(n * dtype_bytes(dt));
    from_bf16(ctx, dt, dxb, sum_a.data());
    from_bf16(ctx, dt, dx3b, sum_b.data());
    a = sum_a.data();
    b = sum_b.data();
  }
  if (n == 0) return;
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    device_grad_sum<T>(ctx, reinterpret_cast<const T*>(a), reinterpret_cast<const T*>(b), dX, int64_t(n));
  });
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
      mi.device().fill_timed(c, 0, cb);  // fp32 0 is all-zero bytes
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
                             float* dW1, float* dW3, float* dW2, SwigluConventions conv, float* dS) {
  if (conv.row_scale && !dS) throw std::invalid_argument("experts_swiglu_backward: a row scale needs dS");
  const BwdRules ru = rules_of(ctx, conv);
  if (ctx.mirror) {
    backward_device(ctx, dt, conv, ru, X, dY, counts, E_l, D, F, W1, W3, W2, dX, dW1, dW3, dW2, dS);
    return;
  }
  dispatch_dtype(dt, [&](auto tag) {
    using O = decltype(tag);
    auto run = [&](auto ctag) {
      using T = decltype(ctag);
      backward_typed<T, O>(ctx, ru, static_cast<const O*>(X), static_cast<const O*>(dY), counts, E_l, D, F,
                           static_cast<const O*>(W1), static_cast<const O*>(W3), static_cast<const O*>(W2),
                           static_cast<O*>(dX), dW1, dW3, dW2, conv.row_scale, dS);
    };
    if (conv.compute == ComputeDtype::bf16) run(bf16{});
    else run(O{});
  });
}

}  // namespace moev
