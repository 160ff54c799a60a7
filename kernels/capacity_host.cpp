#include "capacity_host.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ep_host.h"
#include "parallel_errors.h"

namespace moev {

int64_t capacity_of(int64_t T, int K, int E, double factor) {
  return int64_t(std::ceil(double(T) * double(K) / double(E) * factor));
}

CapacityGroups sp_capacity_groups(const SpLayout& l, int K, int E, double factor, const FaultSet& faults) {
  // The pad mask comes from the shard map that placed the tokens: row i is a
  // pad exactly when the map gives it no token (docs/contract.md §11).
  const std::vector<int64_t> map = sp_shard_map(l);
  // Planted (Megatron-LM before "Exclude padding tokens from MoE routing"):
  // pad rows join their SP rank's group, count in its tokens and take slots.
  const bool pads_count = faults.has(Fault::sp_capacity_pad_rows);
  // Planted: every SP rank's cap from the EP rank's whole T, not its shard.
  const bool global_cap = faults.has(Fault::sp_capacity_global_tokens);
  CapacityGroups g;
  g.group_of_token.assign(map.size(), -1);
  for (int64_t s = 0; s < l.S; ++s) {
    int64_t real = 0;
    for (int64_t i = l.offset(s); i < l.offset(s) + l.rows(s); ++i) {
      if (map[size_t(i)] < 0 && !pads_count) continue;
      g.group_of_token[size_t(i)] = int32_t(s);
      ++real;
    }
    g.caps.push_back(capacity_of(global_cap ? l.T : real, K, E, factor));
  }
  return g;
}

void capacity_select(const ExecCtx& ctx, CapacityPolicy policy, const int64_t* counts, int E,
                     const CapacityGroups& groups, const int32_t* token_sorted, const float* score_sorted,
                     uint8_t* keep, int64_t* kept) {
  std::vector<int64_t> start(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) start[size_t(e) + 1] = start[size_t(e)] + counts[e];
  // Planted (TransformerEngine #3346 class): one row past capacity kept.
  const int extra = ctx.faults.has(Fault::capacity_overflow) ? 1 : 0;
  const bool higher = ctx.faults.has(Fault::capacity_tie_higher);
  const size_t G = groups.caps.size();
  const bool one_group = groups.group_of_token.empty();
  ParallelErrors errors;  // the index lists are allocated per expert
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, ctx.threads)) if (ctx.threads > 1)
  for (int e = 0; e < E; ++e) errors.run(e, [&] {
    const int64_t s = start[size_t(e)], n = counts[e];
    std::fill(keep + s, keep + s + n, uint8_t(0));
    // the expert's rows per group, each list in ascending token order
    std::vector<std::vector<int64_t>> rows(G);
    for (int64_t i = s; i < s + n; ++i) {
      const int32_t g = one_group ? 0 : groups.group_of_token[size_t(token_sorted[i])];
      if (g >= 0) rows[size_t(g)].push_back(i);  // a row in no group is never kept
    }
    kept[e] = 0;
    for (size_t g = 0; g < G; ++g) {
      std::vector<int64_t>& idx = rows[g];
      const int64_t take = std::min(int64_t(idx.size()), groups.caps[g] + extra);
      kept[e] += take;
      if (policy == CapacityPolicy::probs && take < int64_t(idx.size()))  // the `take` highest scores first
        std::partial_sort(idx.begin(), idx.begin() + take, idx.end(), [&](int64_t a, int64_t b) {
          // A NaN score ranks above every number (torch.topk's order), so the
          // comparison is a strict weak order (docs/contract.md §11).
          const float x = score_sorted[a], y = score_sorted[b];
          if (std::isnan(x) != std::isnan(y)) return std::isnan(x);
          if (!std::isnan(x) && x != y) return x > y;
          return higher ? token_sorted[a] > token_sorted[b] : token_sorted[a] < token_sorted[b];
        });
      for (int64_t i = 0; i < take; ++i) keep[idx[size_t(i)]] = 1;  // position: the first rows
    }
  });
  errors.rethrow();
}

