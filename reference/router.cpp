// Reference router (docs/contract.md §1): fp64 logits, scores in fp64 rounded to fp32,
// selection by a full sort of (choice desc, id asc) per token.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "reference.h"

namespace ref {

Vec router_logits(const Vec& x, const Vec& wg, int64_t T, int64_t D, int E, GateDtype gate, Act act) {
  using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  MatD xm(T, D), wm(E, D);
  for (int64_t i = 0; i < T * D; ++i) xm.data()[i] = x[size_t(i)];
  for (int64_t i = 0; i < int64_t(E) * D; ++i) wm.data()[i] = wg[size_t(i)];
  const MatD l = xm * wm.transpose();
  Vec out(size_t(T * E));
  for (int64_t i = 0; i < T * E; ++i)
    out[size_t(i)] = gate == GateDtype::act ? round_act(act, f32(l.data()[i])) : f32(l.data()[i]);
  return out;
}

Vec router_logits_halfwidth(const Vec& x, const Vec& wg, int64_t T, int64_t D, int E, Act act) {
  const Vec exact_f32 = router_logits(x, wg, T, D, E);
  const Vec mag = gemm_magnitude(x, wg, T, D, E);
  const double gamma = double(D + 2) * std::ldexp(1.0, -24);
  Vec half(size_t(T * E), 0.f);
  for (size_t i = 0; i < half.size(); ++i)
    half[i] = rounding_halfwidth(act, exact_f32[i], gamma * mag[i] + std::ldexp(1.0, -126));
  return half;
}

namespace {

/// The scores before the held rounding: fp64, rounded to fp32.
Vec scores_f32(const RouterSpec& s, const Vec& logits, int64_t T) {
  const int E = s.E;
  Vec scores(size_t(T * E), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = &logits[size_t(t * E)];
    float* sc = &scores[size_t(t * E)];
    if (s.score == Score::softmax) {
      double m = l[0], sum = 0;
      for (int e = 0; e < E; ++e) m = std::max(m, double(l[e]));
      for (int e = 0; e < E; ++e) sum += std::exp(double(l[e]) - m);
      for (int e = 0; e < E; ++e) sc[e] = f32(std::exp(double(l[e]) - m) / sum);
    } else {
      for (int e = 0; e < E; ++e) sc[e] = f32(1.0 / (1.0 + std::exp(-double(l[e]))));
    }
  }
  return scores;
}

/// Steps 7 and 8 for one token's K gathered scores in the held type
/// (docs/contract.md §14 router.score_dtype): the fp32 sum of the K held
/// scores and the 1e-20 each rounded to it, every quotient and product too.
/// `sum_shift` / `q_shift` move the fp32 sum and quotients by that much
/// before their rounding (topk_scores_halfwidth's neighbours).
void norm_scale_held(const RouterSpec& s, float* ts, double sum_shift = 0, double q_shift = 0) {
  if (s.route_norm) {
    double sum = 0;
    for (int k = 0; k < s.K; ++k) sum = f32(sum + ts[k]);
    const float d = round_act(s.held, f32(double(round_act(s.held, f32(sum + sum_shift))) + 1e-20));
    for (int k = 0; k < s.K; ++k) {
      const double q = f32(double(ts[k]) / d);
      ts[k] = round_act(s.held, f32(q + q_shift * std::fabs(q)));
    }
  }
  for (int k = 0; k < s.K; ++k) ts[k] = round_act(s.held, f32(double(ts[k]) * s.route_scale));
}

}  // namespace

Vec router_scores(const RouterSpec& s, const Vec& logits, int64_t T) {
  Vec scores = scores_f32(s, logits, T);
  if (s.held != Act::fp32)
    for (float& v : scores) v = round_act(s.held, v);
  return scores;
}

Vec router_scores_halfwidth(const RouterSpec& s, const Vec& logits, int64_t T, double rtol, double atol) {
  const Vec exact = scores_f32(s, logits, T);
  Vec half(exact.size(), 0.f);
  for (size_t i = 0; i < half.size(); ++i)
    half[i] = rounding_halfwidth(s.held, exact[i], rtol * std::fabs(double(exact[i])) + atol);
  return half;
}

void select_experts(const RouterSpec& s, const Vec& scores, const Vec& bias, int64_t T, Vec& choice, Ids& ids) {
  const int E = s.E, K = s.K;
  choice.assign(size_t(T * E), 0.f);
  ids.assign(size_t(T * K), 0);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    const float* sc = &scores[size_t(t * E)];
    float* ch = &choice[size_t(t * E)];
    for (int e = 0; e < E; ++e) ch[e] = f32(double(sc[e]) + double(bias[size_t(e)]));
    int32_t* id = &ids[size_t(t * K)];
    if (s.selection == Selection::force_load_balance) {
      for (int k = 0; k < K; ++k) id[k] = int32_t((t * K + k) % E);
      continue;
    }
    if (s.groups > 1) {
      const int per = E / s.groups;
      std::vector<std::pair<double, int>> gs;  // (-group score, group) sorts best first, ties to the lower group
      for (int g = 0; g < s.groups; ++g) {
        std::vector<float> v(ch + g * per, ch + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<float>());
        // Without a bias the choice values are the held scores, and so is their sum.
        const float sum = f32(double(v[0]) + v[1]);
        gs.push_back({-double(s.bias ? sum : round_act(s.held, sum)), g});
      }
      std::sort(gs.begin(), gs.end());
      for (size_t n = size_t(s.limited_groups); n < gs.size(); ++n)
        for (int e = gs[n].second * per; e < (gs[n].second + 1) * per; ++e) ch[e] = ninf;
    }
    std::vector<int> order(static_cast<size_t>(E), 0);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ch[a] > ch[b]; });
    for (int k = 0; k < K; ++k) id[k] = order[size_t(k)];
  }
}

