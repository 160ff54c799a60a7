#include "selection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace moev {

namespace {

/// A group's score: the sum of its two largest choice values, rounded to
/// fp32 as the router computes it (a one-expert group scores its one value).
float group_score(const float* ch, int per) {
  float a = -std::numeric_limits<float>::infinity(), b = a;
  for (int i = 0; i < per; ++i) {
    if (ch[i] > a) b = a, a = ch[i];
    else if (ch[i] > b) b = ch[i];
  }
  return per < 2 ? a : float(double(a) + double(b));
}

}  // namespace

SelectionVerdict judge_selection(const SelectionRule& r, const float* ch, const int32_t* ids) {
  SelectionVerdict v;
  std::vector<char> in_set(size_t(r.E), 0);
  for (int k = 0; k < r.K; ++k) {
    const int32_t e = ids[k];
    if (e < 0 || e >= r.E) {
      v.why = "expert id " + std::to_string(e) + " is out of range [0, " + std::to_string(r.E) + ")";
      return v;
    }
    if (in_set[size_t(e)]) {
      v.why = "expert " + std::to_string(e) + " is chosen twice";
      return v;
    }
    in_set[size_t(e)] = 1;
  }
  float kth = std::numeric_limits<float>::infinity();
  int32_t kth_id = -1;
  for (int k = 0; k < r.K; ++k)
    if (ch[ids[k]] < kth || (ch[ids[k]] == kth && ids[k] > kth_id)) kth = ch[ids[k]], kth_id = ids[k];
  // Which experts could have been chosen.
  std::vector<char> eligible(size_t(r.E), 1);
  if (r.groups > 1) {
    const int G = r.groups, per = r.E / G, L = r.limited_groups;
    std::vector<float> gs(static_cast<size_t>(G));
    for (int g = 0; g < G; ++g) {
      gs[size_t(g)] = group_score(ch + g * per, per);
      gs[size_t(g)] = ref::round_act(r.group_held, gs[size_t(g)]);
    }
    std::vector<float> sorted = gs;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const double bound = sorted[size_t(L - 1)];
    std::vector<char> used(static_cast<size_t>(G), 0), in(static_cast<size_t>(G), 0);
    for (int k = 0; k < r.K; ++k) used[size_t(ids[k] / per)] = 1;
    int taken = 0;
    for (int g = 0; g < G; ++g) {
      const bool beats = gs[size_t(g)] > bound + r.slack, candidate = gs[size_t(g)] >= bound - r.slack;
      if (used[size_t(g)] && !candidate) {
        v.why = "expert of group " + std::to_string(g) + " chosen, but that group's score is below the " +
                std::to_string(L) + " kept groups";
        return v;
      }
      in[size_t(g)] = beats || used[size_t(g)];
      taken += in[size_t(g)];
    }
    if (taken > L) {
      v.why = "experts of " + std::to_string(taken) + " groups are eligible or chosen where " + std::to_string(L) +
              " groups are kept";
      return v;
    }
    // The remaining kept groups come from the tied ones left; each must hold
    // no expert that would beat the smallest chosen value.
    int fill = 0;
    for (int g = 0; g < G && taken + fill < L; ++g) {
      if (in[size_t(g)] || gs[size_t(g)] < bound - r.slack) continue;
      bool harmless = true;
      for (int e = g * per; e < (g + 1) * per; ++e) harmless = harmless && double(ch[e]) <= double(kth) + r.slack;
      fill += harmless;
    }
    if (taken + fill < L) {
      v.why = "the groups tied at the boundary cannot complete the " + std::to_string(L) +
              " kept groups without an expert that beats the chosen ones";
      return v;
    }
    for (int g = 0; g < G; ++g)
      for (int e = g * per; e < (g + 1) * per; ++e) eligible[size_t(e)] = in[size_t(g)];
  }
  for (int e = 0; e < r.E; ++e) {
    if (in_set[size_t(e)] || !eligible[size_t(e)]) continue;
    if (double(ch[e]) > double(kth) + r.slack) {
      v.why = "expert " + std::to_string(e) + " (" + std::to_string(ch[e]) + ") is left out but beats chosen expert " +
              std::to_string(kth_id) + " (" + std::to_string(kth) + ")";
      return v;
    }
  }
  v.valid = true;
  return v;
}

double near_tie_slack(double atol, double rtol, int K, const float* ch, const int32_t* ids) {
  float kth = std::numeric_limits<float>::infinity();
  for (int k = 0; k < K; ++k) kth = std::min(kth, ch[ids[k]]);
  return K > 0 ? atol + rtol * std::fabs(double(kth)) : atol;
}

}  // namespace moev
