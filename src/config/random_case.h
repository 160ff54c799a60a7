// Random valid case configurations over every case key (issue 11: "a
// generator draws random valid configurations over every key"). Each draw is
// a YAML mapping that goes through the same loader and validation as a case
// file, so the generator cannot produce a configuration a user could not
// write. Draws lean toward MoE edge cases: zero-token ranks, one hot expert,
// K = E, E_l = 1, T*K < E, tiny D, large route_scale, exact ties.
//
// Distributions (each key drawn independently unless said):
//   ep: 1 (30%), 2, 3, 4, 7, 8; E_l: 1, 2, 3, 4, 8; E = ep * E_l (times 1..16 at ep 1)
//   top_k: E (capped at 32) 15%, else uniform in [1, min(E, 8)]
//   tokens: {0, 1, 2, 3, 5, 8, 13, 16, 31, 48}; 3% "big" draws of 600..1200
//     tokens (T*K past the sort's 4096-assignment chunk) with D in 1..8
//   hidden: {1, 2, 3, 7, 8, 16, 33}; 3% "wide" draws of 1024..2048
//   tokens per rank (ep > 1): equal, a list with 25% zeros, or {uniform: [lo, hi]}
//   router: softmax | sigmoid, bias, 30% group-limited (any valid G and kept
//     groups), 20% force-LB, route_norm, 50% route_scale in {0.001 .. 1e6},
//     20% a hot expert
//   experts: identity | swiglu x loop | grouped | batched; shared: none (50%),
//     identity, swiglu x add_after | init_with_shared; 30% score before experts
//   combine: per_add | fp32_accumulate, out_of_place | in_place, aliasing
//     buffers where valid; align {1, 2, 4, 8, 16, 128}, empty_groups, permute,
//     equal-split policy and threshold; 10% loosened tolerance overrides
//   conventions (docs/contract.md §14): each of gate_dtype act, score_multiply act,
//     experts.rounding torchtitan, experts.compute_dtype bf16 with 1/3
#pragma once

#include <cstdint>
#include <string>

#include "case.h"

namespace moev {

/// The one case a flow mapping such as random_case_yaml's describes, loaded
/// and validated as a case file entry; `origin` names it in messages.
Case load_one_case(const std::string& yaml, const std::string& origin);

/// The YAML text of case `index` of the stream `seed` (one flow mapping with
/// a name, no trailing newline). Pure function of (seed, index).
std::string random_case_yaml(uint64_t seed, uint64_t index);

}  // namespace moev
