// The overload factor of MoE layer entries (docs/contract.md §12, docs/frameworks.md §12:
// Megatron-LM's "overload factor logging"), as a training loop computes it
// while it runs: one entry at a time, each rank keeping running sums.
#pragma once

#include <cstdint>
#include <vector>

#include "faults.h"

namespace moev {

/// Per forward entry e (execution order) and rank r: actual[e * R + r] rows
/// that rank r's experts received, balanced[e * R + r] = T_r * K.
struct OverloadInput {
  int entries = 0, ranks = 0;
  std::vector<int64_t> actual, balanced;
  /// Backward entries N..1 follow the forward ones (each subtracts its
  /// forward counts from the running sums).
  bool backward = false;
};

struct OverloadFactors {
  std::vector<double> entries;  // OF per forward entry
  double avg = 0, max = 0, max_cum = 0;
};

/// OF_e = max_r actual / (sum_r balanced / R + 1e-8); avg and max over the
/// entries; max_cum = max over ranks of the peak running sum of actual over
/// the peak running sum of balanced (+1e-8; 0 where that peak is 0).
OverloadFactors overload_factors(const OverloadInput& in, FaultSet faults = {});

}  // namespace moev
