// Reference local dispatch, combine and SwiGLU experts (CONTRACT §2, §8).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>

#include "reference.h"

namespace ref {

LocalDispatch local_dispatch(Act act, ScoreApply apply, RowsRef x, const Ids& ids,
                             const Vec& topk_scores, int64_t T, int64_t D, int K, int E, ScoreMultiply smul) {
  LocalDispatch d;
  d.counts.assign(size_t(E), 0);
  d.row_of.assign(size_t(T * K), -1);
  const size_t eb = act_bytes(act);
  d.routed.reserve(ids.size() * x.row_bytes);
  for (int e = 0; e < E; ++e)
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int64_t a = t * K + k;
        if (ids[size_t(a)] != e) continue;
        const float s = topk_scores[size_t(a)];
        const float sm = smul == ScoreMultiply::act ? round_act(act, s) : s;
        d.row_of[size_t(a)] = int32_t(d.token_sorted.size());
        d.token_sorted.push_back(int32_t(t));
        d.score_sorted.push_back(s);
        const uint8_t* row = x.row(t);
        const size_t at = d.routed.size();
        d.routed.insert(d.routed.end(), row, row + x.row_bytes);  // the row as it is, or:
        if (apply == ScoreApply::before_experts)
          for (int64_t c = 0; c < D; ++c)
            encode_act(act, round_act(act, f32(double(decode_act(act, row + size_t(c) * eb)) * sm)),
                       &d.routed[at + size_t(c) * eb]);
        ++d.counts[size_t(e)];
      }
  return d;
}

SwigluTrace swiglu_experts_traced(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F,
                                  const Vec& W1, const Vec& W3, const Vec& W2, SiluRounding rounding,
                                  Compute compute) {
  // ca: the dtype the GEMMs and the activation round to; the inputs are
  // rounded to it first (exact when ca == act).
  const Act ca = compute == Compute::bf16 ? Act::bf16 : act;
  using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  SwigluTrace o;
  o.Y.assign(X.size(), 0.f);
  o.h13.assign(size_t(rows * 2 * F), 0.f);
  o.H.assign(size_t(rows * F), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    const int64_t n = counts[j];
    MatD xj(n, D), w1(F, D), w3(F, D), w2(D, F);
    for (int64_t i = 0; i < n * D; ++i) xj.data()[i] = round_act(ca, X[size_t(row * D + i)]);
    for (int64_t i = 0; i < F * D; ++i) {
      w1.data()[i] = round_act(ca, W1[size_t(int64_t(j) * F * D + i)]);
      w3.data()[i] = round_act(ca, W3[size_t(int64_t(j) * F * D + i)]);
      w2.data()[i] = round_act(ca, W2[size_t(int64_t(j) * D * F + i)]);
    }
    const MatD h1 = xj * w1.transpose(), h3 = xj * w3.transpose();
    MatD H(n, F);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t f = 0; f < F; ++f) {
        const float a = round_act(ca, f32(h1(r, f)));
        const float b = round_act(ca, f32(h3(r, f)));
        o.h13[size_t((row + r) * 2 * F + f)] = a;
        o.h13[size_t((row + r) * 2 * F + F + f)] = b;
        float silu = f32(double(a) / (1.0 + std::exp(-double(a))));
        if (rounding == SiluRounding::torchtitan) silu = round_act(ca, silu);
        H(r, f) = round_act(ca, f32(double(silu) * b));
        o.H[size_t((row + r) * F + f)] = float(H(r, f));
      }
    const MatD y = H * w2.transpose();
    for (int64_t i = 0; i < n * D; ++i)
      o.Y[size_t(row * D + i)] = round_act(act, round_act(ca, f32(y.data()[i])));
    row += n;
  }
  return o;
}

Vec swiglu_experts(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F, const Vec& W1, const Vec& W3,
                   const Vec& W2) {
  return swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2).Y;
}

