// Reference overload factor (docs/contract.md §12): the whole event timeline of a
// run is laid out first (forward entries 1..N, then backward N..1 with
// negated counts), its prefix sums taken per rank, and the peaks read off;
// nothing is kept running.
#include <algorithm>

#include "reference.h"

namespace ref {

OverloadRef overload_factors(const std::vector<std::vector<int64_t>>& actual,
                             const std::vector<std::vector<int64_t>>& balanced, bool backward) {
  OverloadRef o;
  const size_t N = actual.size(), R = N ? actual[0].size() : 0;
  for (size_t e = 0; e < N; ++e) {
    const int64_t most = *std::max_element(actual[e].begin(), actual[e].end());
    int64_t total = 0;
    for (int64_t b : balanced[e]) total += b;
    o.entries.push_back(double(most) / (double(total) / double(R) + 1e-8));
  }
  double sum = 0;
  for (double v : o.entries) sum += v;
  o.avg = N ? sum / double(N) : 0;
  o.max = o.entries.empty() ? 0 : *std::max_element(o.entries.begin(), o.entries.end());
  // timeline[t] = (entry, sign)
  std::vector<std::pair<size_t, int>> timeline;
  for (size_t e = 0; e < N; ++e) timeline.push_back({e, +1});
  if (backward)
    for (size_t e = N; e-- > 0;) timeline.push_back({e, -1});
  for (size_t r = 0; r < R; ++r) {
    std::vector<int64_t> cum_a(timeline.size()), cum_b(timeline.size());
    for (size_t t = 0; t < timeline.size(); ++t) {
      const auto [e, sign] = timeline[t];
      cum_a[t] = (t ? cum_a[t - 1] : 0) + sign * actual[e][r];
      cum_b[t] = (t ? cum_b[t - 1] : 0) + sign * balanced[e][r];
    }
    const int64_t pa = cum_a.empty() ? 0 : std::max<int64_t>(0, *std::max_element(cum_a.begin(), cum_a.end()));
    const int64_t pb = cum_b.empty() ? 0 : std::max<int64_t>(0, *std::max_element(cum_b.begin(), cum_b.end()));
    o.max_cum = std::max(o.max_cum, pb > 0 ? double(pa) / (double(pb) + 1e-8) : 0.0);
  }
  return o;
}

}  // namespace ref
