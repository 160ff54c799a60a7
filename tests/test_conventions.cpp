// Framework conventions (docs/contract.md §14): for each option, fast == reference on
// random shapes and dtypes (RapidCheck), and a fixed case showing where the
// option and the default give different results, so neither can silently
// stand in for the other.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <cstring>

#include "case.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {

/// A realistic SwiGLU case with the given extra keys (YAML flow mapping body).
Case conv_case(const std::string& keys) {
  const std::string text = "cases:\n  - {name: conv, data: realistic, seed: 3, experts: {kind: swiglu}, "
                           "shape: {tokens: 40, hidden: 24, ffn: 32, experts: 8, top_k: 2}, " +
                           keys + "}\n";
  return load_cases_text(text, "test_conventions", {}).at(0);
}

CaseReport run_kept(const Case& c) {
  RunOptions o;
  o.threads = 2;
  o.keep = RunOptions::Keep::fast_board;
  return run_case(c, o);
}

/// Elements where tensor `name` of rank 0 differs bitwise between two runs.
int64_t differing(const CaseReport& a, const CaseReport& b, const std::string& name) {
  const Tensor& x = a.fast.at(name, 0);
  const Tensor& y = b.fast.at(name, 0);
  REQUIRE(x.type == y.type);
  REQUIRE(x.shape == y.shape);
  const size_t eb = elem_bytes(x.type);
  int64_t n = 0;
  for (int64_t i = 0; i < x.numel(); ++i)
    n += std::memcmp(static_cast<const uint8_t*>(x.data()) + size_t(i) * eb,
                     static_cast<const uint8_t*>(y.data()) + size_t(i) * eb, eb) != 0;
  return n;
}

/// Inside an rc::prop: the case file `yaml` runs (1 or 2 threads) with every
/// check PASSED or NOT_VERIFIED.
void rc_require_passes(const std::string& yaml) {
  const Case c = load_cases_text(yaml, "prop", {}).at(0);
  RunOptions o;
  o.threads = *rc::gen::inRange(1, 3);
  const CaseReport r = run_case(c, o);
  for (const auto& ch : r.checks)
    if (ch.outcome != Outcome::PASSED && ch.outcome != Outcome::NOT_VERIFIED)
      RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) + " " +
              ch.note);
}

void require_passed(const CaseReport& r) {
  for (const auto& ch : r.checks)
    if (ch.outcome != Outcome::PASSED)
      FAIL(r.c.summary() << ": " << ch.slot << "/" << ch.variant << "/" << ch.tensor << " " << outcome_name(ch.outcome)
                         << " " << ch.note);
  REQUIRE(r.outcome == Outcome::PASSED);
}

struct Option {
  const char* key;      // the option's YAML, as a flow mapping entry
  const char* tensor;   // where it first changes a result
  const char* dtype;    // a dtype in which it must change it
  const char* noop;     // a dtype in which it changes nothing (null: none)
};

const Option kOptions[] = {
    {"router.gate_dtype: act", "logits", "bf16", "fp32"},
    {"router.score_dtype: act", "scores", "bf16", "fp32"},
    {"score_multiply: act", "out", "bf16", "fp32"},
    {"experts.rounding: torchtitan", "expert_hidden", "bf16", "fp32"},
    {"experts.compute_dtype: bf16", "expert_output", "fp32", "bf16"},
    // the score moves into the experts: another product in every dtype
    {"score_on_hidden: on", "expert_output", "fp32", nullptr},
};

}  // namespace

TEST_CASE("conventions differ from the defaults where docs/contract.md §14 says", "[cpu]") {
  for (const Option& o : kOptions) {
    INFO(o.key << " in " << o.dtype);
    const std::string base = std::string("dtype: ") + o.dtype + ", router: {route_norm: on, route_scale: 2.5}";
    const CaseReport def = run_kept(conv_case(base));
    const CaseReport opt = run_kept(conv_case(base + ", " + o.key));
    require_passed(def);
    require_passed(opt);
    CHECK(differing(def, opt, o.tensor) > 0);
  }
}

TEST_CASE("conventions are no-ops where they round to what is already there", "[cpu]") {
  // In fp32 the act roundings of gate_dtype, score_dtype, score_multiply and
  // experts.rounding are the identity; in bf16 so is compute_dtype bf16.
  for (const Option& o : kOptions) {
    if (!o.noop) continue;
    const std::string base = std::string("dtype: ") + o.noop;
    INFO(o.key << " in " << base);
    const CaseReport def = run_kept(conv_case(base));
    const CaseReport opt = run_kept(conv_case(base + ", " + o.key));
    require_passed(opt);
    CHECK(differing(def, opt, "out") == 0);
  }
}

