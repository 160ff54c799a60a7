// Reference backward of the SwiGLU experts (docs/contract.md §8, §13): the input and
// weight gradients of swiglu_experts for the loss <Y, dY>, in fp64 from the
// act-rounded inputs, rounded to act at the points listed in reference.h.
// Written from the chain rule, independently of kernels/swiglu_bwd_host.cpp.
#include <Eigen/Core>
#include <cmath>
#include <stdexcept>

#include "reference.h"

namespace ref {
namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Rows [row, row + n) of a (rows, cols) buffer, each value rounded to act.
MatD block(Act act, const Vec& v, int64_t row, int64_t n, int64_t cols) {
  MatD m(n, cols);
  for (int64_t i = 0; i < n * cols; ++i) m.data()[i] = round_act(act, v[size_t(row * cols + i)]);
  return m;
}

/// Expert j's (a, b) weight matrix, rounded to act.
MatD weight(Act act, const Vec& w, size_t j, int64_t a, int64_t b) {
  MatD m(a, b);
  for (int64_t i = 0; i < a * b; ++i) m.data()[i] = round_act(act, w[j * size_t(a * b) + size_t(i)]);
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

}  // namespace

SwigluGrads swiglu_experts_backward(Act act, const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                    const Vec& W1, const Vec& W3, const Vec& W2, SiluRounding rounding,
                                    Compute compute) {
  if (rounding != SiluRounding::fused)
    throw std::invalid_argument("swiglu_experts_backward: experts.rounding torchtitan has no backward contract");
  if (compute != Compute::act)
    throw std::invalid_argument("swiglu_experts_backward: experts.compute_dtype bf16 has no backward contract");
  const int E_l = int(counts.size());
  // h1, h3 and H exactly as the forward reference rounds them.
  const SwigluTrace tr = swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2, rounding, compute);
  SwigluGrads g;
  g.dX.assign(dY.size(), 0.f);
  g.dW1.assign(size_t(E_l * F * D), 0.f);
  g.dW3.assign(size_t(E_l * F * D), 0.f);
  g.dW2.assign(size_t(E_l * D * F), 0.f);
  int64_t row = 0;
  for (int j = 0; j < E_l; ++j) {
    const int64_t n = counts[size_t(j)];
    if (n == 0) continue;  // its weight gradients stay exactly 0
    const MatD x = block(act, X, row, n, D), dy = block(act, dY, row, n, D);
    const MatD w1 = weight(act, W1, size_t(j), F, D), w3 = weight(act, W3, size_t(j), F, D),
               w2 = weight(act, W2, size_t(j), D, F);
    const MatD dHx = dy * w2;  // (n, F)
    MatD dh1(n, F), dh3(n, F), H(n, F);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t f = 0; f < F; ++f) {
        const double a = tr.h13[size_t((row + r) * 2 * F + f)], b = tr.h13[size_t((row + r) * 2 * F + F + f)];
        const double dH = round_act(act, f32(dHx(r, f)));
        const SiluDerivs s = silu_derivs(a);
        dh3(r, f) = round_act(act, f32(dH * s.s));
        dh1(r, f) = round_act(act, f32(dH * b * s.s1));
        H(r, f) = tr.H[size_t((row + r) * F + f)];
      }
    const MatD dx = dh1 * w1 + dh3 * w3;  // (n, D)
    for (int64_t i = 0; i < n * D; ++i) g.dX[size_t(row * D + i)] = round_act(act, f32(dx.data()[i]));
    store(g.dW1, size_t(j) * size_t(F * D), MatD(dh1.transpose() * x));
    store(g.dW3, size_t(j) * size_t(F * D), MatD(dh3.transpose() * x));
    store(g.dW2, size_t(j) * size_t(D * F), MatD(dy.transpose() * H));
    row += n;
  }
  return g;
}

SwigluGrads swiglu_backward_magnitude(const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                      const Vec& W1, const Vec& W3, const Vec& W2) {
  const int E_l = int(counts.size());
  SwigluGrads m;
  m.dX.assign(dY.size(), 0.f);
  m.dW1.assign(size_t(E_l * F * D), 0.f);
  m.dW3.assign(size_t(E_l * F * D), 0.f);
  m.dW2.assign(size_t(E_l * D * F), 0.f);
  int64_t row = 0;
  for (int j = 0; j < E_l; ++j) {
    const int64_t n = counts[size_t(j)];
    if (n == 0) continue;
    const MatD x = block(Act::fp32, X, row, n, D), dy = block(Act::fp32, dY, row, n, D);
    const MatD w1 = weight(Act::fp32, W1, size_t(j), F, D), w3 = weight(Act::fp32, W3, size_t(j), F, D),
               w2 = weight(Act::fp32, W2, size_t(j), D, F);
    const MatD ax = x.cwiseAbs(), ady = dy.cwiseAbs();
    const MatD h1 = x * w1.transpose(), h3 = x * w3.transpose(), dH = dy * w2;
    const MatD m1 = ax * w1.cwiseAbs().transpose(), m3 = ax * w3.cwiseAbs().transpose(), mdH = ady * w2.cwiseAbs();
    // E1, E3: effective magnitudes of dh1 and dh3 (their terms' sizes plus
    // the first-order effect of an error of m1 in h1, m3 in h3, mdH in dH);
    // Heff the same for H.
    MatD E1(n, F), E3(n, F), Heff(n, F);
    for (int64_t i = 0; i < n * F; ++i) {
      const double a = h1.data()[i], b = h3.data()[i], d = dH.data()[i];
      const SiluDerivs s = silu_derivs(a);
      E3.data()[i] = mdH.data()[i] * std::fabs(s.s) + std::fabs(d * s.s1) * m1.data()[i];
      E1.data()[i] = mdH.data()[i] * std::fabs(b * s.s1) + std::fabs(d * s.s1) * m3.data()[i] +
                     std::fabs(d * b * s.s2) * m1.data()[i];
      Heff.data()[i] = std::fabs(s.s * b) + std::fabs(s.s1 * b) * m1.data()[i] + std::fabs(s.s) * m3.data()[i];
    }
    const MatD dx = E1 * w1.cwiseAbs() + E3 * w3.cwiseAbs();
    for (int64_t i = 0; i < n * D; ++i) m.dX[size_t(row * D + i)] = f32(dx.data()[i]);
    store(m.dW1, size_t(j) * size_t(F * D), MatD(E1.transpose() * ax));
    store(m.dW3, size_t(j) * size_t(F * D), MatD(E3.transpose() * ax));
    store(m.dW2, size_t(j) * size_t(D * F), MatD(ady.transpose() * Heff));
    row += n;
  }
  return m;
}

}  // namespace ref
