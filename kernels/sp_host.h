// Sequence-parallel index math (docs/contract.md §10, docs/frameworks.md §10.2-§10.3) for the
// fast path. One EP rank's T = B*L tokens (flattened b*L + l) are shared by S
// SP ranks. The SP ranks' local tokens are held stacked, SP rank after SP
// rank ("SP layout"): rank s's rows(s) local tokens start at row offset(s).
// The global layout has nlt*S rows; global row g < T is token g, rows >= T
// are padding and are dropped after the combine.
//
//   virtual (torchtitan #3577/#3619 with the #3604 fix): nothing is
//     materialised; nlt = ceil(T/S). B = 1: rank s holds tokens
//     [s*nlt, min((s+1)*nlt, T)) (the last ranks may hold fewer or none).
//     B > 1 needs L % S == 0 (then T % S == 0): every rank holds nlt = B*L_loc
//     tokens, L_loc = L/S, local token t = b*L_loc + l is global
//     b*(L_loc*S) + s*L_loc + l.
//   tail (torchtitan #3193): pad = (-T) mod S zero rows are appended to the
//     flattened tokens, every rank holds nlt rows, local row t is global
//     s*nlt + t; pad rows are routed to expert 0 with score 0.
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"
#include "host_exec.h"

namespace moev {

enum class SpPadding : uint8_t { virtual_, tail };

/// Every region of the SP layout. MOEV_HD so the CUDA executor can use the
/// same index math as the host.
struct SpLayout {
  int64_t T = 0, B = 1, S = 1;
  SpPadding padding = SpPadding::virtual_;
  int64_t nlt = 0;    // rows per SP rank after padding: (T + pad) / S
  int64_t L_loc = 0;  // virtual: local sequence length nlt / B
  uint32_t fault_bits = 0;

  MOEV_HD int64_t global_rows() const { return nlt * S; }
  /// Local rows that SP rank s holds (pad rows included under `tail`).
  MOEV_HD int64_t rows(int64_t s) const {
    if (padding == SpPadding::tail || B > 1) return nlt;
    const int64_t left = T - s * nlt;
    return left < 0 ? 0 : left < nlt ? left : nlt;
  }
  /// First row of SP rank s in the SP layout.
  MOEV_HD int64_t offset(int64_t s) const {
    if (padding == SpPadding::tail || B > 1) return s * nlt;
    const int64_t o = s * nlt;
    return o < T ? o : T;
  }
  /// Global row of local token t of SP rank s (docs/contract.md §10).
  MOEV_HD int64_t global(int64_t s, int64_t t) const {
    const bool b1_formula = (fault_bits & uint32_t(Fault::sp_b1_index)) != 0;
    if (padding == SpPadding::tail || B == 1 || b1_formula) return s * nlt + t;
    const int64_t b = t / L_loc, l = t % L_loc;
    return b * (L_loc * S) + s * L_loc + l;
  }
  /// Global row as the combine computes it: under the sp_even_combine fault
  /// the stride is the rank's own row count (torchtitan #3577:
  /// x_TD.shape[0] * sp_rank), which is wrong for the uneven last ranks.
  MOEV_HD int64_t combine_global(int64_t s, int64_t t) const {
    if ((fault_bits & uint32_t(Fault::sp_even_combine)) != 0 && (padding == SpPadding::tail || B == 1))
      return s * rows(s) + t;
    return global(s, t);
  }
};

SpLayout sp_layout(int64_t T, int64_t B, int64_t S, SpPadding padding, const FaultSet& faults);

/// Shard: SP-layout row i -> source token row of x, or -1 for a tail pad row
/// (a zero row). One entry per SP-layout row.
std::vector<int64_t> sp_shard_map(const SpLayout& l);
/// Gather: global row g in [0, nlt*S) -> SP-layout row of the combine
/// output, or -1 where no rank wrote (virtual padding: zero).
std::vector<int64_t> sp_gather_map(const SpLayout& l);

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

/// Tail pad rows routed to expert 0 with score 0 (docs/frameworks.md §10.2): ids and
/// topk_scores (rows, K) are rewritten in place for SP-layout rows whose
/// global row is >= T; counts (E) are the histogram of the resulting ids.
void sp_route_pad_rows(const ExecCtx& ctx, const SpLayout& l, int K, int E, int32_t* ids, float* topk_scores,
                       int64_t* counts);

}  // namespace moev
