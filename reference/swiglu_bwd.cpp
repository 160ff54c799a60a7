// Reference backward of the SwiGLU experts (docs/contract.md §8, §13): the
// gradients of swiglu_experts for the loss <Y, dY> under every convention
// come from swiglu_backward_autograd (reference/swiglu_bwd_autograd.cpp, its
// enumeration of the rounding points); this file holds their error scales
// for the end-to-end checks (swiglu_backward_magnitude). Written from the
// chain rule, independently of kernels/swiglu_bwd_host.cpp.
#include <Eigen/Core>
#include <cmath>
#include <stdexcept>

#include "blocked.h"
#include "reference.h"

namespace ref {
namespace {

/// Rows [row, row + n) of a (rows, cols) buffer, each value rounded to act.
MatD block(Act act, const Vec& v, int64_t row, int64_t n, int64_t cols) {
  MatD m(n, cols);
  for (int64_t i = 0; i < n * cols; ++i) m.data()[i] = round_act(act, v[size_t(row * cols + i)]);
  return m;
}

/// Expert j's (a, b) weight matrix, rounded to act.
MatD weight(Act act, WeightView w, size_t j, int64_t a, int64_t b) {
  std::vector<float> v(static_cast<size_t>(a * b));
  w.decode(j * size_t(a * b), a * b, v.data());
  MatD m(a, b);
  for (int64_t i = 0; i < a * b; ++i) m.data()[i] = round_act(act, v[size_t(i)]);
  return m;
}

/// sigmoid, silu' and silu'' of a in fp64.
struct SiluDerivs {
  double sig, s, s1, s2;
};
SiluDerivs silu_derivs(double a) {
  const double sig = 1.0 / (1.0 + std::exp(-a));
  return {sig, a * sig, sig * (1.0 + a * (1.0 - sig)), sig * (1.0 - sig) * (2.0 + a * (1.0 - 2.0 * sig))};
}

void store(Vec& out, size_t at, const MatD& m) {
  for (int64_t i = 0; i < m.size(); ++i) out[at + size_t(i)] = f32(m.data()[i]);
}

/// The error scales of the gradients (swiglu_backward_magnitude), expert by
/// expert on `threads` threads: sums of |terms| as fp32 products of
/// absolute values made upper bounds (reference/blocked.h), whose
/// first-order terms use fp64 h1, h3 and dY W2 of the inputs as given. With
/// a score on the hidden (row_scale), the magnitudes carry |s| where dH and
/// H' do. The score gradient has no magnitude here: its half-width is
/// swiglu_backward_autograd's.
SwigluGrads magnitudes(const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F, WeightView W1,
                       WeightView W3, WeightView W2, int threads, const float* row_scale) {
  const Act act = Act::fp32;  // the values as they are
  const int E_l = int(counts.size());
  std::vector<int64_t> first(counts.size(), 0);
  int64_t rows = 0;
  for (size_t j = 0; j < counts.size(); ++j) first[j] = rows, rows += counts[j];
  SwigluGrads g;
  g.dX.assign(dY.size(), 0.f);
  const size_t wsize = size_t(E_l) * size_t(F * D);
  for (Vec* v : {&g.dW1, &g.dW3, &g.dW2}) v->assign(wsize, 0.f);
  parallel_items(E_l, threads, [&](int64_t j) {
    const int64_t n = counts[size_t(j)], row = first[size_t(j)];
    if (n == 0) return;  // its weight gradients stay exactly 0
    const float* sc = row_scale ? row_scale + row : nullptr;  // the rows' scores on the hidden, or none
    const MatD x = block(act, X, row, n, D), dy = block(act, dY, row, n, D);
    const MatD w1 = weight(act, W1, size_t(j), F, D), w3 = weight(act, W3, size_t(j), F, D),
               w2 = weight(act, W2, size_t(j), D, F);
    const MatD h1 = x * w1.transpose(), h3 = x * w3.transpose(), dHx = dy * w2;  // (n, F)
    const MatF ax = x.cwiseAbs().cast<float>(), ady = dy.cwiseAbs().cast<float>();  // exact: act values
    const MatF a1 = w1.cwiseAbs().cast<float>(), a3 = w3.cwiseAbs().cast<float>(), a2 = w2.cwiseAbs().cast<float>();
    const MatD m1 = abs_product_nt(ax, a1), m3 = abs_product_nt(ax, a3), mdH = abs_product_nn(ady, a2);
    // E1, E3: effective magnitudes of dh1 and dh3 (their terms' sizes plus
    // the first-order effect of an error of m1 in h1, m3 in h3, mdH in dH);
    // Heff the same for H.
    MatD E1(n, F), E3(n, F), Heff(n, F);
    for (int64_t i = 0; i < n * F; ++i) {
      // with a score on the hidden, dH = s dH' and H' = s H: both scale by |s|
      const double w = sc ? std::fabs(double(sc[i / F])) : 1.0;
      const double a = h1.data()[i], b = h3.data()[i], d = w * dHx.data()[i], md = w * mdH.data()[i];
      const SiluDerivs s = silu_derivs(a);
      E3.data()[i] = md * std::fabs(s.s) + std::fabs(d * s.s1) * m1.data()[i];
      E1.data()[i] = md * std::fabs(b * s.s1) + std::fabs(d * s.s1) * m3.data()[i] +
                     std::fabs(d * b * s.s2) * m1.data()[i];
      Heff.data()[i] = std::fabs(s.s * b) + std::fabs(s.s1 * b) * m1.data()[i] + std::fabs(s.s) * m3.data()[i];
      Heff.data()[i] *= w;
    }
    const MatF e1 = abs_f32_up(E1), e3 = abs_f32_up(E3), he = abs_f32_up(Heff);
    const MatD dx = abs_product_nn(e1, a1) + abs_product_nn(e3, a3);
    for (int64_t i = 0; i < n * D; ++i) g.dX[size_t(row * D + i)] = f32(dx.data()[i]);
    store(g.dW1, size_t(j) * size_t(F * D), abs_product_nn(MatF(e1.transpose()), ax));
    store(g.dW3, size_t(j) * size_t(F * D), abs_product_nn(MatF(e3.transpose()), ax));
    store(g.dW2, size_t(j) * size_t(D * F), abs_product_nn(MatF(ady.transpose()), he));
  });
  return g;
}

}  // namespace

SwigluGrads swiglu_experts_backward(Act act, const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                    WeightView W1, WeightView W3, WeightView W2, SiluRounding rounding,
                                    Compute compute, int threads, bool bounds, bool w13_fused, HiddenScale hs) {
  // Every convention's middle values and half-widths come from one
  // enumeration of its rounding points (swiglu_backward_autograd).
  return swiglu_backward_autograd(act, X, dY, counts, D, F, W1, W3, W2, rounding, compute, threads, bounds, w13_fused,
                                  hs);
}

SwigluGrads swiglu_backward_magnitude(const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                      WeightView W1, WeightView W3, WeightView W2, int threads,
                                      const float* row_scale) {
  return magnitudes(X, dY, counts, D, F, W1, W3, W2, threads, row_scale);
}

}  // namespace ref
