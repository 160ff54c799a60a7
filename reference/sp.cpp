// Reference sequence-parallel sharding and gather (docs/contract.md §10). The slices
// are found by walking the sequences position by position in the global view;
// no local -> global index formula is used, so a wrong formula in kernels/
// (docs/frameworks.md §10.3: the B = 1 index with B > 1; torchtitan #3577: a stride
// of the local row count) cannot be copied here.
#include "reference.h"

#include <cstddef>

using std::size_t;

namespace ref {

SpShard sp_shard(int64_t T, int64_t B, int64_t S, SpPadding padding) {
  SpShard sh;
  const int64_t pad = (S - T % S) % S;
  sh.nlt = (T + pad) / S;
  sh.rows_per_rank.assign(size_t(S), 0);
  const int64_t L = B > 0 ? T / B : 0;
  for (int64_t s = 0; s < S; ++s) {
    if (padding == SpPadding::tail) {
      // the flattened tokens and their pad rows, cut in S equal chunks
      for (int64_t pos = 0; pos < T + pad; ++pos)
        if (pos / sh.nlt == s) sh.position.push_back(pos);
    } else if (B == 1) {
      // one sequence cut in chunks of nlt; the tail is virtual, never held
      for (int64_t pos = 0; pos < T; ++pos)
        if (pos / sh.nlt == s) sh.position.push_back(pos);
    } else {
      // every sequence is cut in S chunks of L/S positions; rank s holds
      // chunk s of sequence 0, then of sequence 1, ...
      const int64_t chunk = L / S;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t l = 0; l < L; ++l)
          if (l / chunk == s) sh.position.push_back(b * L + l);
    }
    sh.rows_per_rank[size_t(s)] = int64_t(sh.position.size());
    for (int64_t q = 0; q < s; ++q) sh.rows_per_rank[size_t(s)] -= sh.rows_per_rank[size_t(q)];
  }
  return sh;
}

Vec sp_shard_rows(const SpShard& sh, const Vec& x, int64_t T, int64_t D) {
  Vec out(sh.position.size() * size_t(D), 0.f);
  for (size_t i = 0; i < sh.position.size(); ++i)
    if (sh.position[i] < T)
      for (int64_t c = 0; c < D; ++c) out[i * size_t(D) + size_t(c)] = x[size_t(sh.position[i] * D + c)];
  return out;
}

Vec sp_global_rows(const SpShard& sh, const Vec& out, int64_t S, int64_t D) {
  Vec g(size_t(sh.nlt * S * D), 0.f);
  for (size_t i = 0; i < sh.position.size(); ++i)
    for (int64_t c = 0; c < D; ++c) g[size_t(sh.position[i] * D + c)] = out[i * size_t(D) + size_t(c)];
  return g;
}

void sp_route_pad_rows(const SpShard& sh, int64_t T, int K, int E, Ids& ids, Vec& topk_scores, Counts& counts) {
  for (size_t i = 0; i < sh.position.size(); ++i)
    if (sh.position[i] >= T)
      for (int k = 0; k < K; ++k) {
        ids[i * size_t(K) + size_t(k)] = 0;
        topk_scores[i * size_t(K) + size_t(k)] = 0.f;
      }
  counts.assign(size_t(E), 0);
  for (int32_t e : ids) ++counts[size_t(e)];
}

}  // namespace ref
