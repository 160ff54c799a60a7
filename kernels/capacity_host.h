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

/// Writes the capacity-limited dispatch: per expert its kept rows in their
/// order, then (pad) zero filler rows up to cap. out_counts[e] = kept[e], or
/// cap with pad. row_of_out maps each assignment (T*K of them, K per token)
/// to its new row or -1. Rows are D elements of dt; they move with
/// apply_row_map, so on the mirror's device (ExecCtx::mirror) while the
/// selection and the metadata are computed on the host.
void capacity_apply(const ExecCtx& ctx, const int64_t* counts, int E, int64_t cap, bool pad, const uint8_t* keep,
                    const int64_t* kept, DType dt, const void* rows, int64_t D, const int32_t* token_sorted,
                    const float* score_sorted, const int32_t* row_of, int64_t assignments, int K, void* rows_out,
                    int32_t* token_out, float* score_out, int32_t* row_of_out, int64_t* out_counts);

}  // namespace moev
