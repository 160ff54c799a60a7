// Reference backward of the SwiGLU experts under experts.rounding torchtitan
// and/or experts.compute_dtype bf16 (docs/contract.md §13, the autograd rounding
// points; §14): the gradients in fp64 from the operands rounded to the compute
// dtype, rounded at the points PyTorch's autograd rounds (measured on CPU,
// docs/contract.md §13), and per element the half-width of the class `rounding`:
// how far a correct fp32 implementation may land. Written from the contract,
// independently of kernels/swiglu_bwd_host.cpp.
//
// The half-width follows every uncertain step: h1, h3 and dH are roundings of
// GEMMs known to the fp32 accumulation bound (k + 2) 2^-24 sum |terms|; silu
// and silu' evaluated in fp32 are known to a small relative error; each
// elementwise result takes every rounding those allow (min and max over the
// candidates); a GEMM of gradients is any rounding of a value within its own
// accumulation bound plus the sum of |operand| times the half-widths of the
// rounded intermediates it reads. In bf16 0 or about one unit in the last
// place for most elements, so one rounding more or less (a fused formula,
// an unrounded weight gradient), which moves most elements, fails.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "blocked.h"
#include "reference.h"

namespace ref {
namespace {

/// Known relative accuracy of silu and of silu' as fp32 evaluates them (a few
/// fp32 roundings and exp's error; silu' against the size of its terms,
/// since 1 + a (1 - sig) cancels near a = -1.28).
constexpr double kSiluEps = 1.0 / (1 << 20);
constexpr double kDsiluEps = 1.0 / (1 << 19);


/// Up to three distinct candidates: the roundings of v - room, v, v + room,
/// the middle value first.
struct Cands {
  float v[3];
  int n = 0;
};
template <class Rd>
Cands cands(const Rd& R, double v, double room) {
  // Rounding is monotone, so lo <= mid <= hi and the three are distinct
  // exactly where lo and hi each differ from mid (NaN differs from all):
  // no branch on the data.
  Cands c;
  const float mid = R.c(v), lo = R.c(v - room), hi = R.c(v + room);
  c.v[0] = mid;
  c.n = 1;
  c.v[c.n] = lo;
  c.n += lo != mid;
  c.v[c.n] = hi;
  c.n += hi != mid;
  return c;
}

/// Running middle value and extent of one rounded result.
struct Span {
  float mid = 0.f;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  void see(float x) {
    lo = std::min(lo, double(x));
    hi = std::max(hi, double(x));
  }
  float halfwidth() const {
    return std::isfinite(mid) && std::isfinite(lo) && std::isfinite(hi)
               ? float(std::max(hi - double(mid), double(mid) - lo))
               : 0.f;
  }
};

/// silu(a) and silu'(a) as an fp32 evaluation gives them (exp overflowing
/// for a < -88.7 as fp32's does), with their rooms.
struct SiluVals {
  double s, sroom, ds, droom;
};
SiluVals silu_vals(double a) {
  double e = std::exp(-a);
  if (e > double(std::numeric_limits<float>::max())) e = std::numeric_limits<double>::infinity();
  const double sig = 1.0 / (1.0 + e);
  const double s = double(f32(a / (1.0 + e)));
  const double ds = double(f32(sig * (1.0 + a * (1.0 - sig))));
  return {s, kSiluEps * std::fabs(s) + kTiny, ds, kDsiluEps * sig * (1.0 + std::fabs(a) * (1.0 - sig)) + kTiny};
}

/// H, dh3, dh1 of one element: the contract's middle values (from the
/// middle candidates a.v[0], b.v[0], g.v[0], i.e. h1, h3, dH as rounded,
/// with the fp32 silu and silu' taken as exact; v[i] = silu_vals(a.v[i]))
/// and every outcome the candidates of h1 (a), h3 (b), dH (g) and the silu
/// rooms allow, into the spans. H depends on h1 and h3 only, dh3 on h1 and
/// dH only, dh1 on h1 and the product dH h3, so each is enumerated over its
/// own operands: the same set of outcomes as every (h1, h3, dH) triple
/// gives, at a fraction of the roundings.
template <class Rd>
void elem_outcomes(const Rd& R, SiluRounding rounding, const Cands& a, const SiluVals* v, const Cands& b,
                   const Cands& g, Span& H, Span& d3, Span& d1) {
  const bool fused = rounding == SiluRounding::fused;
  // ga[ib][ig]: the factor of silu' in dh1 (fused: dH h3 in fp32; autograd:
  // round(dH h3))
  float ga[3][3];
  for (int ib = 0; ib < b.n; ++ib)
    for (int ig = 0; ig < g.n; ++ig) {
      const double p = double(g.v[ig]) * b.v[ib];
      ga[ib][ig] = fused ? f32(p) : R.c(p);
    }
  d1.mid = R.c(double(ga[0][0]) * v[0].ds);
  d1.see(d1.mid);
  // Fused, H and dh3 take silu at its middle, which no outcome below does;
  // under autograd's rules they are the first outcomes enumerated (every
  // candidate list starts with its middle value), taken there.
  if (fused) {
    H.mid = R.c(v[0].s * b.v[0]);
    d3.mid = R.c(double(g.v[0]) * v[0].s);
    H.see(H.mid);
    d3.see(d3.mid);
  }
  for (int ia = 0; ia < a.n; ++ia) {
    // silu(h1) as the products see it: fused, either end of its room;
    // autograd, each rounding s = round(silu(h1)) the room allows
    double s[3];
    int ns = 0;
    if (fused) {
      s[ns++] = v[ia].s - v[ia].sroom;
      s[ns++] = v[ia].s + v[ia].sroom;
    } else {
      const Cands sc = cands(R, v[ia].s, v[ia].sroom);
      for (int i = 0; i < sc.n; ++i) s[ns++] = double(sc.v[i]);
    }
    for (int is = 0; is < ns; ++is) {
      for (int ib = 0; ib < b.n; ++ib) {
        const float h = R.c(s[is] * b.v[ib]);
        H.see(h);
        if (!fused && ia + is + ib == 0) H.mid = h;
      }
      for (int ig = 0; ig < g.n; ++ig) {
        const float d = R.c(double(g.v[ig]) * s[is]);
        d3.see(d);
        if (!fused && ia + is + ig == 0) d3.mid = d;
      }
    }
    for (double ds : {v[ia].ds - v[ia].droom, v[ia].ds + v[ia].droom})
      for (int ib = 0; ib < b.n; ++ib)
        for (int ig = 0; ig < g.n; ++ig) d1.see(R.c(double(ga[ib][ig]) * ds));
  }
}


double gamma_of(int64_t k) { return double(k + 2) * std::ldexp(1.0, -24); }

template <class Rd>
MatD rounded_block(const Rd& R, const Vec& v, int64_t at, int64_t rows, int64_t cols) {
  MatD m(rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i) m.data()[i] = R.c(v[size_t(at + i)]);
  return m;
}

template <class Rd>
MatD rounded_weight(const Rd& R, WeightView w, size_t j, int64_t a, int64_t b) {
  std::vector<float> v(static_cast<size_t>(a * b));
  w.decode(j * size_t(a * b), a * b, v.data());
  MatD m(a, b);
  for (int64_t i = 0; i < a * b; ++i) m.data()[i] = R.c(v[size_t(i)]);
  return m;
}

/// The candidates of round(float(v) s) over candidates v (HiddenScale: the
/// multiply's backward, monotone in v, so the middle stays first and equal
/// outcomes merge).
template <class Rd>
Cands scaled(const Rd& R, const Cands& c, double s) {
  Cands o;
  o.v[0] = R.c(double(c.v[0]) * s);
  o.v[1] = o.v[2] = o.v[0];
  o.n = 1;
  for (int i = 1; i < c.n; ++i) {
    const float v = R.c(double(c.v[i]) * s);
    const bool seen = v == o.v[0] || (o.n > 1 && v == o.v[1]);
    if (!seen && o.n < 3) o.v[o.n++] = v;
  }
  return o;
}

/// The elementwise step of one expert: H, dh1, dh3 (middle values) and
/// their half-widths, from the GEMMs h1, h3, dH and their sums of |terms|.
/// With row scores sc (HiddenScale): H is H' = round(H s), the W2 GEMM's
/// operand, dh1 and dh3 come from dH = round(dH' s), and Hp, gp hold the
/// unscaled H and dH' (with half-widths hHp, hgp) the score gradient reads.
struct ElemOut {
  MatD H, d1, d3, hH, h1, h3;
  MatD Hp, hHp, gp, hgp;  // with row scores only
};
template <class Rd>
ElemOut elementwise(const Rd& R, SiluRounding rounding, const MatD& h1, const MatD& h3, const MatD& dH,
                    const MatD& m1, const MatD& m3, const MatD& mdH, int64_t D, const float* sc) {
  const int64_t n = h1.rows(), F = h1.cols();
  ElemOut o{MatD(n, F), MatD(n, F), MatD(n, F), MatD(n, F), MatD(n, F), MatD(n, F), MatD(), MatD(), MatD(), MatD()};
  if (sc) o.Hp = o.hHp = o.gp = o.hgp = MatD(n, F);
  const double g = gamma_of(D);
  for (int64_t i = 0; i < n * F; ++i) {
    const Cands a = cands(R, h1.data()[i], g * m1.data()[i] + kTiny), b = cands(R, h3.data()[i], g * m3.data()[i] + kTiny);
    Cands gd = cands(R, dH.data()[i], g * mdH.data()[i] + kTiny);
    if (sc) {
      Span gs;
      for (int k = 0; k < gd.n; ++k) gs.see(gd.v[k]);
      gs.mid = gd.v[0];
      o.gp.data()[i] = gs.mid;
      o.hgp.data()[i] = gs.halfwidth();
      gd = scaled(R, gd, sc[i / F]);
    }
    Span H, d3, d1;
    SiluVals sv[3];  // silu_vals of each candidate h1, computed once
    for (int ia = 0; ia < a.n; ++ia) sv[ia] = silu_vals(a.v[ia]);
    elem_outcomes(R, rounding, a, sv, b, gd, H, d3, d1);
    if (sc) {
      // H' = round(H s) is monotone in H: the ends of H's span bound it
      o.Hp.data()[i] = H.mid;
      o.hHp.data()[i] = H.halfwidth();
      const double s = sc[i / F];
      Span Hs;
      Hs.mid = R.c(double(H.mid) * s);
      Hs.see(Hs.mid);
      if (H.lo <= H.hi) Hs.see(R.c(H.lo * s)), Hs.see(R.c(H.hi * s));
      H = Hs;
    }
    o.H.data()[i] = H.mid;
    o.d3.data()[i] = d3.mid;
    o.d1.data()[i] = d1.mid;
    o.hH.data()[i] = H.halfwidth();
    o.h3.data()[i] = d3.halfwidth();
    o.h1.data()[i] = d1.halfwidth();
  }
  return o;
}

/// The score gradient of each row (HiddenScale): ds = sum_f dH'_f H_f of
/// the unscaled H and dH', fp32 (rounded to act under round_grad), and its
/// half-width: any fp32 summation order (gamma of F) plus the spread the
/// operands' own half-widths allow.
template <class Rd>
void score_grads(const Rd&, const ElemOut& e, bool round_grad, float* dS, float* mdS, bool want_half) {
  const int64_t n = e.Hp.rows(), F = e.Hp.cols();
  auto out = [&](double v) { return round_grad ? round_act_to<Rd::act>(f32(v)) : f32(v); };
  for (int64_t r = 0; r < n; ++r) {
    double sum = 0, terms = 0, spread = 0;
    for (int64_t f = 0; f < F; ++f) {
      const double g = e.gp(r, f), h = e.Hp(r, f), hg = e.hgp(r, f), hh = e.hHp(r, f);
      sum += g * h;
      terms += std::fabs(g * h);
      spread += std::fabs(g) * hh + std::fabs(h) * hg + hg * hh;
    }
    dS[r] = out(sum);
    if (!want_half) continue;
    const double room = gamma_of(F) * terms + spread + kTiny;
    const float w = std::max(std::fabs(out(sum + room) - dS[r]), std::fabs(dS[r] - out(sum - room)));
    mdS[r] = std::fabs(dS[r]) <= std::numeric_limits<float>::max() ? w : 0.f;
  }
}

/// c |d| + h as fp32 rounded up: the per-element weight of a room GEMM
/// (c times the sum of |terms|, plus the operand's half-width h).
MatF room_weight(double c, const MatD& d, const MatD& h) { return abs_f32_up(c * d.cwiseAbs() + h); }

/// |m| as fp32 (exact: m holds values of the compute dtype).
MatF absf(const MatD& m) { return m.cwiseAbs().cast<float>(); }

/// dX of one expert: under torchtitan the two GEMM gradients each rounded
/// (to ca, then act), added in fp32 and rounded to act; otherwise one GEMM
/// over 2F rounded once. The room of a gradient GEMM: its accumulation bound
/// plus the spread of its rounded operands, gamma sum |d| |w| + sum h |w| =
/// (gamma |d| + h) |w|, one fp32 product of absolute values (an upper bound).
template <class Rd>
void input_grad(const Rd& R, bool split, const ElemOut& e, const MatD& w1, const MatD& w3, SwigluGrads& g,
                size_t at, bool want_half) {
  const MatD A = e.d1 * w1, B = e.d3 * w3;
  const int64_t F = w1.rows();
  MatF a1, a3;
  if (want_half) a1 = absf(w1), a3 = absf(w3);
  if (!split) {
    MatD room;
    if (want_half) {
      const double g2F = gamma_of(2 * F);
      room = abs_product_nn(room_weight(g2F, e.d1, e.h1), a1) + abs_product_nn(room_weight(g2F, e.d3, e.h3), a3);
    }
    gemm_out(R, A + B, room, g.dX, g.mdX, at, want_half);
    return;
  }
  auto sum = [&](double x, double y) { return round_act_to<Rd::act>(f32(double(R.out(x)) + double(R.out(y)))); };
  MatD rA, rB;
  if (want_half) {
    const double gF = gamma_of(F);
    rA = abs_product_nn(room_weight(gF, e.d1, e.h1), a1);
    rB = abs_product_nn(room_weight(gF, e.d3, e.h3), a3);
  }
  for (int64_t i = 0; i < A.size(); ++i) g.dX[at + size_t(i)] = sum(A.data()[i], B.data()[i]);
  if (!want_half) return;
  for (int64_t i = 0; i < A.size(); ++i) {  // branch-free: it vectorises
    const double x = A.data()[i], y = B.data()[i], rx = rA.data()[i] + kTiny, ry = rB.data()[i] + kTiny;
    const float m = g.dX[at + size_t(i)];
    const float w = std::max(std::fabs(sum(x + rx, y + ry) - m), std::fabs(m - sum(x - rx, y - ry)));
    g.mdX[at + size_t(i)] = std::fabs(m) <= std::numeric_limits<float>::max() ? w : 0.f;  // 0 where m is inf or NaN
  }
}

}  // namespace

SwigluGrads swiglu_backward_autograd(Act act, const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                     WeightView W1, WeightView W3, WeightView W2, SiluRounding rounding,
                                     Compute compute, int threads, bool bounds, bool w13_fused, HiddenScale hs) {
  std::vector<int64_t> first(counts.size(), 0);
  int64_t rows = 0;
  for (size_t j = 0; j < counts.size(); ++j) first[j] = rows, rows += counts[j];
  SwigluGrads g;
  const size_t wsize = counts.size() * size_t(F * D);
  g.dX.assign(dY.size(), 0.f);
  g.mdX.assign(bounds ? dY.size() : 0, 0.f);
  for (Vec* v : {&g.dW1, &g.dW3, &g.dW2}) v->assign(wsize, 0.f);
  for (Vec* v : {&g.mdW1, &g.mdW3, &g.mdW2}) v->assign(bounds ? wsize : 0, 0.f);
  g.dS.assign(hs.s ? size_t(rows) : 0, 0.f);
  g.mdS.assign(hs.s && bounds ? size_t(rows) : 0, 0.f);
  const bool dw_fp32 = rounding == SiluRounding::fused && compute == Compute::act;
  // the experts with the dtypes known at compile time (Rounder)
  auto run = [&](const auto& R) {
    parallel_items(int64_t(counts.size()), threads, [&](int64_t j) {
      const int64_t n = counts[size_t(j)], row = first[size_t(j)];
      if (n == 0) return;  // its weight gradients stay exactly 0
      const MatD x = rounded_block(R, X, row * D, n, D), dy = rounded_block(R, dY, row * D, n, D);
      const MatD w1 = rounded_weight(R, W1, size_t(j), F, D), w3 = rounded_weight(R, W3, size_t(j), F, D),
                 w2 = rounded_weight(R, W2, size_t(j), D, F);
      // the sums of |terms| as fp32 products of absolute values made upper
      // bounds (reference/blocked.h), one per room
      const MatF ax = absf(x), ady = absf(dy);
      const ElemOut e = elementwise(R, rounding, x * w1.transpose(), x * w3.transpose(), dy * w2,
                                    abs_product_nt(ax, absf(w1)), abs_product_nt(ax, absf(w3)),
                                    abs_product_nn(ady, absf(w2)), D, hs.s ? hs.s + row : nullptr);
      if (hs.s)
        score_grads(R, e, hs.round_grad, g.dS.data() + row, bounds ? g.mdS.data() + row : nullptr, bounds);
      input_grad(R, rounding == SiluRounding::torchtitan && !w13_fused, e, w1, w3, g, size_t(row * D), bounds);
      const double gn = gamma_of(n);
      const size_t at = size_t(j) * size_t(F * D);
      MatD r1, r3, r2;
      if (bounds) {
        r1 = abs_product_nn(MatF(room_weight(gn, e.d1, e.h1).transpose()), ax);
        r3 = abs_product_nn(MatF(room_weight(gn, e.d3, e.h3).transpose()), ax);
        r2 = abs_product_nn(MatF(ady.transpose()), room_weight(gn, e.H, e.hH));
      }
      // The weight gradients: tensors of the compute dtype under autograd's
      // rules, fp32 under the fused ones (docs/contract.md §13).
      const auto dw_out = [&](const MatD& V, const MatD& room, Vec& mid, Vec& half) {
        if (dw_fp32) gemm_out(Rounder<Act::fp32, Act::fp32>{}, V, room, mid, half, at, bounds);
        else gemm_out(R, V, room, mid, half, at, bounds);
      };
      dw_out(e.d1.transpose() * x, r1, g.dW1, g.mdW1);
      dw_out(e.d3.transpose() * x, r3, g.dW3, g.mdW3);
      dw_out(dy.transpose() * e.H, r2, g.dW2, g.mdW2);
    });
  };
  with_act(act, [&](auto a) {
    if (compute == Compute::bf16) run(Rounder<Act::bf16, a.value>{});
    else run(Rounder<a.value, a.value>{});
  });
  return g;
}

}  // namespace ref
