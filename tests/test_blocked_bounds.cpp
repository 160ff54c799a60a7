// The reference's blocked GEMMs (reference/blocked.h, issue 23): the sums of
// |terms| behind the error bounds (docs/contract.md, comparison classes) now come from fp32
// GEMMs of absolute values, inflated to upper bounds. These tests hold them
// to that: never below the exact sum (so no bound got tighter than the
// contract's), and the SwiGLU half-widths and error scales at least the
// per-element fp64 sums of the scalar loops they replace. Every result must
// be the same on any number of threads.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "../reference/blocked.h"
#include "../reference/reference.h"

namespace {

/// A non-negative fp32 value spread over 2^-140 .. 2^40 (subnormal products
/// included), or 0.
float spread(std::mt19937_64& g) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double p = u(g);
  if (p < 0.05) return 0.f;
  const int e = p < 0.15 ? -140 + int(u(g) * 20) : -8 + int(u(g) * 16);
  return float(std::ldexp(0.5 + 0.5 * u(g), e) * (p > 0.99 ? std::ldexp(1.0, 40) : 1.0));
}

/// sum_d a_id b_jd in long double (64 significand bits: each product of two
/// floats exact, k <= 4096 additions lose less than 2^-52 relative).
long double exact_nt(const ref::MatF& a, const ref::MatF& b, int64_t i, int64_t j) {
  long double s = 0;
  for (int64_t d = 0; d < a.cols(); ++d) s += (long double)a(i, d) * (long double)b(j, d);
  return s;
}

/// The scalar h13 half-width the blocked one replaced: v and sum |x w| per
/// element in fp64 (docs/contract.md §8).
ref::Vec scalar_halfwidth(ref::Act act, const ref::Vec& X, const ref::Counts& counts, int64_t D, int64_t F,
                          const ref::Vec& W1, const ref::Vec& W3) {
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  const double gamma = double(D + 2) * std::ldexp(1.0, -24);
  ref::Vec half(size_t(rows * 2 * F), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    for (int64_t r = row; r < row + counts[j]; ++r)
      for (int64_t f = 0; f < F; ++f)
        for (int part = 0; part < 2; ++part) {
          const ref::Vec& W = part == 0 ? W1 : W3;
          double v = 0, m = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double x = ref::round_act(act, X[size_t(r * D + d)]);
            const double w = ref::round_act(act, W[size_t((int64_t(j) * F + f) * D + d)]);
            v += x * w;
            m += std::fabs(x * w);
          }
          const double room = gamma * m + std::ldexp(1.0, -126);
          const float mid = ref::round_act(act, ref::f32(v));
          const float lo = ref::round_act(act, ref::f32(v - room)), hi = ref::round_act(act, ref::f32(v + room));
          half[size_t(r * 2 * F + part * F + f)] = std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
        }
    row += counts[j];
  }
  return half;
}

/// The scalar SwiGLU error scale: every sum in fp64 (the formula of
/// reference.h swiglu_magnitude).
ref::Vec scalar_magnitude(const ref::Vec& X, const ref::Counts& counts, int64_t D, int64_t F, const ref::Vec& W1,
                          const ref::Vec& W3, const ref::Vec& W2) {
  ref::Vec M(X.size(), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    for (int64_t r = row; r < row + counts[j]; ++r) {
      std::vector<double> heff(static_cast<size_t>(F));
      for (int64_t f = 0; f < F; ++f) {
        double h1 = 0, h3 = 0, m1 = 0, m3 = 0;
        for (int64_t d = 0; d < D; ++d) {
          const double x = X[size_t(r * D + d)], w1 = W1[size_t((int64_t(j) * F + f) * D + d)],
                       w3 = W3[size_t((int64_t(j) * F + f) * D + d)];
          h1 += x * w1, h3 += x * w3, m1 += std::fabs(x * w1), m3 += std::fabs(x * w3);
        }
        const double sig = 1.0 / (1.0 + std::exp(-h1)), silu = h1 * sig, ds = sig * (1.0 + h1 * (1.0 - sig));
        heff[size_t(f)] = std::fabs(silu * h3) + std::fabs(ds * h3) * m1 + std::fabs(silu) * m3;
        // the product of h1's and h3's errors: gamma m1 m3 max|silu'| near h1
        const double gamma = double(D + 2) * std::ldexp(1.0, -24), hi = h1 + gamma * m1 + std::ldexp(std::fabs(h1), -8);
        const double sh = 1.0 / (1.0 + std::exp(-hi)), slope = hi <= -2.5 ? std::fabs(sh * (1.0 + hi * (1.0 - sh))) : 1.1;
        heff[size_t(f)] += gamma * slope * m1 * m3;
      }
      for (int64_t c = 0; c < D; ++c) {
        double y = 0;
        for (int64_t f = 0; f < F; ++f) y += heff[size_t(f)] * std::fabs(W2[size_t((int64_t(j) * D + c) * F + f)]);
        M[size_t(r * D + c)] = ref::f32(y);
      }
    }
    row += counts[j];
  }
  return M;
}

