// The verdict on one token's expert selection made by code moeverify did not
// write (docs/contract.md §15). A set S of K experts is a
// valid top-K selection exactly when every expert outside S that could have
// been chosen has a choice value no larger than the smallest value in S:
// min(S) >= max(outside). So any member of an exact tie at the K-th place is
// accepted, and a strictly better expert left out, a worse one taken in, a
// repeated id or an id out of range are not. Under group-limited routing the
// same holds for the groups: every group whose score beats the limit's
// boundary must be eligible, a group tied at the boundary may be, and the
// experts of the eligible groups obey the rule above.
#pragma once

#include <cstdint>
#include <string>

#include "reference.h"

namespace moev {

struct SelectionRule {
  int E = 0, K = 0;
  int groups = 1;          // G contiguous groups of E/G experts (1: none)
  int limited_groups = 0;  // groups kept when groups > 1
  /// Values closer than this count as equal (0: exact). A selection valid
  /// only with slack is a near-tie: reported, not failed.
  double slack = 0;
  /// The type each group score is rounded to after its fp32 sum
  /// (docs/contract.md §14 router.score_dtype act without a bias: the sum of
  /// two act values held in act); fp32: kept as it is.
  ref::Act group_held = ref::Act::fp32;
};

struct SelectionVerdict {
  bool valid = false;
  std::string why;  // when not valid: the first violated rule, in words
};

/// `choice`: the E selection values of one token (score + bias, before any
/// group mask); `ids`: the K experts the implementation chose, any order.
SelectionVerdict judge_selection(const SelectionRule& rule, const float* choice, const int32_t* ids);

/// The slack of a near-tie judged on the reference's scores: the scores
/// tolerance at the K-th chosen value, atol + rtol |choice[kth]|, where kth is
/// the smallest-valued member of `reference_ids` (the reference's K choices).
/// Scaled by the K-th value, not the top one: a large top score must not
/// widen what counts as a tie at the boundary.
double near_tie_slack(double atol, double rtol, int K, const float* choice, const int32_t* reference_ids);

}  // namespace moev
