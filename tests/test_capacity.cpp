// Capacity and token dropping (docs/contract.md §11, docs/frameworks.md §11.4 D1-D4): random
// configurations pass every check, experts keep at most cap rows (exactly cap
// with padding), a dropped assignment adds exactly nothing, a cap of at least
// T equals the dropless run bit for bit, and the planted faults are caught.
// RapidCheck prints its seed; RC_PARAMS="seed=N" replays.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../kernels/capacity_host.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

TEST_CASE("capacity properties", "[cpu][capacity][prop]") {
  rc::prop("every check passes and experts keep at most cap rows (exactly cap with padding)", [] {
    Case c;
    c.ep = *rc::gen::element(1, 2, 4);
    c.num_experts = c.ep * *rc::gen::inRange(1, 4);
    c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 4) + 1);
    c.hidden = *rc::gen::inRange<int64_t>(1, 9);
    c.ffn = 8;
    for (int r = 0; r < c.ep; ++r)
      c.tokens_per_rank.push_back(*rc::gen::weightedOneOf<int64_t>({{1, rc::gen::just<int64_t>(0)}, {4, rc::gen::inRange<int64_t>(1, 40)}}));
    c.capacity.factor = *rc::gen::element(0.25, 0.5, 1.0, 1.5, 100.0);
    c.capacity.policy = *rc::gen::element(CapacityPolicy::probs, CapacityPolicy::position);
    c.capacity.pad_to_capacity = *rc::gen::element(Switch::off, Switch::on);
    c.data = *rc::gen::element(DataMode::exact, DataMode::realistic);
    c.dtype = *rc::gen::element(DType::fp32, DType::bf16);
    c.align = *rc::gen::element<int64_t>(1, 1, 4);
    c.experts.kind = *rc::gen::element(ExpertKind::identity, ExpertKind::swiglu);
    c.backward = *rc::gen::element(Switch::off, Switch::on);
    c.score_before_experts = *rc::gen::element(Switch::off, Switch::on);
    RunOptions o;
    o.keep = RunOptions::Keep::fast_board;
    const CaseReport r = run_case(c, o);
    for (const auto& ch : r.checks)
      if (token_path_fails(ch))
        RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) + " " + ch.note);
    for (int q = 0; q < c.ep; ++q) {
      const int64_t cap = capacity_of(c.tokens_on(q), c.top_k, c.num_experts, c.capacity.factor);
      for (int64_t n : to_ints(r.fast.at("counts", q))) {
        RC_ASSERT(n <= cap);
        if (c.capacity.pad_to_capacity == Switch::on) RC_ASSERT(n == cap);
      }
      // The backward replays the drops (docs/contract.md §11): a dropped
      // assignment's score gradient is exactly 0.
      if (c.backward == Switch::on) {
        const std::vector<int64_t> row_of = to_ints(r.fast.at("row_of", q));
        const Tensor& g = r.fast.at("grad_topk_scores", q);
        RC_ASSERT(g.numel() == int64_t(row_of.size()));
        for (size_t a = 0; a < row_of.size(); ++a)
          if (row_of[a] < 0) RC_ASSERT(g.as<float>()[a] == 0.f);
      }
    }
  });
}

TEST_CASE("fault bwd_dropped_grad is caught by the capacity backward cases", "[cpu][capacity][backward][fault]") {
  int cases = 0;
  for (const Case& c : load_cases(std::string(MOEV_SOURCE_DIR) + "/cases/capacity.yaml", {})) {
    if (c.name.rfind("backward_drops", 0) != 0) continue;
    INFO(c.name);
    ++cases;
    REQUIRE(run_case(c, RunOptions{}).outcome == Outcome::PASSED);
    RunOptions o;
    o.faults.bits = uint32_t(Fault::bwd_dropped_grad);
    CHECK(run_case(c, o).outcome == Outcome::INCORRECT);
  }
  CHECK(cases == 5);
}

TEST_CASE("a dropped assignment adds exactly nothing to its token", "[cpu][capacity]") {
  // Identity experts, fp32, per-add: out[t] is the ordered sum of round(x[t] * s)
  // over the token's kept assignments, in ascending expert order; worked
  // here from the routing and the kept row map.
  Case c = case_named("capacity.yaml", "exact_ties");
  RunOptions o;
  o.keep = RunOptions::Keep::fast_board;
  const CaseReport r = run_case(c, o);
  REQUIRE(r.outcome == Outcome::PASSED);
  const std::vector<int64_t> ids = to_ints(r.fast.at("ids", 0)), row_of = to_ints(r.fast.at("row_of", 0));
  const std::vector<float> s = to_floats(r.fast.at("topk_scores", 0)), x = to_floats(r.fast.at("x", 0)),
                           out = to_floats(r.fast.at("out", 0));
  const int64_t T = c.tokens, D = c.hidden, K = c.top_k;
  int64_t dropped = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<int64_t, float>> kept;  // (expert, score)
    for (int64_t k = 0; k < K; ++k) {
      if (row_of[size_t(t * K + k)] < 0) {
        ++dropped;
        continue;
      }
      kept.push_back({ids[size_t(t * K + k)], s[size_t(t * K + k)]});
    }
    std::sort(kept.begin(), kept.end());
    for (int64_t d = 0; d < D; ++d) {
      float v = 0.f;
      for (const auto& [e, sc] : kept) v += x[size_t(t * D + d)] * sc;
      CHECK(out[size_t(t * D + d)] == v);
    }
  }
  CHECK(dropped > 0);
}