ref::Vec bf16_values(std::mt19937_64& g, size_t n, double scale) {
  std::normal_distribution<double> nd(0.0, scale);
  ref::Vec v(n);
  for (float& x : v) x = ref::round_act(ref::Act::bf16, float(nd(g)));
  return v;
}

}  // namespace

TEST_CASE("abs_product bounds are never below the exact sum of |terms|", "[bounds]") {
  std::mt19937_64 g(23);
  int below = 0;  // elements whose plain fp32 sum is below the exact one: the inflation is needed
  for (int64_t k : {1, 7, 300, 4096}) {
    ref::MatF a(9, k), b(11, k);
    for (int64_t i = 0; i < a.size(); ++i) a.data()[i] = spread(g);
    for (int64_t i = 0; i < b.size(); ++i) b.data()[i] = spread(g);
    const ref::MatD up = ref::abs_product_nt(a, b);
    const ref::MatF plain = a * b.transpose();
    const ref::MatD up_nn = ref::abs_product_nn(a, ref::MatF(b.transpose()));
    for (int64_t i = 0; i < a.rows(); ++i)
      for (int64_t j = 0; j < b.rows(); ++j) {
        const long double e = exact_nt(a, b, i, j);
        INFO("k " << k << " element (" << i << ", " << j << ")");
        CHECK((long double)up(i, j) >= e);
        CHECK((long double)up_nn(i, j) >= e);
        CHECK(up(i, j) <= double(e) * (1 + 1e-3) + double(k) * 1e-44);  // and not much above
        below += (long double)plain(i, j) < e;
      }
  }
  CHECK(below > 0);
  // An fp32 sum that overflows is summed again in fp64: finite where the exact sum is.
  ref::MatF a = ref::MatF::Constant(1, 4, 3e38f), b = ref::MatF::Constant(1, 4, 2.f);
  const ref::MatD up = ref::abs_product_nt(a, b);
  CHECK(std::isfinite(up(0, 0)));
  CHECK(up(0, 0) >= 2.4e39);
}

