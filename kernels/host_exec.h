// Host executor: runs a kernel body over [0, n) items on `threads` OpenMP
// threads with a static schedule. Each item is independent, so results do not
// depend on the thread count (tests check this bitwise).
#pragma once

#include <cstdint>
#include <type_traits>

#include "exec.h"  // core/: ExecCtx
#include "faults.h"
#include "parallel_errors.h"

namespace moev {


/// A phased body has `static constexpr int kPhases` and is called as
/// body(phase, item, lane, lanes): the lanes of one item run phase p + 1
/// only after all of them finished phase p (a block barrier on a GPU), so
/// they can cooperate on one item through its output rows. A plain body is
/// called as body(item, lane, lanes). kPhases of a body, 0 when plain:
template <class B, class = void>
struct body_phases {
  static constexpr int value = 0;
};
template <class B>
struct body_phases<B, std::void_t<decltype(B::kPhases)>> {
  static constexpr int value = B::kPhases;
};

/// Item i of a body as a GPU block of `lanes` threads runs it, the lanes one
/// after another (in descending order if asked), phase by phase for a phased
/// body. The lanes of one phase write disjoint elements and read only what
/// earlier phases wrote (the bodies' contract), so this is one valid
/// schedule of the block. The host executor runs lane 0 of 1.
template <class Body>
inline void block_item(const Body& body, int64_t i, int lanes, bool descending = false) {
  auto lane = [&](int j) { return descending ? lanes - 1 - j : j; };
  if constexpr (body_phases<Body>::value > 0) {
    for (int p = 0; p < body_phases<Body>::value; ++p)
      for (int j = 0; j < lanes; ++j) body(p, i, lane(j), lanes);
  } else {
    for (int j = 0; j < lanes; ++j) body(i, lane(j), lanes);
  }
}

/// Items [0, n) on ctx.threads threads, each as a block of `lanes` lanes.
template <class Body>
void host_run(const ExecCtx& ctx, int64_t n, const Body& body, int lanes = 1) {
  if (ctx.threads <= 1 || n < 2) {
    for (int64_t i = 0; i < n; ++i) block_item(body, i, lanes);
    return;
  }
  ParallelErrors errors;  // a body may allocate (the GEMMs' thread-local buffers)
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) errors.run(i, [&] { block_item(body, i, lanes); });
  errors.rethrow();
}

}  // namespace moev
