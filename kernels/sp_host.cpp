// Host side of the sequence-parallel index math (sp_host.h): the maps are
// built from SpLayout's single-source formulas and the rows are then moved by
// k::RowMapBody (apply_row_map), the body the EP path uses.
#include "sp_host.h"

#include "bodies.h"
#include "faults.h"

namespace moev {

SpLayout sp_layout(int64_t T, int64_t B, int64_t S, SpPadding padding, const FaultSet& faults) {
  SpLayout l;
  l.T = T;
  l.B = B;
  l.S = S;
  l.padding = padding;
  const int64_t pad = (S - T % S) % S;
  l.nlt = (T + pad) / S;
  l.L_loc = B > 0 ? l.nlt / B : 0;
  l.fault_bits = faults.bits;
  return l;
}

std::vector<int64_t> sp_shard_map(const SpLayout& l) {
  std::vector<int64_t> map(size_t(l.offset(l.S - 1) + l.rows(l.S - 1)), -1);
  for (int64_t s = 0; s < l.S; ++s)
    for (int64_t t = 0; t < l.rows(s); ++t) {
      const int64_t g = l.global(s, t);
      map[size_t(l.offset(s) + t)] = g < l.T ? g : -1;
    }
  return map;
}

std::vector<int64_t> sp_gather_map(const SpLayout& l) {
  std::vector<int64_t> map(size_t(l.global_rows()), -1);
  for (int64_t s = 0; s < l.S; ++s)
    for (int64_t t = 0; t < l.rows(s); ++t) {
      const int64_t g = l.combine_global(s, t);
      if (g >= 0 && g < l.global_rows()) map[size_t(g)] = l.offset(s) + t;  // a fault may leave the buffer
    }
  return map;
}

namespace {

/// One SP-layout row of the tail pad routing: pad rows get K ids of expert 0
/// and score 0 (the fault keeps the router's score); real rows are untouched.
struct PadRouteBody {
  SpLayout l;
  int K;
  int32_t* ids;
  float* topk_scores;
  bool keep_score;  // planted fault sp_tail_pad_score

  MOEV_HD void operator()(int64_t i, int lane, int) const {
    if (lane != 0) return;
    int64_t s = 0;
    while (s + 1 < l.S && l.offset(s + 1) <= i) ++s;
    if (l.global(s, i - l.offset(s)) < l.T) return;
    for (int k = 0; k < K; ++k) {
      ids[i * K + k] = 0;
      if (!keep_score) topk_scores[i * K + k] = 0.f;
    }
  }
};

}  // namespace

void sp_route_pad_rows(const ExecCtx& ctx, const SpLayout& l, int K, int E, int32_t* ids, float* topk_scores,
                       int64_t* counts) {
  const int64_t rows = l.offset(l.S - 1) + l.rows(l.S - 1);
  host_run(ctx, rows, PadRouteBody{l, K, ids, topk_scores, ctx.faults.has(Fault::sp_tail_pad_score)});
  for (int e = 0; e < E; ++e) counts[e] = 0;
  for (int64_t a = 0; a < rows * K; ++a) ++counts[ids[a]];
}

}  // namespace moev
