// Reference local dispatch, combine and SwiGLU experts (docs/contract.md §2, §8).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "blocked.h"
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

namespace {

/// Expert j's weights rounded to `ca` in fp64 (the values' GEMMs) and, for
/// the bounds, their absolute values in fp32 (exact: act values).
/// w13 = [W1; W3] (2F, D): h1 and h3 come from one GEMM, X packed once.
struct ExpertWeights {
  MatD w13, w2;
  MatF a13, a2;
};

/// What swiglu_core computes: the trace (h13, H, Y), the h13 half-widths,
/// the error scale of Y.
struct SwigluWant {
  bool trace = false, halfwidth = false, magnitude = false;
};

/// n weights of `w` from element `at` as fp32 values rounded to `ca`: the
/// rounding is skipped where it is the identity (the stored type's values are
/// all `ca` values: the same type, or any type into fp32), which is every
/// case but compute_dtype bf16 over fp32/fp16 weights.
void decode_rounded(WeightView w, size_t at, int64_t n, Act ca, float* out) {
  w.decode(at, n, out);
  if (ca != w.type && ca != Act::fp32)
    with_act(ca, [&](auto c) {
      for (int64_t i = 0; i < n; ++i) out[i] = round_act_to<c.value>(out[i]);
    });
}

ExpertWeights expert_weights(Act ca, WeightView W1, WeightView W3, WeightView W2, int64_t j, int64_t D, int64_t F,
                             const SwigluWant& want) {
  ExpertWeights w;
  const bool abs = want.halfwidth || want.magnitude;
  const size_t at = size_t(j * F * D);
  MatF v(2 * F, D);
  decode_rounded(W1, at, F * D, ca, v.data());
  decode_rounded(W3, at, F * D, ca, v.data() + F * D);
  w.w13 = v.cast<double>();
  if (abs) w.a13 = v.cwiseAbs();
  if (want.trace || want.magnitude) {
    MatF v2(D, F);
    decode_rounded(W2, at, D * F, ca, v2.data());
    if (want.trace) w.w2 = v2.cast<double>();
    if (want.magnitude) w.a2 = v2.cwiseAbs();
  }
  return w;
}

/// An upper bound of |silu'| on [a - d, a + d] (widened by a bf16 rounding of
/// a): silu' lies in [-0.0999, 1.0999], and below -2.4 (its minimum) |silu'|
/// grows with x, so there the right end's value bounds it.
double silu_slope_bound(double a, double d) {
  const double hi = a + d + std::ldexp(std::fabs(a), -8);
  if (!(hi <= -2.5)) return 1.1;
  const double sig = 1.0 / (1.0 + std::exp(-hi));
  return std::fabs(sig * (1.0 + hi * (1.0 - sig)));
}

/// SwiGLU over expert-major rows with X and the weights rounded to `ca`, in
/// row blocks on `threads` threads (reference/blocked.h). Every GEMM of values
/// is an fp64 Eigen product; the sums of |terms| are fp32 products of
/// absolute values made upper bounds (abs_upper). The same h1 and h3
/// serve the trace, the half-widths and the error scale.
SwigluTrace swiglu_core(Act act, Act ca, const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1,
                        WeightView W3, WeightView W2, SiluRounding rounding, const SwigluWant& want, int threads,
                        const float* row_scale = nullptr) {
  int64_t rows = 0;
  std::vector<int64_t> first(counts.size(), 0);
  for (size_t j = 0; j < counts.size(); ++j) first[j] = rows, rows += counts[j];
  SwigluTrace o;
  if (want.trace) {
    o.Y.assign(size_t(rows * D), 0.f);
    o.h13.assign(size_t(rows * 2 * F), 0.f);
    o.H.assign(size_t(rows * F), 0.f);
  }
  if (want.halfwidth) o.h13_halfwidth.assign(size_t(rows * 2 * F), 0.f);
  if (want.magnitude) o.magnitude.assign(size_t(rows * D), 0.f);
  const double gamma = double(D + 2) * std::ldexp(1.0, -24);
  over_expert_blocks(
      counts, threads, [&](int64_t j) { return expert_weights(ca, W1, W3, W2, j, D, F, want); },
      [&](const ExpertWeights& w, int64_t j, int64_t r0, int64_t r1) {
        const int64_t n = r1 - r0, g0 = first[size_t(j)] + r0;  // g0: the block's first row overall
        MatD x(n, D);
        with_act(ca, [&](auto c) {
          for (int64_t i = 0; i < n * D; ++i) x.data()[i] = round_act_to<c.value>(X[size_t(g0 * D + i)]);
        });
        const MatD h13 = x * w.w13.transpose();  // [h1 | h3], (n, 2F) row-major
        const auto h1 = h13.leftCols(F), h3 = h13.rightCols(F);
        MatD m13;  // sum of |terms| of [h1 | h3], for the bounds
        if (want.halfwidth || want.magnitude) m13 = abs_product_nt(x.cwiseAbs().cast<float>(), w.a13);  // exact: act values
        // The elementwise steps run with act known at compile time and exp in
        // a loop of its own, so that the rest vectorises.
        std::vector<double> ex(static_cast<size_t>(F));
        if (want.trace) {
          MatD H(n, F);
          with_act(ca, [&](auto c) {
            // locals, not captures: the loops below vectorise
            const bool tt = rounding == SiluRounding::torchtitan;
            double* e = ex.data();
            for (int64_t r = 0; r < n; ++r) {
              float* a = &o.h13[size_t((g0 + r) * 2 * F)];
              float* b = a + F;
              float* hr = &o.H[size_t((g0 + r) * F)];
              const double* v = &h13(r, 0);  // row r of [h1 | h3] (row-major)
              double* Hd = &H(r, 0);
              for (int64_t f = 0; f < F; ++f) {
                a[f] = round_act_to<c.value>(f32(v[f]));
                b[f] = round_act_to<c.value>(f32(v[F + f]));
              }
              for (int64_t f = 0; f < F; ++f) e[f] = std::exp(-double(a[f]));
              for (int64_t f = 0; f < F; ++f) {
                const float s = f32(double(a[f]) / (1.0 + e[f]));
                const float silu = tt ? round_act_to<c.value>(s) : s;
                hr[f] = round_act_to<c.value>(f32(double(silu) * b[f]));
              }
              // score_on_hidden: H' = round(float(H) * s), the W2 GEMM's operand
              if (row_scale)
                for (int64_t f = 0; f < F; ++f) hr[f] = round_act_to<c.value>(f32(double(hr[f]) * row_scale[g0 + r]));
              for (int64_t f = 0; f < F; ++f) Hd[f] = hr[f];
            }
          });
          const MatD y = H * w.w2.transpose();
          with_act(act, [&](auto a) {
            with_act(ca, [&](auto c) {
              for (int64_t i = 0; i < n * D; ++i)
                o.Y[size_t(g0 * D + i)] = round_act_to<a.value>(round_act_to<c.value>(f32(y.data()[i])));
            });
          });
        }
        if (want.halfwidth)
          with_act(ca, [&](auto c) {
            const double* v = h13.data();
            const double* m = m13.data();
            float* hw = &o.h13_halfwidth[size_t(g0 * 2 * F)];
            const double tiny = std::ldexp(1.0, -126);
            for (int64_t i = 0; i < n * 2 * F; ++i) {
              const double room = gamma * m[i] + tiny;
              const float mid = round_act_to<c.value>(f32(v[i]));
              const float lo = round_act_to<c.value>(f32(v[i] - room)), hi = round_act_to<c.value>(f32(v[i] + room));
              const float width = std::max(hi - mid, mid - lo);
              hw[i] = std::fabs(mid) <= std::numeric_limits<float>::max() ? width : 0.f;  // 0 where mid is inf or NaN
            }
          });
        if (want.magnitude) {
          MatD Heff(n, F);
          for (int64_t r = 0; r < n; ++r) {
            for (int64_t f = 0; f < F; ++f) ex[size_t(f)] = std::exp(-h1(r, f));
            for (int64_t f = 0; f < F; ++f) {
              const double a = h1(r, f), b = h3(r, f);
              const double sig = 1.0 / (1.0 + ex[size_t(f)]);
              const double silu = a * sig, dsilu = sig * (1.0 + a * (1.0 - sig));
              // first-order propagation of an error of m13(r, f) in h1 and of m13(r, F + f) in h3
              Heff(r, f) = std::fabs(silu * b) + std::fabs(dsilu * b) * m13(r, f) + std::fabs(silu) * m13(r, F + f);
              // and the product of the two errors, which the first order drops: where h1 and h3
              // both cancel to 0, silu(h1) and silu'(h1) h3 vanish, yet a correct fast H is
              // silu'(xi) d1 d3 with |d| <= gamma m13 (the h13 accumulation bound, §8). As a
              // scale (times rtol >= gamma): gamma m1 m3 max|silu'| near h1.
              Heff(r, f) += gamma * silu_slope_bound(a, gamma * m13(r, f)) * m13(r, f) * m13(r, F + f);
            }
            if (row_scale) Heff.row(r) *= std::fabs(double(row_scale[g0 + r]));
          }
          const MatD y = abs_product_nt(abs_f32_up(Heff), w.a2);
          for (int64_t i = 0; i < n * D; ++i) o.magnitude[size_t(g0 * D + i)] = f32(y.data()[i]);
        }
      });
  return o;
}

}  // namespace

