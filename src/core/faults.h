// Planted faults (docs/architecture.md idea 7). Each names a real bug class from
// docs/frameworks.md; turning one on must make some check fail. They are passed
// explicitly through the executor context, never read from the environment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moev {

enum class Fault : uint64_t {
  none = 0,
  unstable_sort = 1u << 0,        // §2.1: expert sort that does not keep token order
  highest_id_tiebreak = 1u << 1,  // §1.7: top-k ties resolved to the higher expert id
  unordered_combine = 1u << 2,    // §9: contributions added out of ascending-expert order
  pointer_alias_guard = 1u << 3,  // §9.2: in-place guard compares data pointers only
  pad_rows_first = 1u << 4,       // §4: alignment padding rows placed before the data rows
  unswapped_combine_splits = 1u << 5,  // §3.5: reverse all-to-all reuses the dispatch splits
  offsets_32bit = 1u << 6,        // §4: expert group row offsets computed in 32-bit arithmetic
  pad_front = 1u << 7,            // §5.4: equal-split padding placed at the front of each chunk
  local_equal_split_decision = 1u << 8,  // §5.4: pad/no-pad decided per rank, not reduced over EP
  stale_weight_cache = 1u << 9,   // §8.1: batched-expert weight cache ignores the weight version
  direct_route_unguarded = 1u << 10,  // §6.3: direct equal-split route taken without K == E_l
  sort_chunk_offset = 1u << 11,   // §2.1: multi-chunk counting sort scans offsets (chunk, expert), not (expert, chunk)
  softmax_no_max = 1u << 12,      // §1.2: router softmax without subtracting the row max (exp overflows)
  group_tie_higher = 1u << 13,    // §1.2 step 4: equal group scores keep the higher group
  silu_rounded = 1u << 14,        // §8.2: silu(h1) rounded to the activation dtype before the product
  direct_route_score_before = 1u << 15,  // §6.3: direct route from x taken under score_before_experts
  sp_b1_index = 1u << 16,         // §10.3: the B = 1 SP index t + nlt*s used with B > 1 (pre-#3604)
  sp_even_combine = 1u << 17,     // §10.3, #3577: SP combine takes the local row count for nlt (evenly sharded)
  sp_tail_pad_score = 1u << 18,   // §10.2: tail pad rows keep the router's score instead of 0
  // capacity (docs/frameworks.md §11)
  capacity_renormalize = 1u << 19,  // §11.1: kept scores renormalised to the token's original sum after a drop
  capacity_tie_higher = 1u << 20,   // §11.4 D3: equal scores keep the higher token index
  capacity_overflow = 1u << 21,     // TE #3346: one row past capacity kept (written over the next group's first row)
  // overload factor (docs/frameworks.md §12)
  overload_global_balanced = 1u << 22,  // §12: entry OF divides by the group's balanced rows, not one rank's share
  overload_cum_final = 1u << 23,  // §12: max_cum from the running sums where the timeline ends, not their peaks
  // backward (docs/frameworks.md §13; bits 24..29)
  bwd_unswapped_splits = 1u << 24,   // §13, §3.5: the all-to-all backward reuses the forward's send/recv splits
  bwd_unordered_scatter = 1u << 25,  // §13, §9: gradient scatter-add not in ascending expert order
  bwd_score_grad_rounded = 1u << 26, // §13, TE #1336: score gradient summed from products rounded to act
  bwd_pad_grad_kept = 1u << 27,      // §13: pad backward slices the padded gradient instead of dropping padding rows
  bwd_dropped_grad = 1u << 28,       // §11, §13: a capacity-dropped assignment gets a score gradient (row_of -1 clamped to 0)
  swiglu_bwd_silu_grad = 1u << 29,   // §13, §8: SwiGLU backward takes silu'(h1) as sigmoid(h1)
  sp_bwd_token_order = 1u << 30,     // §10, §13: the SP backward takes SP-layout row t as token t (right for B = 1 only)
  // FP8 dispatch (docs/contract.md §16; bits 32..35)
  fp8_ue8m0_round_down = 1ull << 32,  // UE8M0 scale rounded down to a power of two, not up (values pass 448)
  fp8_block_straddle = 1ull << 33,    // the amax window takes a wrong token stride, so a block straddles two tokens
  fp8_scales_unmoved = 1ull << 34,    // the EP permute moves the e4m3 rows but leaves their scales in place
  fp8_scale_inverse = 1ull << 35,     // the stored scale is the quotient multiplier 448/amax, not amax/448 (TE's scale vs scale_inv)
  // capacity with sequence parallelism (docs/contract.md §11; bits 36..37)
  sp_capacity_pad_rows = 1ull << 36,       // tail SP pad rows count in their SP rank's tokens and take capacity slots
  sp_capacity_global_tokens = 1ull << 37,  // every SP rank's cap from the EP rank's whole T, not its own shard
  swiglu_bwd_fused_rounding = 1ull << 38,  // §13: the unfused (torchtitan) SwiGLU backward takes the fused formulas for dh1, dh3
  swiglu_bwd_wgrad_fp32 = 1ull << 39,      // §13: weight gradients left in fp32, not rounded to the compute dtype as autograd does
  // FP8 dispatch with capacity (docs/contract.md §11, §16; bits 40..41)
  fp8_capacity_scales_unmoved = 1ull << 40,  // capacity compacts the e4m3 rows but leaves their scales in dispatch order
  fp8_capacity_filler_scale = 1ull << 41,    // a pad_to_capacity filler row repeats the scales above it, not scale 0
  // scores held in act (docs/contract.md §14 router.score_dtype; bits 42..43)
  scores_not_held = 1ull << 42,    // the router's scores stay fp32 where the case holds them in act
  norm_sum_not_held = 1ull << 43,  // route_norm divides by the fp32 sum of the held scores, not its act rounding
  score_applied_twice = 1ull << 44,  // score_on_hidden: the combine multiplies by the score the experts already applied
  hidden_grad_unscaled = 1ull << 45,      // score_on_hidden backward: dH = dH', the multiply's backward dropped
  score_grad_scaled_hidden = 1ull << 46,  // score_on_hidden backward: the score gradient from H' instead of H
  // router backward (docs/contract.md §13 router; bits 47..48)
  router_bwd_norm_detached = 1ull << 47,     // route_norm backward with the denominator detached (no cross term)
  router_bwd_softmax_diagonal = 1ull << 48,  // softmax backward as s (1 - s) g, the Jacobian's diagonal only
};

struct FaultSet {
  uint64_t bits = 0;
  bool has(Fault f) const { return (bits & uint64_t(f)) != 0; }
};

struct FaultInfo {
  Fault fault;
  const char* name;
  const char* what;
};

/// Every planted fault with its CLI/YAML name; the one table `--fault` uses.
const std::vector<FaultInfo>& fault_table();
/// Parses a fault name; throws std::invalid_argument listing the valid names.
Fault parse_fault(const std::string& name);

}  // namespace moev
