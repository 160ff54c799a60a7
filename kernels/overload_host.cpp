#include "overload_host.h"

#include <algorithm>

namespace moev {

OverloadFactors overload_factors(const OverloadInput& in, FaultSet faults) {
  const int N = in.entries, R = in.ranks;
  OverloadFactors f;
  // Per rank, as each rank keeps them during training: running sums of the
  // received and balanced rows, and their peaks.
  std::vector<int64_t> run_a(size_t(R), 0), run_b(size_t(R), 0), peak_a(size_t(R), 0), peak_b(size_t(R), 0);
  auto step = [&](int e, int sign) {
    for (int r = 0; r < R; ++r) {
      run_a[size_t(r)] += sign * in.actual[size_t(e) * size_t(R) + size_t(r)];
      run_b[size_t(r)] += sign * in.balanced[size_t(e) * size_t(R) + size_t(r)];
      peak_a[size_t(r)] = std::max(peak_a[size_t(r)], run_a[size_t(r)]);
      peak_b[size_t(r)] = std::max(peak_b[size_t(r)], run_b[size_t(r)]);
    }
  };
  for (int e = 0; e < N; ++e) {
    int64_t most = 0, sum_b = 0;
    for (int r = 0; r < R; ++r) {
      most = std::max(most, in.actual[size_t(e) * size_t(R) + size_t(r)]);
      sum_b += in.balanced[size_t(e) * size_t(R) + size_t(r)];
    }
    // Planted: the balanced count of the whole group, not one rank's share.
    const double share = faults.has(Fault::overload_global_balanced) ? double(sum_b) : double(sum_b) / double(R);
    f.entries.push_back(double(most) / (share + 1e-8));
    step(e, +1);
  }
  if (in.backward)
    for (int e = N - 1; e >= 0; --e) step(e, -1);
  // Planted: the running sums where the timeline ends (zero after a full
  // backward) taken for their peaks.
  if (faults.has(Fault::overload_cum_final)) peak_a = run_a, peak_b = run_b;
  double sum = 0;
  for (double v : f.entries) {
    sum += v;
    f.max = std::max(f.max, v);
  }
  f.avg = N > 0 ? sum / double(N) : 0;
  for (int r = 0; r < R; ++r)
    f.max_cum = std::max(f.max_cum, peak_b[size_t(r)] > 0 ? double(peak_a[size_t(r)]) / (double(peak_b[size_t(r)]) + 1e-8) : 0.0);
  return f;
}

}  // namespace moev
