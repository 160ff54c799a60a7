// Capacity and token dropping (docs/contract.md §11, docs/frameworks.md §11: Megatron-LM's
// router-level dropping and drop-and-pad). Applied to a rank's expert-major
// dispatch (expert e owns counts[e] consecutive rows, ascending token inside
// an expert): each expert keeps at most cap rows, in ascending token order;
// a dropped assignment's row disappears (row_of = -1 for it: it contributes
// nothing, its score is not renormalised away); with pad_to_capacity every
// expert has exactly cap rows, the fillers after its kept rows being zero
// rows with score 0 and token index -1 (a sentinel every consumer skips).
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"
#include "faults.h"
#include "host_exec.h"

namespace moev {

enum class CapacityPolicy : uint8_t { probs, position };

/// cap = ceil(T * K / E * factor) (docs/contract.md §11).
int64_t capacity_of(int64_t T, int K, int E, double factor);

/// Which rows of the dispatch survive, per expert: keep[i] = 1 for a kept
/// row i. Policy probs: the cap rows of highest score, ties to the lower
/// token index; position: the first cap rows (the lowest token indices).
/// kept[e] = rows expert e keeps (at most cap).
void capacity_select(const ExecCtx& ctx, CapacityPolicy policy, const int64_t* counts, int E, int64_t cap,
                     const int32_t* token_sorted, const float* score_sorted, uint8_t* keep, int64_t* kept);

/// Lays out the capacity-limited dispatch: per expert its kept rows in their
/// order, then (pad) filler rows up to cap. Writes the metadata:
/// out_counts[e] = kept[e], or cap with pad; token_out / score_out per output
/// row (a filler: token -1, score 0); row_of_out maps each assignment (T*K of
/// them, K per token) to its new row or -1. Returns the row map: output row o
/// is dispatch row src[o], or a zero filler row where src[o] = -1. The map
/// and the metadata are computed on the host; the rows then move with
/// apply_row_map (so on the mirror's device, ExecCtx::mirror).
std::vector<int64_t> capacity_plan(const ExecCtx& ctx, const int64_t* counts, int E, int64_t cap, bool pad,
                                   const uint8_t* keep, const int64_t* kept, const int32_t* token_sorted,
                                   const float* score_sorted, const int32_t* row_of, int64_t assignments, int K,
                                   int32_t* token_out, float* score_out, int32_t* row_of_out, int64_t* out_counts);

/// The map of the block-scale rows under FP8 dispatch (docs/contract.md §11,
/// §16): the rows' own map `src`, so a kept row's scales move with it, a
/// dropped row's leave with it and a filler row's are zero (scale 0). The
/// planted faults fp8_capacity_scales_unmoved (the scales stay in dispatch
/// order, dispatch_rows of them) and fp8_capacity_filler_scale (a filler row
/// repeats the scales above it) act here.
std::vector<int64_t> capacity_scale_map(const std::vector<int64_t>& src, int64_t dispatch_rows, const FaultSet& faults);

/// The FP8 row move of the capacity stage: the e4m3 rows q (D bytes
/// each) by `src` (capacity_plan; a filler is an e4m3 zero row) and their
/// fp32 scale rows (nb each) by capacity_scale_map.
void capacity_apply_fp8(const ExecCtx& ctx, const std::vector<int64_t>& src, int64_t dispatch_rows, const void* q,
                        const float* scale, int64_t D, int64_t nb, void* q_out, float* scale_out);

}  // namespace moev
