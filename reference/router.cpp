// Reference router (docs/contract.md §1): fp64 logits, scores in fp64 rounded to fp32,
// selection by a full sort of (choice desc, id asc) per token.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

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
  for (size_t i = 0; i < half.size(); ++i) {
    const double v = exact_f32[i], room = gamma * mag[i] + std::ldexp(1.0, -126);
    const float mid = round_act(act, exact_f32[i]);
    const float lo = round_act(act, f32(v - room)), hi = round_act(act, f32(v + room));
    half[i] = std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
  }
  return half;
}

Vec router_scores(const RouterSpec& s, const Vec& logits, int64_t T) {
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
        gs.push_back({-double(f32(double(v[0]) + v[1])), g});
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

Vec topk_scores_for(const RouterSpec& s, const Vec& scores, const Ids& ids, int64_t T) {
  const int E = s.E, K = s.K;
  Vec out(size_t(T * K), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    float* ts = &out[size_t(t * K)];
    for (int k = 0; k < K; ++k) {
      const int32_t e = ids[size_t(t * K + k)];
      ts[k] = e >= 0 && e < E ? scores[size_t(t * E + e)] : std::numeric_limits<float>::quiet_NaN();
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