TEST_CASE("conventions fast equals reference", "[cpu][prop]") {
  rc::prop("every convention option and their combinations, random shapes, dtypes, EP and impls", [] {
    const char* dt = *rc::gen::element("fp32", "bf16", "fp16");
    const int ep = *rc::gen::element(1, 1, 2);
    const int E = ep * *rc::gen::inRange(1, 5);
    const int K = *rc::gen::inRange(1, std::min(E, 4) + 1);
    const int64_t T = *rc::gen::element<int64_t>(0, 1, 3, 8, 17, 32);
    const char* gate = *rc::gen::element("fp32", "act");
    const char* held = *rc::gen::element("fp32", "act");
    const char* bias = *rc::gen::element("off", "on");
    const char* smul = *rc::gen::element("fp32", "act");
    const char* rounding = *rc::gen::element("fused", "torchtitan");
    const char* compute = *rc::gen::element("act", "bf16");
    const char* impl = *rc::gen::element("loop", "grouped", "batched");
    const char* before = *rc::gen::element("off", "on");
    const char* shared = *rc::gen::element("none", "swiglu");
    const int64_t D = *rc::gen::element<int64_t>(1, 5, 16), F = *rc::gen::element<int64_t>(1, 8, 12);
    std::ostringstream y;
    y << "cases:\n  - {name: p, data: realistic, seed: " << *rc::gen::inRange(0, 100000) << ", dtype: " << dt
      << ", ep: " << ep << ", shape: {tokens: " << T << ", hidden: " << D << ", ffn: " << F << ", experts: " << E
      << ", top_k: " << K << "}, experts: {kind: swiglu, impl: " << impl << ", rounding: " << rounding
      << ", compute_dtype: " << compute << "}, router: {gate_dtype: " << gate << ", score_dtype: " << held << ", bias: " << bias
      << ", route_norm: on}, score_multiply: "
      << smul << ", score_before_experts: " << before << ", shared_experts: {kind: " << shared << "}}\n";
    RC_CLASSIFY(std::string(gate) == "act", "gate act");
    RC_CLASSIFY(std::string(smul) == "act", "score act");
    RC_CLASSIFY(std::string(held) == "act", "scores held in act");
    RC_CLASSIFY(std::string(rounding) == "torchtitan", "torchtitan rounding");
    RC_CLASSIFY(std::string(compute) == "bf16", "bf16 compute");
    rc_require_passes(y.str());
  });
}

TEST_CASE("score_on_hidden fast equals reference", "[cpu][prop]") {
  rc::prop("the score on the SwiGLU hidden with every expert impl and convention, random shapes and dtypes, "
           "with and without capacity, forward and backward", [] {
    const char* dt = *rc::gen::element("fp32", "bf16", "fp16");
    const int E = *rc::gen::inRange(1, 9);
    const int K = *rc::gen::inRange(1, std::min(E, 4) + 1);
    const int64_t T = *rc::gen::element<int64_t>(0, 1, 3, 8, 17, 32);
    const char* impl = *rc::gen::element("loop", "grouped", "batched");
    const bool force_lb = std::string(impl) == "batched" || *rc::gen::arbitrary<bool>();  // equal counts for batched
    const int64_t D = *rc::gen::element<int64_t>(1, 5, 16), F = *rc::gen::element<int64_t>(1, 8, 12);
    std::ostringstream y;
    y << "cases:\n  - {name: h, data: realistic, seed: " << *rc::gen::inRange(0, 100000) << ", dtype: " << dt
      << ", shape: {tokens: " << T << ", hidden: " << D << ", ffn: " << F << ", experts: " << E << ", top_k: " << K
      << "}, experts: {kind: swiglu, impl: " << impl << ", rounding: " << *rc::gen::element("fused", "torchtitan")
      << ", compute_dtype: " << *rc::gen::element("act", "bf16") << "}, router: {route_norm: on, route_scale: "
      << *rc::gen::element("1", "2.5") << ", force_load_balance: " << (force_lb ? "on" : "off")
      << "}, score_multiply: " << *rc::gen::element("fp32", "act") << ", score_on_hidden: on"
      << ", combine: {accumulate: " << *rc::gen::element("per_add", "fp32_accumulate")
      << "}, shared_experts: {kind: " << *rc::gen::element("none", "swiglu") << "}";
    // the backward (docs/contract.md §13): dH = round(dH' s), the score gradient from the experts
    const bool backward = *rc::gen::arbitrary<bool>();
    if (backward)
      y << ", backward: on, experts.w13_fused: " << *rc::gen::element("off", "on")
        << ", grad_accumulate: " << *rc::gen::element("as_combine", "per_add");
    // after capacity dropping (docs/contract.md §11): the kept rows' scores, a filler's 0
    const bool capacity = !force_lb && *rc::gen::arbitrary<bool>();
    if (capacity)
      y << ", capacity: {factor: " << *rc::gen::element("0.25", "0.5", "1", "4")
        << ", policy: " << *rc::gen::element("probs", "position")
        << ", pad_to_capacity: " << *rc::gen::element("off", "on") << "}";
    y << "}\n";
    RC_CLASSIFY(capacity, "capacity");
    RC_CLASSIFY(backward, "backward");
    rc_require_passes(y.str());
  });
}

TEST_CASE("experts.w13_fused changes the input gradient under the torchtitan rounding only", "[cpu]") {
  // One GEMM over 2F rounded once against two rounded GEMMs added: another
  // dX in bf16 (docs/contract.md §13, §14); the forward and the default
  // rounding's backward (already one GEMM) are the same.
  const std::string bwd = "dtype: bf16, backward: on, ";
  for (const char* rounding : {"torchtitan", "fused"}) {
    INFO(rounding);
    const std::string base = bwd + "experts.rounding: " + rounding;
    const CaseReport split = run_kept(conv_case(base));
    const CaseReport fused = run_kept(conv_case(base + ", experts.w13_fused: on"));
    require_passed(split);
    require_passed(fused);
    CHECK(differing(split, fused, "out") == 0);
    if (std::string(rounding) == "torchtitan") CHECK(differing(split, fused, "grad_expert_input") > 0);
    else CHECK(differing(split, fused, "grad_expert_input") == 0);
  }
}
