// Host side of the sequence-parallel index math (sp_host.h): the maps are
// built from SpLayout's single-source formulas and the rows are then moved by
// k::RowMapBody (apply_row_map), the body the EP path uses.
#include "sp_host.h"

#include "bodies.h"
#include "device.h"
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
  l.fault_bits = uint32_t(faults.bits);  // the SP faults are in the low 32 bits
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


void sp_route_pad_rows(const ExecCtx& ctx, const SpLayout& l, int K, int E, int32_t* ids, float* topk_scores,
                       int64_t* counts) {
  const int64_t rows = l.offset(l.S - 1) + l.rows(l.S - 1);
  const PadRouteBody body{l, K, ids, topk_scores, ctx.faults.has(Fault::sp_tail_pad_score)};
  if (ctx.mirror) {  // ids and scores are read and rewritten in place: in(), then written back
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    const size_t n = size_t(rows * K) * 4;
    PadRouteBody d = body;
    d.ids = static_cast<int32_t*>(const_cast<void*>(m.in(ids, n)));
    d.topk_scores = static_cast<float*>(const_cast<void*>(m.in(topk_scores, n)));
    int64_t* dc = static_cast<int64_t*>(m.out(counts, size_t(E) * 8));
    if (rows > 0) m.device().run(d, rows);
    m.device().run(HistogramBody{d.ids, rows * K, dc}, E);
    m.wrote(ids, n);
    m.wrote(topk_scores, n);
    m.wrote(counts, size_t(E) * 8);
    return;
  }
  host_run(ctx, rows, body);
  for (int e = 0; e < E; ++e) counts[e] = 0;
  for (int64_t a = 0; a < rows * K; ++a) ++counts[ids[a]];
}

}  // namespace moev