SwigluTrace swiglu_experts_traced(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F,
                                  WeightView W1, WeightView W3, WeightView W2, SiluRounding rounding,
                                  Compute compute, int threads, bool bounds, const float* row_scale) {
  // ca: the dtype the GEMMs and the activation round to; the inputs are
  // rounded to it first (exact when ca == act).
  const Act ca = compute == Compute::bf16 ? Act::bf16 : act;
  SwigluWant want;
  want.trace = true;
  want.halfwidth = bounds;
  // The error scale is of the unrounded inputs: the same GEMMs when ca == act.
  want.magnitude = bounds && ca == act;
  SwigluTrace o = swiglu_core(act, ca, X, counts, D, F, W1, W3, W2, rounding, want, threads, row_scale);
  if (bounds && ca != act) o.magnitude = swiglu_magnitude(X, counts, D, F, W1, W3, W2, threads, row_scale);
  return o;
}

Vec swiglu_experts(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1, WeightView W3,
                   WeightView W2) {
  return swiglu_experts_traced(act, X, counts, D, F, W1, W3, W2).Y;
}

Vec swiglu_hidden(Act act, const Vec& h13, int64_t rows, int64_t F, Vec& halfwidth, SiluRounding rounding,
                  const float* row_scale) {
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
  const double fmax = std::numeric_limits<float>::max();
  std::vector<double> silu(static_cast<size_t>(F));
  // act known at compile time and exp in a loop of its own: the rest vectorises
  with_act(act, [&](auto c) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* h1 = &h13[size_t(r * 2 * F)];
      const float* h3 = h1 + F;
      float* hr = &H[size_t(r * F)];
      float* wr = &halfwidth[size_t(r * F)];
      for (int64_t f = 0; f < F; ++f) silu[size_t(f)] = std::exp(-double(h1[f]));
      for (int64_t f = 0; f < F; ++f) {
        // silu in fp32 as the contract computes it: exp(-a) overflows fp32
        // past a < -88.72 (then silu is -0, and -0 * inf is NaN, where the
        // fp64 value would still be tiny and give inf), and silu is rounded
        // to fp32 before the product.
        const double e = silu[size_t(f)] > fmax ? std::numeric_limits<double>::infinity() : silu[size_t(f)];
        silu[size_t(f)] = double(f32(double(h1[f]) / (1.0 + e)));
      }
      if (rounding == SiluRounding::torchtitan) {
        // silu(h1) itself is rounded to act: an fp32 silu within eps of the
        // exact one may round to either neighbour of a midpoint, and each
        // choice gives its own product, rounded once more.
        for (int64_t f = 0; f < F; ++f) {
          const double sv = silu[size_t(f)], b = h3[f];
          const double sroom = eps * std::fabs(sv) + tiny;
          const double cands[3] = {round_act_to<c.value>(f32(sv - sroom)), round_act_to<c.value>(f32(sv)),
                                   round_act_to<c.value>(f32(sv + sroom))};
          const float mid = round_act_to<c.value>(f32(cands[1] * b));
          // written out (no inner loop): the loop over f then vectorises; a
          // NaN term leaves width as it was, in the same order as a loop
          float width = 0.f;
          auto see = [&](double sc) {
            const double p = sc * b, room = eps * std::fabs(p) + tiny * std::fabs(b);
            width = std::max(width, std::fabs(round_act_to<c.value>(f32(p - room)) - mid));
            width = std::max(width, std::fabs(round_act_to<c.value>(f32(p + room)) - mid));
          };
          see(cands[0]);
          see(cands[1]);
          see(cands[2]);
          hr[f] = mid;
          wr[f] = std::fabs(mid) <= std::numeric_limits<float>::max() ? width : 0.f;  // 0 where mid is inf or NaN
        }
        continue;
      }
      for (int64_t f = 0; f < F; ++f) {
        const double b = h3[f], v = silu[size_t(f)] * b;
        const float mid = round_act_to<c.value>(f32(v));
        const double room = eps * std::fabs(v) + tiny * std::fabs(b);
        const float lo = round_act_to<c.value>(f32(v - room)), hi = round_act_to<c.value>(f32(v + room));
        const float width = std::max(hi - mid, mid - lo);
        hr[f] = mid;
        wr[f] = std::fabs(mid) <= std::numeric_limits<float>::max() ? width : 0.f;  // 0 where mid is inf or NaN
      }
    }
  });
  if (row_scale) {
    // score_on_hidden: H' = round(float(H) * s), one fp32 product and one
    // rounding, monotone in H: the ends of [H - w, H + w] bound where any
    // accepted H lands.
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t f = 0; f < F; ++f) {
        const size_t i = size_t(r * F + f);
        const double s = row_scale[r];
        auto scaled = [&](double h) { return round_act(act, f32(h * s)); };
        const float mid = scaled(H[i]);
        const float width = std::max(std::fabs(scaled(double(H[i]) + halfwidth[i]) - mid),
                                     std::fabs(scaled(double(H[i]) - halfwidth[i]) - mid));
        H[i] = mid;
        halfwidth[i] = std::fabs(mid) <= std::numeric_limits<float>::max() ? width : 0.f;
      }
  }
  return H;
}