TEST_CASE("policy probs ranks a NaN score above every number", "[cpu][capacity]") {
  // docs/contract.md §11: fp16 held scores with route_norm make NaN top-K
  // scores (0/0); NaN ranks above every number, NaNs by the lower token.
  const int64_t counts[] = {5};
  const int32_t tok[] = {0, 1, 2, 3, 4};
  const float nan = std::nanf("");
  const float sc[] = {1.f, nan, 0.5f, -nan, 2.f};
  CapacityGroups g;
  g.caps = {2};
  uint8_t keep[5];
  int64_t kept[1];
  capacity_select(ExecCtx{}, CapacityPolicy::probs, counts, 1, g, tok, sc, keep, kept);
  CHECK(kept[0] == 2);
  CHECK(std::vector<uint8_t>(keep, keep + 5) == std::vector<uint8_t>{0, 1, 0, 1, 0});
  g.caps = {3};
  capacity_select(ExecCtx{}, CapacityPolicy::probs, counts, 1, g, tok, sc, keep, kept);
  CHECK(std::vector<uint8_t>(keep, keep + 5) == std::vector<uint8_t>{0, 1, 0, 1, 1});
  // the shrunk fuzz cases: NaN on either token, the fast path against the reference
  for (const char* name : {"nan_score_first", "nan_score_second"}) {
    RunOptions o;
    o.keep = RunOptions::Keep::fast_board;
    const CaseReport r = run_case(case_named("regressions/capacity_nan_score.yaml", name), o);
    CHECK(r.outcome == Outcome::PASSED);
    CHECK(to_ints(r.fast.at("counts", 0))[0] == 1);
  }
}

TEST_CASE("a cap of at least T gives the dropless output bit for bit", "[cpu][capacity]") {
  for (const char* name : {"no_drop", "ep4_zero_token_rank[capacity.policy=probs,capacity.pad_to_capacity=off]"}) {
    Case c = case_named("capacity.yaml", name);
    c.capacity.factor = 1000;  // cap >= T on every rank
    c.capacity.pad_to_capacity = Switch::off;
    Case dropless = c;
    dropless.capacity.factor = 0;
    RunOptions o;
    o.keep = RunOptions::Keep::fast_board;
    const CaseReport a = run_case(c, o), b = run_case(dropless, o);
    REQUIRE(a.outcome == Outcome::PASSED);
    REQUIRE(b.outcome == Outcome::PASSED);
    for (int q = 0; q < c.ep; ++q) {
      const Tensor& ya = a.fast.at("out", q);
      const Tensor& yb = b.fast.at("out", q);
      REQUIRE(ya.bytes() == yb.bytes());
      CHECK((ya.bytes() == 0 || std::memcmp(ya.data(), yb.data(), ya.bytes()) == 0));
    }
  }
}

TEST_CASE("the planted capacity faults are caught on the shipped cases", "[cpu][capacity][fault]") {
  RunOptions o;
  o.faults.bits = uint32_t(Fault::capacity_renormalize);
  CHECK(any_starts(failing(run_case(case_named("capacity.yaml", "hot_expert_pad"), o)), "capacity/score_sorted"));
  o.faults.bits = uint32_t(Fault::capacity_tie_higher);
  CHECK(any_starts(failing(run_case(case_named("capacity.yaml", "exact_ties"), o)), "capacity/"));
  o.faults.bits = uint32_t(Fault::capacity_overflow);
  CHECK(any_starts(failing(run_case(case_named("capacity.yaml", "hot_expert_pad"), o)), "capacity/routed_input"));
  CHECK(any_starts(failing(run_case(case_named("capacity.yaml", "exact_ties"), o)), "capacity/counts"));
}