namespace {

/// Step 5 for token t: its K scores at ids (NaN for an id outside [0, E)).
void gather_scores(const RouterSpec& s, const Vec& scores, const Ids& ids, int64_t t, float* ts) {
  for (int k = 0; k < s.K; ++k) {
    const int32_t e = ids[size_t(t * s.K + k)];
    ts[k] = e >= 0 && e < s.E ? scores[size_t(t * s.E + e)] : std::numeric_limits<float>::quiet_NaN();
  }
}

}  // namespace

Vec topk_scores_for(const RouterSpec& s, const Vec& scores, const Ids& ids, int64_t T) {
  const int K = s.K;
  Vec out(size_t(T * K), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    float* ts = &out[size_t(t * K)];
    gather_scores(s, scores, ids, t, ts);
    if (s.held != Act::fp32) {
      norm_scale_held(s, ts);
      continue;
    }
    if (s.route_norm) {
      float sum = 0.f;
      for (int k = 0; k < K; ++k) sum = f32(double(sum) + ts[k]);
      const float denom = f32(double(sum) + 1e-20);
      for (int k = 0; k < K; ++k) ts[k] = f32(double(ts[k]) / denom);
    }
    for (int k = 0; k < K; ++k) ts[k] = f32(double(ts[k]) * s.route_scale);
  }
  return out;
}