Vec gemm_magnitude(const Vec& X, const Vec& W, int64_t rows, int64_t D, int64_t n, int threads) {
  Vec m(size_t(rows * n), 0.f);
  MatF aw(n, D);
  for (int64_t i = 0; i < n * D; ++i) aw.data()[i] = std::fabs(W[size_t(i)]);
  parallel_items((rows + kRowBlock - 1) / kRowBlock, threads, [&](int64_t b) {
    const int64_t r0 = b * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
    MatF ax(r1 - r0, D);
    for (int64_t i = 0; i < (r1 - r0) * D; ++i) ax.data()[i] = std::fabs(X[size_t(r0 * D + i)]);
    const MatD s = abs_product_nt(ax, aw);
    for (int64_t i = 0; i < s.size(); ++i) m[size_t(r0 * n + i)] = f32(s.data()[i]);
  });
  return m;
}

Vec swiglu_h13_halfwidth(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1,
                         WeightView W3, int threads) {
  SwigluWant want;
  want.halfwidth = true;
  return swiglu_core(act, act, X, counts, D, F, W1, W3, WeightView{}, SiluRounding::fused, want, threads).h13_halfwidth;
}

Vec swiglu_output_on_hidden(Act act, Act ca, const Vec& H, const Counts& counts, int64_t D, int64_t F, WeightView W2,
                            Vec& halfwidth) {
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  Vec Y(size_t(rows * D), 0.f);
  halfwidth.assign(Y.size(), 0.f);
  const double gamma = double(F + 2) * std::ldexp(1.0, -24);
  int64_t r0 = 0;
  MatF w(D, F);
  for (size_t j = 0; j < counts.size(); r0 += counts[j], ++j) {
    const int64_t n = counts[j];
    if (n == 0) continue;
    decode_rounded(W2, size_t(int64_t(j) * D * F), D * F, ca, w.data());
    // H holds ca values as written: no rounding of its own here
    const MatF h = Eigen::Map<const MatF>(H.data() + r0 * F, n, F);
    const MatD y = h.cast<double>() * w.cast<double>().transpose();
    const MatD room = gamma * abs_product_nt(h.cwiseAbs(), w.cwiseAbs());  // sum |h w|, an upper bound
    with_act(act, [&](auto a) {
      with_act(ca, [&](auto c) {
        gemm_out(Rounder<c.value, a.value>{}, y, room, Y, halfwidth, size_t(r0 * D), true);
      });
    });
  }
  return Y;
}

