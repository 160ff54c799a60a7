// How a device's gemm_group lays out its GEMMs (kernels/cuda_exec.cu):
// which of them go as one batched call, and on which of its streams each
// call runs. Plain C++, so that the host's unit tests check the plan the
// GPU follows (tests/test_kernels.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace moev::k {

/// One call of a group's plan: the jobs (indices into the group, ascending)
/// that run as one batched GEMM when there are several, else one GEMM; its
/// FLOPs (the sum of its jobs'); the stream it runs on.
struct GemmUnit {
  std::vector<size_t> jobs;
  double flops = 0;
  int stream = 0;
};

/// The plan for n independent jobs over `streams` streams:
/// - units: the batchable jobs (batchable[i]) of one shape (same(i, j)) as
///   one unit, whether or not they are neighbours in the group (a SwiGLU
///   backward lists W1's, W3's and W2's GEMMs expert by expert); every other
///   job a unit of its own.
/// - order: decreasing FLOPs, ties by first job: the order to enqueue them.
/// - streams: in that order each unit on the stream with the fewest FLOPs so
///   far, the lowest such stream on a tie (longest processing time first).
/// flops(i) is job i's FLOPs; `same` must be an equivalence.
template <class Same, class Flops>
std::vector<GemmUnit> plan_gemm_units(size_t n, const std::vector<bool>& batchable, Same same, Flops flops,
                                      int streams) {
  std::vector<GemmUnit> units;
  std::vector<size_t> shape_unit;  // units holding batchable jobs, one per shape
  for (size_t i = 0; i < n; ++i) {
    GemmUnit* u = nullptr;
    if (batchable[i])
      for (size_t s : shape_unit)
        if (same(units[s].jobs.front(), i)) u = &units[s];
    if (!u) {
      if (batchable[i]) shape_unit.push_back(units.size());
      units.emplace_back();
      u = &units.back();
    }
    u->jobs.push_back(i);
    u->flops += flops(i);
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const GemmUnit& a, const GemmUnit& b) { return a.flops > b.flops; });
  std::vector<double> load(size_t(std::max(streams, 1)), 0.0);
  for (GemmUnit& u : units) {
    const size_t s = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    u.stream = int(s);
    load[s] += u.flops;
  }
  return units;
}

}  // namespace moev::k