Vec topk_scores_halfwidth(const RouterSpec& s, const Vec& scores, const Ids& ids, int64_t T, const Vec* score_half) {
  const Vec mid = topk_scores_for(s, scores, ids, T);
  Vec half(mid.size(), 0.f);
  if (s.held == Act::fp32 || (!s.route_norm && !score_half)) return half;  // no sum, no quotient: one value each
  const int K = s.K;
  std::vector<float> g(static_cast<size_t>(K)), h(static_cast<size_t>(K), 0.f), v(static_cast<size_t>(K));
  for (int64_t t = 0; t < T; ++t) {
    // The gathered held scores: the quotient's numerators.
    gather_scores(s, scores, ids, t, g.data());
    if (score_half) gather_scores(s, *score_half, ids, t, h.data());
    double mag = 0;
    for (int k = 0; k < K; ++k) mag += std::fabs(double(g[size_t(k)])) + double(h[size_t(k)]);
    // An fp32 sum of K terms in any order lands within (K + 1) 2^-24 sum |g|,
    // a quotient within 2 ulps: every held value those neighbours round to.
    const double sum_room = s.route_norm ? double(K + 1) * std::ldexp(mag, -24) : 0.0;
    const double q_room = s.route_norm ? std::ldexp(1.0, -22) : 0.0;
    // With scores known within h (not written: the reference's, each
    // within its own half-width), element k is highest with its score up
    // and the others down, lowest the reverse: every step is monotone so.
    for (int k = 0; k < K; ++k) {
      const size_t i = size_t(t * K + k);
      if (!std::isfinite(mid[i])) continue;
      for (double side : {-1.0, 0.0, 1.0}) {
        if (side != 0 && !score_half) continue;
        for (int j = 0; j < K; ++j)
          v[size_t(j)] = float(double(g[size_t(j)]) + (j == k ? side : -side) * double(h[size_t(j)]));
        for (double ds : {-sum_room, 0.0, sum_room})
          for (double dq : {-q_room, 0.0, q_room}) {
            std::vector<float> w = v;
            norm_scale_held(s, w.data(), ds, dq);
            half[i] = std::max(half[i], std::fabs(w[size_t(k)] - mid[i]));
          }
      }
    }
  }
  return half;
}

Vec topk_scores_tolerance_halfwidth(const RouterSpec& s, const Vec& scores, const Ids& ids, int64_t T, double rtol,
                                    double atol) {
  const int K = s.K;
  const Vec mid = topk_scores_for(s, scores, ids, T);
  Vec half(mid.size(), 0.f);
  std::vector<float> g(static_cast<size_t>(K));
  // Each score's interval; softmax and sigmoid scores are never negative.
  const auto lo = [&](double v) { return std::max(v - (rtol * std::fabs(v) + atol), 0.0); };
  const auto hi = [&](double v) { return v + rtol * std::fabs(v) + atol; };
  for (int64_t t = 0; t < T; ++t) {
    gather_scores(s, scores, ids, t, g.data());
    double lo_sum = 0, hi_sum = 0, sum = 0;
    for (float v : g) lo_sum += lo(v), hi_sum += hi(v), sum += v;
    for (int k = 0; k < K; ++k) {
      const size_t i = size_t(t * K + k);
      const double v = g[size_t(k)];
      double w = rtol * std::fabs(v) + atol;  // without route_norm: the score's own bound
      if (s.route_norm) {
        // x / (x + rest + 1e-20) rises with x and falls with rest (both
        // never negative): highest with the numerator up and the rest down,
        // lowest the reverse.
        const double q = v / (sum + 1e-20);
        const double q_hi = hi(v) / (hi(v) + (lo_sum - lo(v)) + 1e-20);
        const double q_lo = lo(v) / (lo(v) + (hi_sum - hi(v)) + 1e-20);
        w = std::max(std::fabs(q_hi - q), std::fabs(q - q_lo));
      }
      // the fp32 chain's own roundings: K additions, the 1e-20, the quotient, the scale
      half[i] = float(std::fabs(s.route_scale) * w + double(K + 4) * std::ldexp(std::fabs(double(mid[i])), -24));
    }
  }
  return half;
}

RouterOut route(const RouterSpec& s, const Vec& logits, const Vec& bias, int64_t T) {
  RouterOut o;
  o.scores = router_scores(s, logits, T);
  select_experts(s, o.scores, bias, T, o.choice, o.ids);
  o.topk_scores = topk_scores_for(s, o.scores, o.ids, T);
  o.counts.assign(size_t(s.E), 0);
  for (int32_t e : o.ids) ++o.counts[size_t(e)];
  return o;
}

}  // namespace ref