Vec swiglu_magnitude(const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1, WeightView W3,
                     WeightView W2, int threads, const float* row_scale) {
  // Act::fp32: the values as they are (round_act to fp32 is the identity).
  SwigluWant want;
  want.magnitude = true;
  return swiglu_core(Act::fp32, Act::fp32, X, counts, D, F, W1, W3, W2, SiluRounding::fused, want, threads, row_scale)
      .magnitude;
}

namespace {

/// The routed rows of each token, in ascending row order (a counting sort of
/// token_sorted; capacity filler rows, token -1, belong to none): token t's
/// rows are rows[start[t] .. start[t + 1]).
struct TokenRows {
  std::vector<int64_t> start;
  std::vector<int64_t> rows;
  /// Throws std::invalid_argument where a token id is T or more, or where
  /// `rows` (the routed rows given) or `scores` is shorter than
  /// token_sorted: inputs that contradict each other (a check fed a wrong
  /// stage's outputs) are refused, never read past.
  TokenRows(const Ids& token_sorted, int64_t T, int64_t routed_rows, size_t scores) : start(size_t(T + 1), 0) {
    if (int64_t(token_sorted.size()) > routed_rows || token_sorted.size() > scores)
      throw std::invalid_argument("combine: " + std::to_string(token_sorted.size()) + " entries of token_sorted for " +
                                  std::to_string(routed_rows) + " routed rows and " + std::to_string(scores) +
                                  " scores");
    for (int32_t t : token_sorted) {
      if (t >= T)
        throw std::invalid_argument("combine: token_sorted holds token " + std::to_string(t) + " of " +
                                    std::to_string(T));
      if (t >= 0) ++start[size_t(t) + 1];
    }
    for (int64_t t = 0; t < T; ++t) start[size_t(t + 1)] += start[size_t(t)];
    rows.resize(size_t(start[size_t(T)]));
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (size_t i = 0; i < token_sorted.size(); ++i)
      if (token_sorted[i] >= 0) rows[size_t(next[size_t(token_sorted[i])]++)] = int64_t(i);
  }
};

/// body(t0, t1) over blocks of tokens on `threads` threads: each token's
/// output row is written by one thread, so the result does not depend on
/// `threads`.
template <class Body>
void over_tokens(int64_t T, int threads, Body body) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(threads, T));
  if (n <= 1) return body(int64_t(0), T);
  // A body allocates its accumulators; no exception may leave a thread's
  // function (std::terminate): each is kept and rethrown here.
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> pool;
  for (int64_t k = 0; k < n; ++k)
    pool.emplace_back([&, k] {
      try {
        body(T * k / n, T * (k + 1) / n);
      } catch (...) {
        errors[size_t(k)] = std::current_exception();
      }
    });
  for (auto& th : pool) th.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace

