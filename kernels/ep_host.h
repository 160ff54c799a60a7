// Expert-parallel index math (docs/contract.md §3, §4, §7): splits, the rank-major ->
// expert-major permute (generic table or equal-count transpose), alignment
// padding. Row maps are int64 (64-bit row arithmetic throughout); a map entry
// < 0 means "zero row". Data is moved by k::RowMapBody on the executor.
#pragma once

#include <cstdint>
#include <vector>

#include "dtype.h"
#include "host_exec.h"

namespace moev {

/// input_splits[r] = sum of counts over rank r's expert block (E/R experts).
std::vector<int64_t> splits_from_counts(const int64_t* counts, int E, int R);

/// Generic permute (docs/contract.md §3): recv is rank-major (p, j); the output is
/// expert-major (j, p). map[q] = source row of output row q.
std::vector<int64_t> permute_map_generic(const int64_t* recv_counts, int R, int E_l);
/// The generic map's 64-bit exclusive prefix over the rank-major segments:
/// entry p*E_l + j is where segment (p, j) starts in the received rows, the
/// last entry (R*E_l) the total.
std::vector<int64_t> rank_major_offsets(const int64_t* recv_counts, int R, int E_l);

/// Equal-count permute (docs/contract.md §7): every segment has c rows; the output is
/// the (R, E_l, c) -> (E_l, R, c) transpose, computed without a table.
/// `inverse` gives the unpermute (expert-major -> rank-major).
struct EqualCountMap {
  int64_t R, E_l, c;
  int inverse;  // 0: permute, 1: unpermute
  MOEV_HD int64_t operator()(int64_t o) const {
    const int64_t outer = inverse ? R : E_l, inner = inverse ? E_l : R;
    const int64_t a = o / (inner * c), b = (o / c) % inner, i = o % c;  // output (a, b, i)
    return (b * outer + a) * c + i;                                   // input (b, a, i)
  }
};

enum class EmptyGroupRows : uint8_t { zero, align };  // an expert with no rows gets 0 or A rows

struct PadLayout {
  std::vector<int64_t> rows;    // m_j: padded group sizes
  std::vector<int64_t> start;   // group start rows (E_l + 1 entries)
  int64_t buffer_rows = 0;      // >= start[E_l]; the zero tail covers no group
};

/// m_j = round_up(count_j, A), or A for an empty group under `align`; then a
/// buffer of round_up(M + E_l*A, A) rows (torchao) under `align`.
PadLayout pad_layout(const int64_t* counts, int E_l, int64_t A, EmptyGroupRows empty, const FaultSet& faults);

/// Padded row -> source row of the unpadded expert-major buffer (or -1):
/// each group's real rows first, zero rows after (the fault puts them first).
std::vector<int64_t> pad_map(const int64_t* counts, const PadLayout& layout, const FaultSet& faults);
/// Unpadded row -> padded row.
std::vector<int64_t> unpad_map(const int64_t* counts, const PadLayout& layout);
/// Equal-split padding (docs/contract.md §5): chunk i's splits[i] rows go to
/// [i*Mstar, i*Mstar + splits[i]), zero rows after them (the fault puts the
/// zeros first). map has R*Mstar entries.
std::vector<int64_t> equal_split_pad_map(const std::vector<int64_t>& splits, int64_t Mstar, const FaultSet& faults);
/// Compaction: the first splits[p] rows of each chunk p, in order.
std::vector<int64_t> equal_split_compact_map(const std::vector<int64_t>& splits, int64_t Mstar);

/// Force-load-balance counts (docs/contract.md §6): floor(T*K/E) + [e < T*K mod E].
std::vector<int64_t> force_lb_counts(int64_t T, int K, int E);

/// The direct equal-split route (docs/contract.md §6, docs/frameworks.md §6.3): the padded
/// send buffer built from x without a gather. Valid only when K == E_l: then
/// destination r receives tokens t = r mod R, once per local expert, so chunk
/// r is x[r::R] repeated E_l times, zero rows after, Mstar rows per chunk.
/// Rows that would overflow a chunk are dropped (only the unguarded fault
/// produces them). map has R*Mstar entries (-1: zero row).
std::vector<int64_t> direct_route_map(int64_t T, int R, int E_l, int64_t Mstar);

/// The inverse of a permutation map: inv[map[q]] = q.
std::vector<int64_t> invert_map(const std::vector<int64_t>& map);

/// The equal-count transpose (or its inverse) over n rows, by k::FnRowMapBody.
void apply_equal_count(const ExecCtx& ctx, DType dt, const void* src, EqualCountMap m, int64_t n, int64_t D, void* dst);

/// dst[i] = src[map[i]] (zero row where map[i] < 0) for i in [0, n).
void apply_row_map(const ExecCtx& ctx, DType dt, const void* src, const int64_t* map, int64_t n, int64_t D, void* dst);

/// The same two moves for rows of D e4m3 bytes (FP8 dispatch, docs/contract.md
/// §16); a zero row is +0 bytes. The rows' fp32 block scales move with the
/// DType::fp32 forms above, D / block columns wide.
void apply_row_map_e4m3(const ExecCtx& ctx, const void* src, const int64_t* map, int64_t n, int64_t D, void* dst);
void apply_equal_count_e4m3(const ExecCtx& ctx, const void* src, EqualCountMap m, int64_t n, int64_t D, void* dst);

}  // namespace moev
