// Local dispatch on the host executor (docs/contract.md §2; the `dispatch`
// slot, src/paths/stages_local.cpp): the expert histogram, the stable
// counting sort of the assignments (a primitive that differs by nature
// between host and device, docs/architecture.md idea 2) and the gather.
#include "moe_host_detail.h"

namespace moev {
using namespace host_detail;

void expert_histogram(const ExecCtx&, const int32_t* ids, int64_t N, int E, int64_t* counts) {
  std::fill(counts, counts + E, int64_t(0));
  for (int64_t a = 0; a < N; ++a) ++counts[ids[a]];
}

// Parallel stable counting sort: chunk c of the assignments is handled by one
// worker; worker c's rows for expert e start after every earlier chunk's rows
// for e, so equal keys keep ascending a. The planted fault fills each expert's
// rows from the back (descending a), an unstable order.
void expert_sort(const ExecCtx& ctx, const int32_t* ids, int64_t N, int E, int32_t* perm) {
  if (ctx.mirror) {  // a device sort has no chunks: sort_chunk_offset has no device form
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    int32_t* dp = static_cast<int32_t*>(m.out(perm, size_t(N) * 4));
    if (N > 0) m.device().sort(static_cast<const int32_t*>(m.in(ids, size_t(N) * 4)), N, E, dp, ctx.faults.has(Fault::unstable_sort));
    m.wrote(perm, size_t(N) * 4);
    return;
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(ctx.threads, N / 4096 + 1));
  const int64_t per = (N + chunks - 1) / chunks;
  std::vector<int64_t> hist(size_t(chunks * E), 0);
  host_run(ctx, chunks, [&](int64_t c, int, int) {
    int64_t* h = hist.data() + c * E;
    for (int64_t a = c * per; a < std::min(N, (c + 1) * per); ++a) ++h[ids[a]];
  });
  // exclusive scan in (expert, chunk) order. The planted fault scans in
  // (chunk, expert) order: with one chunk (N < 4096 or one thread) the two
  // agree, with two or more the rows stop being expert-major (docs/frameworks.md §2.1).
  int64_t run = 0;
  if (ctx.faults.has(Fault::sort_chunk_offset)) {
    for (int64_t c = 0; c < chunks; ++c)
      for (int e = 0; e < E; ++e) {
        const int64_t v = hist[size_t(c * E + e)];
        hist[size_t(c * E + e)] = run;
        run += v;
      }
  } else {
    for (int e = 0; e < E; ++e)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t v = hist[size_t(c * E + e)];
        hist[size_t(c * E + e)] = run;
        run += v;
      }
  }
  if (ctx.faults.has(Fault::unstable_sort)) {
    std::vector<int64_t> count(size_t(E), 0), start(size_t(E), 0);
    for (int64_t a = 0; a < N; ++a) ++count[size_t(ids[a])];
    for (int e = 1; e < E; ++e) start[size_t(e)] = start[size_t(e - 1)] + count[size_t(e - 1)];
    for (int64_t a = 0; a < N; ++a) {
      const int e = ids[a];
      perm[start[size_t(e)] + --count[size_t(e)]] = int32_t(a);
    }
    return;
  }
  host_run(ctx, chunks, [&](int64_t c, int, int) {
    int64_t* h = hist.data() + c * E;
    for (int64_t a = c * per; a < std::min(N, (c + 1) * per); ++a) perm[h[ids[a]]++] = int32_t(a);
  });
}

void dispatch_gather(const ExecCtx& ctx, DType dt, k::ScoreApply apply, const void* x,
                     const int32_t* perm, const float* topk_scores, int64_t N, int64_t D, int K,
                     void* routed, int32_t* token_sorted, float* score_sorted, int32_t* row_of,
                     k::ScoreMultiply smul) {
  dispatch_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    k::GatherBody<T> body{static_cast<const T*>(x), perm, topk_scores, static_cast<T*>(routed),
                          token_sorted, score_sorted, row_of, D, K, apply, smul};
    if (ctx.mirror) {
      // On a device: the metadata pass, then each token's row read once and
      // written to its K rows (kernels/bodies.h ScatterRowsBody), the same
      // bytes as the gather with less traffic.
      Mirror& m = *ctx.mirror;
      Mirror::Scope scope{m};
      if (N == 0) return;
      const int64_t tokens = N / K;
      const size_t rb = size_t(N * D) * sizeof(T);
      const auto* scores = static_cast<const float*>(m.in(topk_scores, size_t(N) * 4));
      auto* rows = static_cast<int32_t*>(m.out(row_of, size_t(N) * 4));
      m.device().run(k::DispatchMetaBody{static_cast<const int32_t*>(m.in(perm, size_t(N) * 4)), scores,
                                         static_cast<int32_t*>(m.out(token_sorted, size_t(N) * 4)),
                                         static_cast<float*>(m.out(score_sorted, size_t(N) * 4)), rows, K},
                     N);
      m.device().run(k::ScatterRowsBody<T>{static_cast<const T*>(m.in(x, size_t(tokens * D) * sizeof(T))), scores, rows,
                                           static_cast<T*>(m.out(routed, rb)), D, K, apply, smul},
                     tokens);
      m.wrote(routed, rb);
      m.wrote(token_sorted, size_t(N) * 4);
      m.wrote(score_sorted, size_t(N) * 4);
      m.wrote(row_of, size_t(N) * 4);
      return;
    }
    host_run(ctx, N, body);
  });
}

}  // namespace moev