Vec combine_magnitude(const CombineSpec& s, RowsRef rows_magnitude, Act rows_act, const Ids& token_sorted,
                      const Vec& score_sorted, const Vec& init_magnitude, const Vec& shared_magnitude, int64_t T,
                      int64_t D, int threads) {
  const TokenRows tr(token_sorted, T, rows_magnitude.rows, score_sorted.size());
  Vec out(size_t(T * D));
  over_tokens(T, threads, [&](int64_t t0, int64_t t1) {
    std::vector<double> m(static_cast<size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < D; ++c) m[size_t(c)] = init_magnitude[size_t(t * D + c)];
      for (int64_t j = tr.start[size_t(t)]; j < tr.start[size_t(t + 1)]; ++j) {
        const int64_t i = tr.rows[size_t(j)];
        const double w = s.apply == ScoreApply::after_experts ? std::fabs(double(score_sorted[size_t(i)])) : 1.0;
        const uint8_t* row = rows_magnitude.row(i);
        for (int64_t c = 0; c < D; ++c)
          m[size_t(c)] += w * std::fabs(decode_act(rows_act, row + size_t(c) * act_bytes(rows_act)));
      }
      for (int64_t c = 0; c < D; ++c)
        out[size_t(t * D + c)] =
            f32(m[size_t(c)] + (s.shared_add == SharedAdd::add_after ? shared_magnitude[size_t(t * D + c)] : 0.0));
    }
  });
  return out;
}

