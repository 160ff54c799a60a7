#include "faults.h"

#include <algorithm>
#include <stdexcept>

namespace moev {

namespace {

/// fault_table's first part: the forward token path's faults.
std::vector<FaultInfo> forward_faults() {
  return {
      {Fault::unstable_sort, "unstable_sort", "expert sort fills each expert's rows in descending token order"},
      {Fault::highest_id_tiebreak, "highest_id_tiebreak", "top-k ties go to the higher expert id"},
      {Fault::unordered_combine, "unordered_combine", "combine adds a token's contributions in descending expert order"},
      {Fault::pointer_alias_guard, "pointer_alias_guard", "in-place combine guard compares data pointers only"},
      {Fault::pad_rows_first, "pad_rows_first", "alignment padding rows placed before each group's data rows"},
      {Fault::unswapped_combine_splits, "unswapped_combine_splits", "reverse all-to-all sends with the dispatch splits"},
      {Fault::offsets_32bit, "offsets_32bit", "expert group row offsets computed in 32-bit arithmetic"},
      {Fault::pad_front, "pad_front", "equal-split padding rows placed at the front of each chunk"},
      {Fault::direct_route_unguarded, "direct_route_unguarded", "direct equal-split route taken without K == E_l"},
      {Fault::stale_weight_cache, "stale_weight_cache", "batched-expert weight cache ignores the weight version"},
      {Fault::local_equal_split_decision, "local_equal_split_decision", "equal-split decision taken per rank, not reduced"},
      {Fault::sort_chunk_offset, "sort_chunk_offset",
       "multi-chunk expert sort scans offsets in (chunk, expert) order: rows leave expert-major order (docs/frameworks.md §2.1)"},
      {Fault::softmax_no_max, "softmax_no_max",
       "router softmax computes exp(l) without subtracting the row max: inf / inf past l ~ 88.7 (docs/frameworks.md §1.2)"},
      {Fault::group_tie_higher, "group_tie_higher",
       "group-limited routing keeps the higher group on equal group scores (docs/frameworks.md §1.2 step 4, §1.7)"},
      {Fault::silu_rounded, "silu_rounded",
       "SwiGLU rounds silu(h1) to the activation dtype before the product, where the contract fuses it (docs/contract.md §8, §14)"},
      {Fault::direct_route_score_before, "direct_route_score_before",
       "direct equal-split route from x taken under score_before_experts: unscaled rows are sent (docs/frameworks.md §6.3)"},
      {Fault::sp_b1_index, "sp_b1_index",
       "SP shard and combine use the B = 1 index t + nlt*s with B > 1 (docs/frameworks.md §10.3, before torchtitan #3604)"},
      {Fault::sp_even_combine, "sp_even_combine",
       "SP combine offsets rank s by its own row count, as if tokens were evenly sharded (torchtitan #3577)"},
      {Fault::sp_tail_pad_score, "sp_tail_pad_score",
       "tail SP pad rows are routed to expert 0 with the router's score, not 0 (docs/frameworks.md §10.2, torchtitan #3193)"},
  };
}

/// Its second part, in the list's order: the backward's, capacity's, the
/// overload factor's, FP8 dispatch's and the conventions' faults.
std::vector<FaultInfo> later_faults() {
  return {
      {Fault::bwd_unswapped_splits, "bwd_unswapped_splits",
       "the all-to-all backward sends with the forward's splits instead of swapping them (docs/frameworks.md §13, §3.5)"},
      {Fault::bwd_unordered_scatter, "bwd_unordered_scatter",
       "the token-gradient scatter-add adds a token's K gradients in descending expert order (docs/frameworks.md §13, §9)"},
      {Fault::bwd_score_grad_rounded, "bwd_score_grad_rounded",
       "the routing-score gradient sums products rounded to the activation dtype (TransformerEngine #1336)"},
      {Fault::bwd_pad_grad_kept, "bwd_pad_grad_kept",
       "the pad backward takes the first M rows of the padded gradient, padding rows included (docs/frameworks.md §13)"},
      {Fault::sp_bwd_token_order, "sp_bwd_token_order",
       "the SP backward returns SP-layout row t as token t's gradient, right for B = 1 only (the #3604 index class, "
       "in the backward; docs/frameworks.md §10.3)"},
      {Fault::bwd_dropped_grad, "bwd_dropped_grad",
       "a capacity-dropped assignment gets a score gradient: its row index -1 clamped to dispatch row 0, not masked "
       "(the drop not replayed in the backward)"},
      {Fault::capacity_renormalize, "capacity_renormalize",
       "capacity dropping renormalises a token's kept scores to its original sum (docs/frameworks.md §11.1 says it must not)"},
      {Fault::capacity_tie_higher, "capacity_tie_higher",
       "capacity policy probs keeps the higher token index among equal scores (docs/frameworks.md §11.4 D3)"},
      {Fault::capacity_overflow, "capacity_overflow",
       "capacity keeps one row past cap per full expert, written over the next expert's first row (TransformerEngine #3346)"},
      {Fault::overload_global_balanced, "overload_global_balanced",
       "the overload factor of an entry divides by the whole group's balanced rows, not one rank's share (docs/frameworks.md §12)"},
      {Fault::overload_cum_final, "overload_cum_final",
       "max_cum divides the running sums where the timeline ends (0 after the backward), not their peaks (docs/frameworks.md §12)"},
      {Fault::fp8_ue8m0_round_down, "fp8_ue8m0_round_down",
       "UE8M0 block scale rounded down to a power of two instead of up: quotients pass 448 and saturate (docs/contract.md §16)"},
      {Fault::fp8_block_straddle, "fp8_block_straddle",
       "FP8 quantiser takes the amax window with a token stride of D + block/2: blocks straddle two tokens (docs/contract.md §16)"},
      {Fault::fp8_scales_unmoved, "fp8_scales_unmoved",
       "EP permute moves the e4m3 rows to expert-major order but leaves their block scales rank-major (docs/contract.md §16)"},
      {Fault::fp8_scale_inverse, "fp8_scale_inverse",
       "FP8 quantiser stores the quotient multiplier 448/amax as the scale, not s = amax/448 (TE's scale for its scale_inv)"},
      {Fault::sp_capacity_pad_rows, "sp_capacity_pad_rows",
       "under SP, tail pad rows count in their SP rank's tokens and take capacity slots (Megatron-LM before padding "
       "tokens were cleared from the routing map; docs/contract.md §11)"},
      {Fault::sp_capacity_global_tokens, "sp_capacity_global_tokens",
       "under SP, every SP rank's capacity is computed from the EP rank's whole T instead of the tokens of its own "
       "shard (docs/contract.md §11)"},
      {Fault::fp8_capacity_scales_unmoved, "fp8_capacity_scales_unmoved",
       "capacity dropping keeps the right e4m3 rows but leaves their block scales in dispatch order (docs/contract.md §11, §16)"},
      {Fault::scores_not_held, "scores_not_held",
       "the router keeps fp32 scores where the case holds them in act (router.score_dtype: act; torchtitan on the CPU "
       "holds them in bf16, docs/contract.md §14): one rounding missing"},
      {Fault::norm_sum_not_held, "norm_sum_not_held",
       "route_norm divides the held scores by their fp32 sum, where the sum of act values is itself held in act "
       "(docs/contract.md §14 router.score_dtype)"},
      {Fault::score_applied_twice, "score_applied_twice",
       "with the score applied to the SwiGLU hidden (score_on_hidden, Megatron-Core's per_token_scale), the combine "
       "multiplies by it again (docs/contract.md §14)"},
      {Fault::hidden_grad_unscaled, "hidden_grad_unscaled",
       "with the score on the SwiGLU hidden, the backward takes the W2 GEMM's gradient dH' as the hidden's gradient, "
       "dropping the score's multiply (docs/contract.md §13)"},
      {Fault::score_grad_scaled_hidden, "score_grad_scaled_hidden",
       "with the score on the SwiGLU hidden, the score gradient sums dH' times the scaled H' the W2 GEMM read, not "
       "the unscaled H the score multiplied (docs/contract.md §13)"},
      {Fault::router_bwd_norm_detached, "router_bwd_norm_detached",
       "the route_norm backward treats the denominator as a constant (detached): gs = gp / den without the "
       "- sum_j gp_j s_j / den^2 every selected score also receives (docs/contract.md §13, router)"},
      {Fault::router_bwd_softmax_diagonal, "router_bwd_softmax_diagonal",
       "the softmax backward takes only the Jacobian's diagonal, g s (1 - s), as for a sigmoid: the other experts' "
       "logits get no gradient (docs/contract.md §13, router)"},
      {Fault::fp8_capacity_filler_scale, "fp8_capacity_filler_scale",
       "a pad_to_capacity filler row gets the stale block scales of the row above it instead of scale 0 (docs/contract.md §16)"},
      {Fault::swiglu_bwd_silu_grad, "swiglu_bwd_silu_grad",
       "the SwiGLU backward takes silu'(h1) as sigmoid(h1), dropping the h1 sigmoid(h1) (1 - sigmoid(h1)) term (docs/frameworks.md §13)"},
      {Fault::swiglu_bwd_fused_rounding, "swiglu_bwd_fused_rounding",
       "the SwiGLU backward under experts.rounding torchtitan uses the fused activation's gradient (dh3 from the unrounded "
       "silu(h1), dh1 from dH h3 unrounded), a fused backward kernel paired with an unfused forward (docs/contract.md §13)"},
      {Fault::swiglu_bwd_wgrad_fp32, "swiglu_bwd_wgrad_fp32",
       "the SwiGLU weight gradients under experts.rounding torchtitan or experts.compute_dtype bf16 are left as fp32 sums, "
       "not rounded to the compute dtype as autograd's bf16 GEMM returns them (docs/contract.md §13)"},
  };
}

}  // namespace

const std::vector<FaultInfo>& fault_table() {
  static const std::vector<FaultInfo> t = [] {
    std::vector<FaultInfo> v = forward_faults();
    const std::vector<FaultInfo> w = later_faults();
    v.insert(v.end(), w.begin(), w.end());
    return v;
  }();
  return t;
}

Fault parse_fault(const std::string& name) {
  // The table is too long for one message line: the names that share a
  // word with the one given (at most 6), and where all are listed.
  std::vector<std::string> words;
  for (size_t at = 0; at <= name.size();) {
    const size_t end = std::min(name.find('_', at), name.size());
    if (end - at >= 3) words.push_back(name.substr(at, end - at));
    at = end + 1;
  }
  std::string near;
  int shown = 0;
  for (const auto& f : fault_table()) {
    if (name == f.name) return f.fault;
    bool shares = false;
    for (const auto& w : words) shares = shares || std::string(f.name).find(w) != std::string::npos;
    if (shares && shown < 6) {
      near += (shown++ ? ", " : "") + std::string(f.name);
    }
  }
  throw std::invalid_argument("unknown fault '" + name + "'; valid: one of the " +
                              std::to_string(fault_table().size()) + " planted faults `moeverify list` prints" +
                              (near.empty() ? std::string() : " (sharing a word with it: " + near + ")"));
}

}  // namespace moev