std::vector<int64_t> capacity_plan(const ExecCtx& ctx, const int64_t* counts, int E, int64_t pad_rows, bool pad,
                                   const uint8_t* keep, const int64_t* kept, const int32_t* token_sorted,
                                   const float* score_sorted, const int32_t* row_of, int64_t assignments, int K,
                                   int32_t* token_out, float* score_out, int32_t* row_of_out, int64_t* out_counts) {
  std::vector<int64_t> in_start(size_t(E) + 1, 0), out_start(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) {
    in_start[size_t(e) + 1] = in_start[size_t(e)] + counts[e];
    out_counts[e] = pad ? pad_rows : kept[e];
    out_start[size_t(e) + 1] = out_start[size_t(e)] + out_counts[e];
  }
  const int64_t N = in_start[size_t(E)], M = out_start[size_t(E)];
  std::vector<int32_t> new_row(static_cast<size_t>(N), -1);
  // Output row o is input row src[o], or a zero filler row (-1): the rows
  // move with the row-map body (on the host executor or the mirror's device).
  std::vector<int64_t> src(static_cast<size_t>(M), -1);
  // Planted: the renormalisation Megatron-LM does not do (docs/frameworks.md §11.1):
  // a token's kept scores scaled back up to its original sum.
  std::vector<float> sum_all, sum_kept;
  const bool renorm = ctx.faults.has(Fault::capacity_renormalize);
  if (renorm) {
    sum_all.assign(size_t(assignments / std::max(K, 1)), 0.f);
    sum_kept = sum_all;
    for (int64_t i = 0; i < N; ++i) {
      sum_all[size_t(token_sorted[i])] += score_sorted[i];
      if (keep[i]) sum_kept[size_t(token_sorted[i])] += score_sorted[i];
    }
  }
  auto group = [&](int e) {
    int64_t o = out_start[size_t(e)];
    for (int64_t i = in_start[size_t(e)]; i < in_start[size_t(e) + 1]; ++i) {
      if (!keep[i]) continue;
      if (o < M) {  // the planted overflow may reach past the last group
        src[size_t(o)] = i;
        token_out[o] = token_sorted[i];
        const int32_t t = token_sorted[i];
        score_out[o] = renorm && sum_kept[size_t(t)] != sum_all[size_t(t)] && sum_kept[size_t(t)] > 0
                           ? score_sorted[i] * (sum_all[size_t(t)] / sum_kept[size_t(t)])
                           : score_sorted[i];
        new_row[size_t(i)] = int32_t(o);
      }
      ++o;
    }
    for (; o < out_start[size_t(e) + 1]; ++o) {  // fillers (pad_to_capacity)
      src[size_t(o)] = -1;
      token_out[o] = -1;
      score_out[o] = 0.f;
    }
  };
  if (ctx.faults.has(Fault::capacity_overflow)) {
    // Planted: a group's row past capacity lands on the next group's first
    // row, written after it (groups from the last to the first).
    for (int e = E - 1; e >= 0; --e) group(e);
  } else {
    for (int e = 0; e < E; ++e) group(e);
  }
  for (int64_t a = 0; a < assignments; ++a) row_of_out[a] = row_of[a] >= 0 ? new_row[size_t(row_of[a])] : -1;
  return src;
}

std::vector<int64_t> capacity_scale_map(const std::vector<int64_t>& src, int64_t dispatch_rows, const FaultSet& faults) {
  std::vector<int64_t> map = src;
  if (faults.has(Fault::fp8_capacity_scales_unmoved)) {
    // Planted: the scale rows stay in dispatch order (output row o takes
    // dispatch row o's scales) while the e4m3 rows are compacted.
    for (size_t o = 0; o < map.size(); ++o) map[o] = int64_t(o) < dispatch_rows ? int64_t(o) : -1;
  } else if (faults.has(Fault::fp8_capacity_filler_scale)) {
    // Planted: a filler row's scales are not zeroed: it repeats the scale
    // row written above it (a stale scale from the row before).
    for (size_t o = 1; o < map.size(); ++o)
      if (map[o] < 0) map[o] = map[o - 1];
  }
  return map;
}

void capacity_apply_fp8(const ExecCtx& ctx, const std::vector<int64_t>& src, int64_t dispatch_rows, const void* q,
                        const float* scale, int64_t D, int64_t nb, void* q_out, float* scale_out) {
  const int64_t M = int64_t(src.size());
  apply_row_map_e4m3(ctx, q, src.data(), M, D, q_out);
  const std::vector<int64_t> smap = capacity_scale_map(src, dispatch_rows, ctx.faults);
  apply_row_map(ctx, DType::fp32, scale, smap.data(), M, nb, scale_out);
}

}  // namespace moev