namespace {

/// Token rows [t0, t1) of the combine: each element's terms in ascending
/// routed-row order, as docs/contract.md §2 states. `A` is a template argument so the
/// decode and the roundings inline into a branch-free column loop.
template <Act A>
void combine_tokens(const CombineSpec& s, RowsRef routed_out, const TokenRows& tr, const Vec& score_sorted,
                    const Vec& shared, int64_t D, Vec& out, int64_t t0, int64_t t1) {
  const bool after = s.apply == ScoreApply::after_experts;
  Vec wide(s.acc == Accumulate::fp32_accumulate ? size_t(D) : 0);  // fp32 accumulators of one token
  for (int64_t t = t0; t < t1; ++t) {
    float* o = out.data() + t * D;
    if (s.acc == Accumulate::fp32_accumulate) std::copy(o, o + D, wide.begin());
    for (int64_t j = tr.start[size_t(t)]; j < tr.start[size_t(t + 1)]; ++j) {
      const int64_t i = tr.rows[size_t(j)];
      const float sc = s.smul == ScoreMultiply::act ? round_act(A, score_sorted[size_t(i)]) : score_sorted[size_t(i)];
      const uint8_t* row = routed_out.row(i);
      if (s.acc == Accumulate::per_add) {
        for (int64_t c = 0; c < D; ++c) {
          float y = decode_act(A, row + size_t(c) * act_bytes(A));
          if (after) y = round_act(A, f32(double(y) * sc));
          o[c] = round_act(A, f32(double(o[c]) + y));
        }
      } else {
        for (int64_t c = 0; c < D; ++c) {
          float y = decode_act(A, row + size_t(c) * act_bytes(A));
          if (after) y = round_act(A, f32(double(y) * sc));
          wide[size_t(c)] = f32(double(wide[size_t(c)]) + y);
        }
      }
    }
    if (s.acc == Accumulate::fp32_accumulate)
      for (int64_t c = 0; c < D; ++c) o[c] = round_act(A, wide[size_t(c)]);
    if (s.shared_add == SharedAdd::add_after)
      for (int64_t c = 0; c < D; ++c) o[c] = round_act(A, f32(double(o[c]) + shared[size_t(t * D + c)]));
  }
}

}  // namespace

Vec combine(const CombineSpec& s, RowsRef routed_out, const Ids& token_sorted,
            const Vec& score_sorted, const Vec& init, const Vec& shared, int64_t T, int64_t D, int threads) {
  Vec out = init;
  const TokenRows tr(token_sorted, T, routed_out.rows, score_sorted.size());
  over_tokens(T, threads, [&](int64_t t0, int64_t t1) {
    switch (s.act) {
      case Act::fp32: return combine_tokens<Act::fp32>(s, routed_out, tr, score_sorted, shared, D, out, t0, t1);
      case Act::bf16: return combine_tokens<Act::bf16>(s, routed_out, tr, score_sorted, shared, D, out, t0, t1);
      case Act::fp16: return combine_tokens<Act::fp16>(s, routed_out, tr, score_sorted, shared, D, out, t0, t1);
    }
  });
  return out;
}

