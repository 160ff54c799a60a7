// The GEMM error bound of docs/contract.md (comparison classes and tolerances) (issue 9 §2): element (i, j) passes
// when |fast - ref| <= atol + c * u_act * sum_k |x_ik w_jk| (rtol = c * u_act,
// src/engine/diff.cpp). Under cancellation a flat rtol * |ref| raises a false alarm
// that the bound does not; a wrong operand fails both.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

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
  // The constant printed in the tolerance table (docs/contract.md, comparison classes).
  CHECK(gemm_bound_constant(DType::bf16) == Approx(default_tolerance(CompareClass::gemm, DType::bf16).rtol / std::ldexp(1.0, -8)));
  CHECK(gemm_bound_constant(DType::fp16) == Approx(default_tolerance(CompareClass::gemm, DType::fp16).rtol / std::ldexp(1.0, -11)));
  CHECK(gemm_bound_constant(DType::fp32) == Approx(default_tolerance(CompareClass::gemm, DType::fp32).rtol / std::ldexp(1.0, -24)));
}

TEST_CASE("logits bound passes an fp32 gate summed in another order and fails a bf16 gate", "[cpu]") {
  // DeepSeek-V3's gate (D = 7168): cuBLAS's fp32 logits on an H200 erred 4.9e-5,
  // twice atol + rtol |r|; the bound against max(|r|, sum of |terms|) holds any
  // fp32 summation order, here the positive products first and then the
  // negative ones (large partial sums that cancel: a legal order, and a bad
  // one), which the bound against |r| alone fails, while a gate rounded to
  // bf16 (a missing widening) still fails.
  const int64_t T = 32, D = 7168;
  const int E = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  ref::Vec x(size_t(T * D)), w(size_t(E * D));
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng) / std::sqrt(float(D));
  const ref::Vec exact = ref::router_logits(x, w, T, D, E);
  const Tensor ref = from_floats(exact, ElemType::f32, {T, E});
  const Tensor scale = from_floats(ref::gemm_magnitude(x, w, T, D, E), ElemType::f32, {T, E});
  ref::Vec seq(size_t(T * E)), gate_bf16(size_t(T * E));
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      float s = 0.f;
      for (int sign : {1, -1})
        for (int64_t d = 0; d < D; ++d) {
          const float p = x[size_t(t * D + d)] * w[size_t(e * D + d)];
          if ((p >= 0) == (sign > 0)) s += p;
        }
      seq[size_t(t * E + e)] = s;
      gate_bf16[size_t(t * E + e)] = ref::round_act(ref::Act::bf16, exact[size_t(t * E + e)]);
    }
  const Tolerance tol = default_tolerance(CompareClass::logits, DType::bf16);
  const DiffResult in_order = diff_tensors(from_floats(seq, ElemType::f32, {T, E}), ref, CompareClass::logits, tol,
                                           flat(), nullptr, &scale);
  const DiffResult bf16 = diff_tensors(from_floats(gate_bf16, ElemType::f32, {T, E}), ref, CompareClass::logits, tol,
                                       flat(), nullptr, &scale);
  const DiffResult against_r = diff_tensors(from_floats(seq, ElemType::f32, {T, E}), ref, CompareClass::logits, tol,
                                            flat());
  INFO("signs apart: largest error/bound " << in_order.max_bound_ratio << ", max |err| " << in_order.max_abs
                                           << ", against |r| alone " << against_r.mismatches << " of " << against_r.total
                                           << "; bf16 gate: " << bf16.mismatches << " of " << bf16.total);
  CHECK(in_order.mismatches == 0);
  CHECK(against_r.mismatches > 0);  // the false alarm the sum of |terms| removes
  CHECK(bf16.mismatches > bf16.total / 4);
}