Vec swiglu_hidden(Act act, const Vec& h13, int64_t rows, int64_t F, Vec& halfwidth, SiluRounding rounding) {
  // fp32 silu and product carry a few fp32 roundings (and exp's error): the
  // exact value v is known to about 2^-20 relative. Any rounding of a value
  // in v (1 -+ 2^-20) is accepted; a dropped or extra rounding to act moves
  // H by far more for bf16/fp16.
  const double eps = std::ldexp(1.0, -20);
  // Below about 2^-120 relative to |h3| an fp32 silu underflows (exp(-a)
  // overflows to inf for a < -88.7, giving -0): those values carry no
  // information about a rounding point, so they get that much absolute room.
  const double tiny = std::ldexp(1.0, -118);
  Vec H(size_t(rows * F));
  halfwidth.assign(size_t(rows * F), 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < F; ++f) {
      const double a = h13[size_t(r * 2 * F + f)], b = h13[size_t(r * 2 * F + F + f)];
      // silu in fp32 as the contract computes it: exp(-a) overflows fp32
      // past a < -88.72 (then silu is -0, and -0 * inf is NaN, where the
      // fp64 value would still be tiny and give inf), and silu is rounded
      // to fp32 before the product.
      double e = std::exp(-a);
      if (e > double(std::numeric_limits<float>::max())) e = std::numeric_limits<double>::infinity();
      const double silu = double(f32(a / (1.0 + e)));
      if (rounding == SiluRounding::torchtitan) {
        // silu(h1) itself is rounded to act: an fp32 silu within eps of the
        // exact one may round to either neighbour of a midpoint, and each
        // choice gives its own product, rounded once more.
        const double sroom = eps * std::fabs(silu) + tiny;
        const double cands[3] = {round_act(act, f32(silu - sroom)), round_act(act, f32(silu)),
                                 round_act(act, f32(silu + sroom))};
        const float mid = round_act(act, f32(cands[1] * b));
        float width = 0.f;
        for (double sc : cands) {
          const double p = sc * b, room = eps * std::fabs(p) + tiny * std::fabs(b);
          for (double pv : {p - room, p + room}) width = std::max(width, std::fabs(round_act(act, f32(pv)) - mid));
        }
        H[size_t(r * F + f)] = mid;
        halfwidth[size_t(r * F + f)] = std::isfinite(mid) ? width : 0.f;
        continue;
      }
      const double v = silu * b;
      const float mid = round_act(act, f32(v));
      const double room = eps * std::fabs(v) + tiny * std::fabs(b);
      const float lo = round_act(act, f32(v - room)), hi = round_act(act, f32(v + room));
      H[size_t(r * F + f)] = mid;
      halfwidth[size_t(r * F + f)] = std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
    }
  return H;
}

Vec gemm_magnitude(const Vec& X, const Vec& W, int64_t rows, int64_t D, int64_t n) {
  Vec m(size_t(rows * n), 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += std::fabs(double(X[size_t(r * D + d)])) * std::fabs(double(W[size_t(j * D + d)]));
      m[size_t(r * n + j)] = f32(s);
    }
  return m;
}

Vec swiglu_h13_halfwidth(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F, const Vec& W1,
                         const Vec& W3) {
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  const double gamma = double(D + 2) * std::ldexp(1.0, -24);
  Vec half(size_t(rows * 2 * F), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    for (int64_t r = row; r < row + counts[j]; ++r)
      for (int64_t f = 0; f < F; ++f)
        for (int part = 0; part < 2; ++part) {
          const Vec& W = part == 0 ? W1 : W3;
          double v = 0, m = 0;
          for (int64_t d = 0; d < D; ++d) {
            const double x = round_act(act, X[size_t(r * D + d)]);
            const double w = round_act(act, W[size_t((int64_t(j) * F + f) * D + d)]);
            v += x * w;
            m += std::fabs(x * w);
          }
          const double room = gamma * m + std::ldexp(1.0, -126);
          const float mid = round_act(act, f32(v));
          const float lo = round_act(act, f32(v - room)), hi = round_act(act, f32(v + room));
          half[size_t(r * 2 * F + part * F + f)] = std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
        }
    row += counts[j];
  }
  return half;
}

