// Each planted fault must be caught: the run it affects ends INCORRECT, in the
// stage the fault lives in. The same case without the fault passes, so the
// check is not vacuous.
#include <catch2/catch.hpp>

#include "case.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {

/// Runs the case with and without the fault; returns the failing checks' "slot/tensor" names.
std::vector<std::string> caught_by(const Case& c, Fault f) {
  RunOptions clean;
  clean.threads = 2;
  REQUIRE(run_case(c, clean).outcome == Outcome::PASSED);
  RunOptions faulty = clean;
  faulty.faults.bits = uint64_t(f);
  const CaseReport r = run_case(c, faulty);
  CHECK(r.outcome == Outcome::INCORRECT);
  std::vector<std::string> failed;
  for (const auto& ch : r.checks)
    if (ch.outcome != Outcome::PASSED) failed.push_back(ch.slot + "/" + ch.tensor);
  return failed;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST_CASE("fault unstable_sort is caught by the dispatch order check", "[cpu][fault]") {
  const auto failed = caught_by(case_named("basic.yaml", "exact_fp32"), Fault::unstable_sort);
  CHECK(contains(failed, "dispatch/token_sorted"));
  CHECK(contains(failed, "dispatch/routed_input"));
}

TEST_CASE("fault highest_id_tiebreak is caught on exact router ties", "[cpu][fault]") {
  const auto failed = caught_by(case_named("edge.yaml", "router_ties[router.score=softmax]"), Fault::highest_id_tiebreak);
  CHECK(contains(failed, "routing/ids"));
}

TEST_CASE("fault unordered_combine is caught where bf16 rounding depends on order", "[cpu][fault]") {
  // K = 4: with K = 2 and a zero start the order cannot matter (0 + y1 is exact)
  const auto failed = caught_by(case_named("router.yaml", "bias_group_limited[router.score=softmax]"), Fault::unordered_combine);
  CHECK(contains(failed, "combine/out"));
}

TEST_CASE("fault pointer_alias_guard is caught by the input-unchanged check", "[cpu][fault]") {
  // a view 5 elements into x, and one 400 of 640 bf16 elements in (issue 11 §4)
  for (const char* name : {"in_place_alias_x_offset[dtype=bf16]", "in_place_alias_x_far_offset"}) {
    INFO(name);
    const auto failed = caught_by(case_named("inplace.yaml", name), Fault::pointer_alias_guard);
    CHECK(contains(failed, "combine/x"));
  }
}

TEST_CASE("fault sort_chunk_offset is caught by the multi-chunk sort case", "[cpu][fault]") {
  // T*K = 4400 >= 4096 with threads 2: two sort chunks (one chunk hides the fault)
  const auto failed = caught_by(case_named("edge.yaml", "multi_chunk_sort"), Fault::sort_chunk_offset);
  CHECK(contains(failed, "dispatch/token_sorted"));
  CHECK(contains(failed, "dispatch/routed_input"));
}

TEST_CASE("fault softmax_no_max is caught by the routing scores check on large logits", "[cpu][fault]") {
  // logits past 88.7: exp overflows to inf without the max shift, inf / inf = NaN
  const auto failed = caught_by(case_named("router.yaml", "softmax_large_logits"), Fault::softmax_no_max);
  CHECK(contains(failed, "routing/scores"));
}

TEST_CASE("fault group_tie_higher is caught on exact group-score ties", "[cpu][fault]") {
  for (const char* name : {"group_score_ties[router.score=softmax]", "group_score_ties[router.score=sigmoid]"}) {
    INFO(name);
    const auto failed = caught_by(case_named("router.yaml", name), Fault::group_tie_higher);
    CHECK(contains(failed, "routing/ids"));
  }
}

TEST_CASE("faults of held scores are caught by the routing checks", "[cpu][fault]") {
  // router.score_dtype act (docs/contract.md §14) in bf16 and fp16: scores left
  // in fp32 miss one rounding nearly everywhere; a route_norm denominator
  // left in fp32 moves some quotients by an act ulp.
  for (const char* dt : {"bf16", "fp16"}) {
    INFO(dt);
    Case c = case_named("router.yaml", "bias_group_limited[router.score=softmax]");
    c.router.score_dtype = GateDtype::act;
    c.dtype = std::string(dt) == "bf16" ? DType::bf16 : DType::fp16;
    CHECK(contains(caught_by(c, Fault::scores_not_held), "routing/scores"));
    CHECK(contains(caught_by(c, Fault::norm_sum_not_held), "routing/topk_scores"));
  }
}

TEST_CASE("fault score_applied_twice is caught by the combine check", "[cpu][fault]") {
  // score_on_hidden: the experts already scaled H; a second multiply in the
  // combine scales every output by s once more (route_scale 2.5 makes it big).
  Case c = case_named("conventions.yaml", "score_on_hidden[dtype=bf16]");
  CHECK(contains(caught_by(c, Fault::score_applied_twice), "combine/out"));
}

TEST_CASE("faults of the score on the hidden's backward are caught by experts_bwd", "[cpu][fault]") {
  // hidden_grad_unscaled: dH = dH', the score's multiply dropped (dX off by
  // the factor s); score_grad_scaled_hidden: the score gradient from H' (off
  // by s too). Both rules of the experts: fused and autograd's.
  for (const char* name : {"bwd_score_on_hidden[dtype=bf16]",
                           "bwd_score_on_hidden_megatron[dtype=bf16,score_multiply=fp32,experts.compute_dtype=act]"}) {
    INFO(name);
    const Case c = case_named("backward_swiglu.yaml", name);
    CHECK(contains(caught_by(c, Fault::hidden_grad_unscaled), "experts_bwd/grad_expert_input"));
    CHECK(contains(caught_by(c, Fault::score_grad_scaled_hidden), "experts_bwd/grad_topk_scores"));
  }
}

TEST_CASE("faults of the router backward are caught by router_bwd", "[cpu][fault][backward]") {
  // norm_detached: the route_norm denominator's gradient dropped (with
  // identity experts the true score gradient is 0 up to rounding, the
  // detached one g / den); softmax_diagonal: g s (1 - s), the unchosen
  // experts' logits left without their coupling gradient.
  CHECK(contains(caught_by(case_named("backward.yaml", "bwd_router_sigmoid_norm"), Fault::router_bwd_norm_detached),
                 "router_bwd/grad_scores"));
  const Case ep2 = case_named("backward.yaml", "bwd_router_softmax_norm_ep2");
  CHECK(contains(caught_by(ep2, Fault::router_bwd_norm_detached), "router_bwd/grad_scores@0"));
  const auto diag = caught_by(ep2, Fault::router_bwd_softmax_diagonal);
  CHECK(contains(diag, "router_bwd/grad_logits@0"));
  CHECK_FALSE(contains(diag, "router_bwd/grad_scores@0"));  // the score steps are right
  // held scores (router.score_dtype act): half-widths of a few act units
  // that admit autograd's chain of roundings still see both faults
  CHECK(contains(caught_by(case_named("backward.yaml", "bwd_router_held_sigmoid_norm"),
                           Fault::router_bwd_norm_detached),
                 "router_bwd/grad_scores"));
  const Case held = case_named("backward.yaml", "bwd_router_held_softmax_fp16_ep2");
  CHECK(contains(caught_by(held, Fault::router_bwd_norm_detached), "router_bwd/grad_scores@0"));
  CHECK(contains(caught_by(held, Fault::router_bwd_softmax_diagonal), "router_bwd/grad_logits@0"));
}

TEST_CASE("fault silu_rounded is caught by the activation check, given the same GEMM outputs", "[cpu][fault]") {
  // bf16: rounding silu(h1) before the product moves H by an ulp on many
  // elements; the expert output's GEMM bound alone would hide most of them.
  const auto failed = caught_by(case_named("basic.yaml", "realistic_bf16"), Fault::silu_rounded);
  CHECK(contains(failed, "experts/expert_hidden"));
}

TEST_CASE("fault direct_route_score_before is caught: the direct route would send unscaled rows", "[cpu][fault]") {
  const auto failed = caught_by(case_named("force_lb.yaml", "direct_route_K_eq_El_score_before"), Fault::direct_route_score_before);
  CHECK(contains(failed, "ep_dispatch/recv@0"));
}

TEST_CASE("a run with a planted fault leaves nothing behind for the next run", "[cpu][fault]") {
  // Found by selftest: the force-LB sort-order cache served an order sorted
  // under unstable_sort to the clean runs after it.
  const Case c = case_named("force_lb.yaml", "uneven_T5_E4_K3_R2");
  RunOptions faulty;
  faulty.threads = 2;
  faulty.faults.bits = uint32_t(Fault::unstable_sort);
  CHECK(run_case(c, faulty).outcome == Outcome::INCORRECT);
  RunOptions clean;
  clean.threads = 2;
  CHECK(run_case(c, clean).outcome == Outcome::PASSED);
}