TEST_CASE("blocked SwiGLU half-widths and error scales are at least the scalar fp64 ones", "[bounds]") {
  std::mt19937_64 g(2023);
  const int64_t D = 33, F = 17;
  const ref::Counts counts = {5, 0, 2 * ref::kRowBlock + 3, 1};  // an empty expert and a split one
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  const int64_t E_l = int64_t(counts.size());
  const ref::Vec X = bf16_values(g, size_t(rows * D), 1.0), W1 = bf16_values(g, size_t(E_l * F * D), 0.2),
                 W3 = bf16_values(g, size_t(E_l * F * D), 0.2), W2 = bf16_values(g, size_t(E_l * D * F), 0.2);
  const ref::Act act = ref::Act::bf16;
  const ref::Vec old_half = scalar_halfwidth(act, X, counts, D, F, W1, W3);
  const ref::Vec old_mag = scalar_magnitude(X, counts, D, F, W1, W3, W2);
  const ref::SwigluTrace t1 = ref::swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2, ref::SiluRounding::fused,
                                                         ref::Compute::act, 1, true);
  const ref::SwigluTrace t3 = ref::swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2, ref::SiluRounding::fused,
                                                         ref::Compute::act, 3, true);
  REQUIRE(t1.h13_halfwidth.size() == old_half.size());
  REQUIRE(t1.magnitude.size() == old_mag.size());
  int wider = 0;
  for (size_t i = 0; i < old_half.size(); ++i) {
    INFO("h13 element " << i);
    CHECK(t1.h13_halfwidth[i] >= old_half[i]);
    wider += t1.h13_halfwidth[i] > old_half[i];
  }
  CHECK(wider <= int(old_half.size() / 100));  // an upper bound, not a looser check
  for (size_t i = 0; i < old_mag.size(); ++i) {
    INFO("Y element " << i);
    CHECK(double(t1.magnitude[i]) >= double(old_mag[i]) * (1 - 1e-6));
    CHECK(double(t1.magnitude[i]) <= double(old_mag[i]) * (1 + 1e-3) + 1e-30);
  }
  // The standalone functions and any thread count give the same bits.
  CHECK(t3.Y == t1.Y);
  CHECK(t3.h13 == t1.h13);
  CHECK(t3.H == t1.H);
  CHECK(t3.h13_halfwidth == t1.h13_halfwidth);
  CHECK(t3.magnitude == t1.magnitude);
  CHECK(ref::swiglu_h13_halfwidth(act, X, counts, D, F, W1, W3, 2) == t1.h13_halfwidth);
  CHECK(ref::swiglu_magnitude(X, counts, D, F, W1, W3, W2, 2) == t1.magnitude);
  CHECK(ref::swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2).Y == t1.Y);
}

TEST_CASE("SwiGLU backward under the fused rules: fp32 weight gradients and the same half-widths on any thread count",
          "[bounds]") {
  std::mt19937_64 g(77);
  const int64_t D = 24, F = 40;
  const ref::Counts counts = {3, 0, 150};
  const int64_t rows = 153, E_l = 3;
  const ref::Vec X = bf16_values(g, size_t(rows * D), 1.0), dY = bf16_values(g, size_t(rows * D), 1.0),
                 W1 = bf16_values(g, size_t(E_l * F * D), 0.2), W3 = bf16_values(g, size_t(E_l * F * D), 0.2),
                 W2 = bf16_values(g, size_t(E_l * D * F), 0.2);
  const ref::SwigluGrads a = ref::swiglu_experts_backward(ref::Act::bf16, X, dY, counts, D, F, W1, W3, W2,
                                                          ref::SiluRounding::fused, ref::Compute::act, 1, true);
  const ref::SwigluGrads b = ref::swiglu_experts_backward(ref::Act::bf16, X, dY, counts, D, F, W1, W3, W2,
                                                          ref::SiluRounding::fused, ref::Compute::act, 2, true);
  CHECK(a.dX == b.dX);
  CHECK(a.dW1 == b.dW1);
  CHECK(a.dW2 == b.dW2);
  CHECK(a.mdX == b.mdX);
  CHECK(a.mdW1 == b.mdW1);
  CHECK(a.mdW3 == b.mdW3);
  CHECK(a.mdW2 == b.mdW2);
  // dX is a bf16 tensor, the weight gradients fp32 (docs/contract.md §13):
  // autograd's rule would round them to bf16 too
  size_t dx_bf16 = 0, dw_bf16 = 0, dx_exact = 0;
  for (size_t i = 0; i < a.dX.size(); ++i) {
    dx_bf16 += ref::round_act(ref::Act::bf16, a.dX[i]) == a.dX[i];
    dx_exact += a.mdX[i] == 0.f;
  }
  for (float v : a.dW1) dw_bf16 += ref::round_act(ref::Act::bf16, v) == v;
  CHECK(dx_bf16 == a.dX.size());
  CHECK(dw_bf16 < a.dW1.size() / 2);
  // the half-width of a bf16 result is mostly 0 (a missing rounding fails)
  CHECK(dx_exact > a.dX.size() / 2);
  // the end-to-end error scales do not depend on the thread count either
  CHECK(ref::swiglu_backward_magnitude(X, dY, counts, D, F, W1, W3, W2, 1).dX ==
        ref::swiglu_backward_magnitude(X, dY, counts, D, F, W1, W3, W2, 2).dX);
}