namespace {

/// A float at most (down) or at least (up) v: the fp32 sums of an any-order
/// interval end, never inside it.
float float_beyond(double v, bool up) {
  const float f = float(v);
  if (up) return double(f) < v ? std::nextafter(f, INFINITY) : f;
  return double(f) > v ? std::nextafter(f, -INFINITY) : f;
}

}  // namespace

Vec any_order_halfwidth(const AnyOrderSum& s, RowsRef rows, const Ids& token_sorted, const Vec& score_sorted,
                        const Vec& init, const Vec& shared, const Vec& ascending, int64_t T, int64_t D) {
  const TokenRows tr(token_sorted, T, rows.rows, score_sorted.size());
  const double u32 = std::ldexp(1.0, -24);
  const double u_act = s.act == Act::fp32 ? u32 : s.act == Act::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  // Half the act type's least subnormal (the absolute error a rounding may
  // add), and the least magnitude that rounds to infinity in act.
  const double eta = s.act == Act::fp32 ? std::ldexp(1.0, -150) : s.act == Act::bf16 ? std::ldexp(1.0, -134)
                                                                                    : std::ldexp(1.0, -25);
  const double top = s.act == Act::fp16 ? 65520.0 : s.act == Act::bf16 ? std::ldexp(2 - std::ldexp(1.0, -8), 127)
                                                                       : std::ldexp(2 - std::ldexp(1.0, -24), 127);
  // An fp32 sum rounded to act (a single rounding where act is fp32).
  const double step = s.act == Act::fp32 ? u32 : (1 + u32) * (1 + u_act) - 1;
  const size_t eb = act_bytes(s.act);
  Vec out(size_t(T * D), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t k = tr.start[size_t(t + 1)] - tr.start[size_t(t)];
    // (1 + u)^n for n = k - 1 (a zero start) and k, u of the mode's additions
    const double u = s.acc == Accumulate::per_add ? step : u32;
    const double grow[2] = {std::pow(1 + u, double(k - 1)), std::pow(1 + u, double(k))};
    for (int64_t d = 0; d < D; ++d) {
      const size_t e = size_t(t * D + d);
      const double v0 = init.empty() ? 0.0 : double(init[e]), sh = shared.empty() ? 0.0 : double(shared[e]);
      if (k <= 1 || (k == 2 && v0 == 0)) continue;  // every order adds alike: w = 0
      double X = v0, S = std::fabs(v0);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = tr.rows[size_t(tr.start[size_t(t)] + j)];
        float y = decode_act(s.act, rows.row(i) + size_t(d) * eb);
        if (s.multiply) {
          const float sc = s.smul == ScoreMultiply::act ? round_act(s.act, score_sorted[size_t(i)])
                                                        : score_sorted[size_t(i)];
          y = round_act(s.act, f32(double(y) * sc));
        }
        X += y;
        S += std::fabs(y);
      }
      S *= 1 + std::ldexp(1.0, -40);  // X and S are double sums of floats: near exact
      const double n = double(k - (v0 == 0 ? 1 : 0)), g = grow[v0 == 0 ? 0 : 1];
      const double r = ascending[e];
      double w;
      if (s.acc == Accumulate::per_add) {
        const double reach = g * S + std::fabs(sh);
        double err = (g - 1) * S + n * eta;
        if (!shared.empty()) err += step * reach + eta;
        w = reach * (1 + step) >= top ? INFINITY : err + std::fabs(X + sh - r);
      } else {
        const double E = (g - 1) * S + n * std::ldexp(1.0, -150);
        float lo = round_act(s.act, float_beyond(X - E, false)), hi = round_act(s.act, float_beyond(X + E, true));
        if (!shared.empty()) {
          lo = round_act(s.act, f32(double(lo) + sh));
          hi = round_act(s.act, f32(double(hi) + sh));
        }
        w = std::isinf(lo) || std::isinf(hi) ? INFINITY : std::max(double(hi) - r, r - double(lo));
      }
      out[e] = float_beyond(w, true);
    }
  }
  return out;
}

}  // namespace ref
