// Host executor: runs a kernel body over [0, n) items on `threads` OpenMP
// threads with a static schedule. Each item is independent, so results do not
// depend on the thread count (tests check this bitwise).
#pragma once

#include <cstdint>

#include "faults.h"

namespace moev {

class Mirror;

struct ExecCtx {
  int threads = 1;
  FaultSet faults;
  /// Set: the entry points run their bodies on this mirror's device
  /// (kernels/device.h); null: on the host executor.
  Mirror* mirror = nullptr;
};

template <class Body>
void host_run(const ExecCtx& ctx, int64_t n, const Body& body) {
  if (ctx.threads <= 1 || n < 2) {
    for (int64_t i = 0; i < n; ++i) body(i, 0, 1);
    return;
  }
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i, 0, 1);
}

}  // namespace moev
