// The GEMM error bound of docs/contract.md §15 (issue 9 §2): element (i, j) passes
// when |fast - ref| <= atol + c * u_act * sum_k |x_ik w_jk| (rtol = c * u_act,
// src/engine/diff.cpp). Under cancellation a flat rtol * |ref| raises a false alarm
// that the bound does not; a wrong operand fails both.
#include <catch2/catch.hpp>

#include <cmath>

#include "../reference/reference.h"
#include "diff.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {

ref::Act act_of(DType d) { return d == DType::fp32 ? ref::Act::fp32 : d == DType::bf16 ? ref::Act::bf16 : ref::Act::fp16; }

/// Rank 0's expert GEMM of a run: the fast expert outputs, the reference
/// (fp64 GEMMs) on the same rows, and the per-element sum of |terms|.
struct ExpertGemm {
  Tensor fast, ref, scale, wrong;
};

ExpertGemm expert_gemm(const Case& c) {
  RunOptions o;
  o.threads = 2;
  o.keep = RunOptions::Keep::fast_board;
  const CaseReport r = run_case(c, o);
  REQUIRE(r.outcome == Outcome::PASSED);
  const RankBoard& b = r.fast.ranks.at(0);
  const std::vector<int64_t> counts = to_ints(b.at("expert_counts"));
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  const int64_t E_l = int64_t(counts.size()), D = c.hidden, F = c.ffn;
  auto slice = [&](const char* n) {
    ref::Vec v = to_floats(b.at(n));
    v.resize(size_t(E_l * F * D));  // rank 0 owns experts [0, E_l)
    return v;
  };
  ref::Vec X = to_floats(b.at("expert_input"));
  X.resize(size_t(rows * D));
  const ref::Vec w1 = slice("w1"), w3 = slice("w3"), w2 = slice("w2");
  ExpertGemm g;
  const ElemType t = act_elem(c.dtype);
  g.fast = b.at("expert_output");
  g.ref = from_floats(ref::swiglu_experts(act_of(c.dtype), X, counts, D, F, w1, w3, w2), t, {rows, D});
  g.scale = from_floats(ref::swiglu_magnitude(X, counts, D, F, w1, w3, w2), ElemType::f32, {rows, D});
  // A wrong operand: W3 where W1 belongs.
  g.wrong = from_floats(ref::swiglu_experts(act_of(c.dtype), X, counts, D, F, w3, w3, w2), t, {rows, D});
  return g;
}

CoordFn flat() {
  return [](int64_t i) { return std::to_string(i); };
}

}  // namespace

TEST_CASE("gemm bound passes cancellation that a flat rtol fails", "[cpu]") {
  // regressions/verdicts.yaml r28: scores applied before the experts with route_scale
  // 1e6 make sums of |terms| of ~1e6 whose results nearly cancel.
  const Case c = case_named("regressions/verdicts.yaml", "r28");
  const ExpertGemm g = expert_gemm(c);
  const Tolerance tol = tolerance_for(c, CompareClass::gemm);
  const DiffResult bound = diff_tensors(g.fast, g.ref, CompareClass::gemm, tol, flat(), nullptr, &g.scale);
  const DiffResult flat_rtol = diff_tensors(g.fast, g.ref, CompareClass::gemm, tol, flat());
  INFO("bound: " << bound.mismatches << " mismatches, largest error/bound " << bound.max_bound_ratio
                 << "; flat rtol: " << flat_rtol.mismatches << " of " << flat_rtol.total);
  CHECK(bound.mismatches == 0);
  CHECK(flat_rtol.mismatches > 0);
}

TEST_CASE("gemm bound and flat rtol both fail a wrong operand", "[cpu]") {
  for (const char* name : {"r28", "r799"}) {
    const Case c = case_named("regressions/verdicts.yaml", name);
    const ExpertGemm g = expert_gemm(c);
    const Tolerance tol = tolerance_for(c, CompareClass::gemm);
    const DiffResult bound = diff_tensors(g.fast, g.wrong, CompareClass::gemm, tol, flat(), nullptr, &g.scale);
    const DiffResult flat_rtol = diff_tensors(g.fast, g.wrong, CompareClass::gemm, tol, flat());
    INFO(name << ": bound " << bound.mismatches << ", flat " << flat_rtol.mismatches << " of " << bound.total);
    CHECK(bound.mismatches > 0);
    CHECK(flat_rtol.mismatches > 0);
  }
}

TEST_CASE("gemm bound constant c is rtol over the unit roundoff", "[cpu]") {
  // The constant printed in the tolerance table (docs/contract.md §15).
  CHECK(gemm_bound_constant(DType::bf16) == Approx(default_tolerance(CompareClass::gemm, DType::bf16).rtol / std::ldexp(1.0, -8)));
  CHECK(gemm_bound_constant(DType::fp16) == Approx(default_tolerance(CompareClass::gemm, DType::fp16).rtol / std::ldexp(1.0, -11)));
  CHECK(gemm_bound_constant(DType::fp32) == Approx(default_tolerance(CompareClass::gemm, DType::fp32).rtol / std::ldexp(1.0, -24)));
}
