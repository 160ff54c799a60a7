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


/// A thread-per-item body has `static constexpr bool kThreadPerItem = true`:
/// every executor runs each of its items as lane 0 of 1 (a GPU, one item per
/// thread), so its lanes never cooperate. Whether Body is one:
template <class B, class = void>
struct thread_per_item {
  static constexpr bool value = false;
};
template <class B>
struct thread_per_item<B, std::void_t<decltype(B::kThreadPerItem)>> {
  static constexpr bool value = B::kThreadPerItem;
};

/// Item i of a body as a GPU block of `lanes` threads runs it, the lanes one
/// after another (in descending order if asked); a thread-per-item body as
/// one lane. The lanes write disjoint elements (the bodies' contract), so
/// this is one valid schedule of the block. The host executor runs lane 0 of 1.
template <class Body>
inline void block_item(const Body& body, int64_t i, int lanes, bool descending = false) {
  if constexpr (thread_per_item<Body>::value) lanes = 1;
  for (int j = 0; j < lanes; ++j) body(i, descending ? lanes - 1 - j : j, lanes);
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
