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
#include "sp_host.h"

namespace moev {

enum class CapacityPolicy : uint8_t { probs, position };

/// cap = ceil(T * K / E * factor) (docs/contract.md §11).
int64_t capacity_of(int64_t T, int K, int E, double factor);

/// Capacity groups (docs/contract.md §11): rows compete for an expert's slots
/// only within their group. group_of_token[t] is token t's group, -1 for a
/// row that never takes a slot; empty: one group holding every token.
/// caps[g] is group g's capacity; with pad_to_capacity every expert holds
/// sum(caps) rows.
struct CapacityGroups {
  std::vector<int32_t> group_of_token;
  std::vector<int64_t> caps;
  int64_t total_cap() const {
    int64_t n = 0;
    for (int64_t c : caps) n += c;
    return n;
  }
};

/// The groups of the SP layout (docs/contract.md §11, "Capacity with sequence
/// parallelism"): SP rank s is group s with cap from the real tokens it
/// holds; a tail pad row (one the shard map sp_shard_map gives no token) is
/// in no group.
CapacityGroups sp_capacity_groups(const SpLayout& l, int K, int E, double factor, const FaultSet& faults);

/// Which rows of the dispatch survive, per expert and group: keep[i] = 1 for
/// a kept row i. Policy probs: the caps[g] rows of highest score (a NaN
/// above every number), ties to the lower token index; position: the first caps[g] rows (the lowest token
/// indices). kept[e] = rows expert e keeps over all groups.
void capacity_select(const ExecCtx& ctx, CapacityPolicy policy, const int64_t* counts, int E,
                     const CapacityGroups& groups, const int32_t* token_sorted, const float* score_sorted,
                     uint8_t* keep, int64_t* kept);

/// Lays out the capacity-limited dispatch: per expert its kept rows in their
/// order, then (pad) filler rows up to pad_rows. Writes the metadata:
/// out_counts[e] = kept[e], or pad_rows with pad; token_out / score_out per output
/// row (a filler: token -1, score 0); row_of_out maps each assignment (T*K of
/// them, K per token) to its new row or -1. Returns the row map: output row o
/// is dispatch row src[o], or a zero filler row where src[o] = -1. The map
/// and the metadata are computed on the host; the rows then move with
/// apply_row_map (so on the mirror's device, ExecCtx::mirror).
std::vector<int64_t> capacity_plan(const ExecCtx& ctx, const int64_t* counts, int E, int64_t pad_rows, bool pad,
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