namespace {

/// Real tokens SP rank s holds (docs/contract.md §10), worked out here from the
/// layout rules: B > 1 under virtual padding, T/S per rank; otherwise the
/// chunk [s*nlt, (s+1)*nlt) of the flattened tokens, cut at T.
int64_t real_tokens(const Case& c, int64_t T, int64_t s) {
  const int64_t nlt = (T + c.sp - 1) / c.sp;
  if (c.batch > 1 && c.sp_padding == SpPadding::virtual_) return T / c.sp;
  return std::max<int64_t>(0, std::min(nlt, T - s * nlt));
}

/// One random case with capacity and sp > 1.
Case random_capacity_sp_case() {
  Case c;
  c.ep = *rc::gen::element(1, 1, 2);
  c.sp = *rc::gen::element(2, 3, 4, 8);
  c.sp_padding = *rc::gen::element(SpPadding::virtual_, SpPadding::tail);
  c.num_experts = c.ep * *rc::gen::inRange(1, 5);
  c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 3) + 1);
  c.hidden = *rc::gen::inRange<int64_t>(1, 9);
  c.ffn = 8;
  if (*rc::gen::element(false, true)) {  // batch > 1: seq_len a multiple of sp under virtual padding
    c.batch = *rc::gen::inRange<int64_t>(2, 4);
    const int64_t seq = c.sp_padding == SpPadding::virtual_ ? c.sp * *rc::gen::inRange<int64_t>(1, 4)
                                                            : *rc::gen::inRange<int64_t>(1, 13);
    c.tokens = c.batch * seq;
  } else {
    c.tokens = *rc::gen::weightedOneOf<int64_t>({{1, rc::gen::inRange<int64_t>(0, 9)}, {3, rc::gen::inRange<int64_t>(9, 48)}});
  }
  c.capacity.factor = *rc::gen::element(0.25, 0.5, 1.0, 1.5, 100.0);
  c.capacity.policy = *rc::gen::element(CapacityPolicy::probs, CapacityPolicy::position);
  c.capacity.pad_to_capacity = *rc::gen::element(Switch::off, Switch::on);
  c.data = *rc::gen::element(DataMode::exact, DataMode::realistic);
  c.dtype = *rc::gen::element(DType::fp32, DType::bf16);
  c.experts.kind = *rc::gen::element(ExpertKind::identity, ExpertKind::swiglu);
  c.backward = *rc::gen::element(Switch::off, Switch::on);
  return c;
}

}  // namespace

TEST_CASE("capacity with sequence parallelism: properties", "[cpu][capacity][sp][prop]") {
  rc::prop("every check passes; per SP rank and expert at most cap_s rows kept; no pad row kept; a large factor is "
           "dropless",
           [] {
             const Case c = random_capacity_sp_case();
             RunOptions o;
             o.keep = RunOptions::Keep::fast_board;
             const CaseReport r = run_case(c, o);
             for (const auto& ch : r.checks)
               if (token_path_fails(ch))
                 RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " +
                         outcome_name(ch.outcome) + " " + ch.note);
             const int64_t K = c.top_k, E = c.num_experts;
             for (int q = 0; q < c.ep; ++q) {
               const int64_t T = c.tokens_on(q);
               const std::vector<int64_t> rows = to_ints(r.fast.at("sp_rows", q));
               const std::vector<int64_t> counts = to_ints(r.fast.at("counts", q));
               const std::vector<int64_t> tok = to_ints(r.fast.at("token_sorted", q));
               const std::vector<int64_t> row_of = to_ints(r.fast.at("row_of", q));
               // SP rank and realness of every SP-layout row
               std::vector<int64_t> rank_of, real_of;
               std::vector<int64_t> cap(size_t(c.sp));
               int64_t all_caps = 0;
               for (int64_t s = 0; s < c.sp; ++s) {
                 const int64_t real = real_tokens(c, T, s);
                 cap[size_t(s)] = int64_t(std::ceil(double(real) * double(K) / double(E) * c.capacity.factor));
                 all_caps += cap[size_t(s)];
                 for (int64_t i = 0; i < rows[size_t(s)]; ++i) {
                   rank_of.push_back(s);
                   real_of.push_back(i < real);
                 }
               }
               int64_t start = 0;
               for (int64_t e = 0; e < E; ++e) {
                 std::vector<int64_t> kept(size_t(c.sp), 0);
                 for (int64_t i = start; i < start + counts[size_t(e)]; ++i) {
                   const int64_t t = tok[size_t(i)];
                   if (t < 0) continue;  // a filler row
                   RC_ASSERT(real_of[size_t(t)] == 1);  // no pad row is ever kept
                   ++kept[size_t(rank_of[size_t(t)])];
                 }
                 for (int64_t s = 0; s < c.sp; ++s) RC_ASSERT(kept[size_t(s)] <= cap[size_t(s)]);
                 if (c.capacity.pad_to_capacity == Switch::on) RC_ASSERT(counts[size_t(e)] == all_caps);
                 start += counts[size_t(e)];
               }
               // a pad row's assignments are all dropped; with cap_s >= T_s no real one is
               for (size_t i = 0; i < real_of.size(); ++i)
                 for (int64_t k = 0; k < K; ++k) {
                   const int64_t ro = row_of[i * size_t(K) + size_t(k)];
                   if (!real_of[i]) RC_ASSERT(ro == -1);
                   if (real_of[i] && c.capacity.factor >= 100) RC_ASSERT(ro >= 0);
                 }
             }
             // The dropless SP run, bit for bit, unless tail pad rows (which the
             // dropless run sends to expert 0) or filler rows change the row
             // count of a GEMM expert: its rounding may then differ within the
             // gemm bound.
             bool rows_differ = c.capacity.pad_to_capacity == Switch::on;
             for (int q = 0; q < c.ep; ++q)
               rows_differ = rows_differ || (c.sp_padding == SpPadding::tail && c.tokens_on(q) % c.sp != 0);
             if (c.capacity.factor >= 100 && (!rows_differ || c.experts.kind == ExpertKind::identity)) {
               Case dropless = c;
               dropless.capacity.factor = 0;
               const CaseReport d = run_case(dropless, o);
               RC_ASSERT(d.outcome == Outcome::PASSED);
               for (int q = 0; q < c.ep; ++q) {
                 const Tensor& a = r.fast.at("sp_out", q);
                 const Tensor& b = d.fast.at("sp_out", q);
                 if (a.bytes() != b.bytes() || (a.bytes() > 0 && std::memcmp(a.data(), b.data(), a.bytes()) != 0))
                   RC_FAIL(c.summary() + ": sp_out differs from the dropless run's");
               }
             }
           });
}