Vec swiglu_magnitude(const Vec& X, const Counts& counts, int64_t D, int64_t F, const Vec& W1, const Vec& W3,
                     const Vec& W2) {
  using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Vec M(X.size(), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    const int64_t n = counts[j];
    MatD xj(n, D), w1(F, D), w3(F, D), w2(D, F);
    for (int64_t i = 0; i < n * D; ++i) xj.data()[i] = X[size_t(row * D + i)];
    for (int64_t i = 0; i < F * D; ++i) {
      w1.data()[i] = W1[size_t(int64_t(j) * F * D + i)];
      w3.data()[i] = W3[size_t(int64_t(j) * F * D + i)];
      w2.data()[i] = W2[size_t(int64_t(j) * D * F + i)];
    }
    const MatD h1 = xj * w1.transpose(), h3 = xj * w3.transpose();
    const MatD m1 = xj.cwiseAbs() * w1.cwiseAbs().transpose(), m3 = xj.cwiseAbs() * w3.cwiseAbs().transpose();
    MatD Heff(n, F);
    for (int64_t i = 0; i < n * F; ++i) {
      const double a = h1.data()[i], b = h3.data()[i];
      const double sig = 1.0 / (1.0 + std::exp(-a));
      const double silu = a * sig, dsilu = sig * (1.0 + a * (1.0 - sig));
      // first-order propagation of an error of m1 in h1 and of m3 in h3
      Heff.data()[i] = std::fabs(silu * b) + std::fabs(dsilu * b) * m1.data()[i] + std::fabs(silu) * m3.data()[i];
    }
    const MatD y = Heff * w2.cwiseAbs().transpose();
    for (int64_t i = 0; i < n * D; ++i) M[size_t(row * D + i)] = f32(y.data()[i]);
    row += n;
  }
  return M;
}

Vec combine_magnitude(const CombineSpec& s, const Vec& rows_magnitude, const Ids& token_sorted,
                      const Vec& score_sorted, const Vec& init_magnitude, const Vec& shared_magnitude, int64_t T,
                      int64_t D) {
  std::vector<double> m(init_magnitude.begin(), init_magnitude.end());
  for (size_t i = 0; i < token_sorted.size(); ++i) {
    if (token_sorted[i] < 0) continue;  // a capacity filler row (CONTRACT §11)
    const double w = s.apply == ScoreApply::after_experts ? std::fabs(double(score_sorted[i])) : 1.0;
    for (int64_t c = 0; c < D; ++c)
      m[size_t(token_sorted[i] * D + c)] += w * rows_magnitude[i * size_t(D) + size_t(c)];
  }
  Vec out(size_t(T * D));
  for (int64_t i = 0; i < T * D; ++i)
    out[size_t(i)] = f32(m[size_t(i)] + (s.shared_add == SharedAdd::add_after ? shared_magnitude[size_t(i)] : 0.0));
  return out;
}

Vec combine(const CombineSpec& s, RowsRef routed_out, const Ids& token_sorted,
            const Vec& score_sorted, const Vec& init, const Vec& shared, int64_t T, int64_t D, int threads) {
  Vec out = init;
  // fp32 accumulators for Accumulate::fp32_accumulate (per_add needs none)
  Vec wide = s.acc == Accumulate::fp32_accumulate ? init : Vec{};
  auto columns = [&](int64_t c0, int64_t c1) {
    for (size_t i = 0; i < token_sorted.size(); ++i) {
      const int64_t t = token_sorted[i];
      if (t < 0) continue;  // a capacity filler row (CONTRACT §11): no token
      const float sc = s.smul == ScoreMultiply::act ? round_act(s.act, score_sorted[i]) : score_sorted[i];
      for (int64_t c = c0; c < c1; ++c) {
        float y = decode_act(s.act, routed_out.row(int64_t(i)) + size_t(c) * act_bytes(s.act));
        if (s.apply == ScoreApply::after_experts) y = round_act(s.act, f32(double(y) * sc));
        float& o = out[size_t(t * D + c)];
        if (s.acc == Accumulate::per_add) o = round_act(s.act, f32(double(o) + y));
        else wide[size_t(t * D + c)] = f32(double(wide[size_t(t * D + c)]) + y);
      }
    }
  };
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, D / 64));
  if (n <= 1) {
    columns(0, D);
  } else {
    std::vector<std::thread> pool;
    for (int64_t k = 0; k < n; ++k) pool.emplace_back(columns, D * k / n, D * (k + 1) / n);
    for (auto& th : pool) th.join();
  }
  if (s.acc == Accumulate::fp32_accumulate)
    for (size_t i = 0; i < out.size(); ++i) out[i] = round_act(s.act, wide[i]);
  if (s.shared_add == SharedAdd::add_after)
    for (int64_t i = 0; i < T * D; ++i)
      out[size_t(i)] = round_act(s.act, f32(double(out[size_t(i)]) + shared[size_t(i)]));
  return out;
}

}  // namespace ref