TEST_CASE("the planted SP capacity faults are caught on the shipped cases", "[cpu][capacity][sp][fault]") {
  RunOptions o;
  o.faults.bits = uint64_t(Fault::sp_capacity_pad_rows);
  for (const char* name : {"sp_fewer_tokens_than_sp[sp_padding=tail,capacity.pad_to_capacity=off]",
                           "sp_backward[sp_padding=tail,capacity.pad_to_capacity=on]"}) {
    INFO(name);
    REQUIRE(run_case(case_named("capacity.yaml", name), RunOptions{}).outcome == Outcome::PASSED);
    CHECK(any_starts(failing(run_case(case_named("capacity.yaml", name), o)), "capacity/"));
  }
  o.faults.bits = uint64_t(Fault::sp_capacity_global_tokens);
  for (const char* name : {"sp_uneven[sp_padding=virtual,capacity.policy=probs,capacity.pad_to_capacity=off]",
                           "sp_exact_hot_expert[sp_padding=tail,capacity.policy=position]"}) {
    INFO(name);
    CHECK(any_starts(failing(run_case(case_named("capacity.yaml", name), o)), "capacity/counts"));
  }
}

TEST_CASE("capacity combinations that are not modelled are refused", "[cpu][capacity]") {
  for (const char* bad : {"router: {force_load_balance: on}"}) {
    const std::string text = std::string("cases:\n  - name: x\n    capacity: {factor: 1}\n    ") + bad + "\n";
    INFO(text);
    CHECK_THROWS_WITH(load_cases_text(text, "t.yaml", {}), Catch::Contains("capacity"));
  }
}

TEST_CASE("SP invariance under capacity compares the tokens that keep the same experts", "[cpu][capacity][sp]") {
  // Each SP rank drops with its own cap (docs/contract.md §11), so some tokens
  // keep other experts than in the sp = 1 run: those are left out and counted
  // in the note, the others are compared bit for bit (exact data).
  const Case c = case_named("capacity.yaml", "sp_exact_hot_expert[sp_padding=virtual,capacity.policy=probs]");
  const CaseReport r = run_case(c, RunOptions{});
  REQUIRE(r.outcome == Outcome::PASSED);
  int seen = 0;
  for (const auto& ch : r.checks) {
    if (ch.slot != "sp_invariance") continue;
    ++seen;
    INFO(ch.note);
    const size_t at = ch.note.find(" of " + std::to_string(c.tokens) + " token(s) keep other experts");
    REQUIRE(at != std::string::npos);
    const int64_t apart = std::stoll(ch.note.substr(ch.note.rfind(' ', at - 1) + 1));
    CHECK(apart > 0);
    CHECK(apart < c.tokens);
    CHECK(ch.cls == CompareClass::exact);
  }
  CHECK(seen == 1);
  // The comparison of the other tokens still sees a wrong gather.
  RunOptions o;
  o.faults.bits = uint64_t(Fault::sp_even_combine);
  const Case u = case_named("capacity.yaml", "sp_uneven[sp_padding=virtual,capacity.policy=probs,capacity.pad_to_capacity=off]");
  CHECK(any_starts(failing(run_case(u, o)), "sp_invariance/"));
}
