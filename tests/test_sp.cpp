// Sequence parallel (docs/contract.md §10, docs/frameworks.md §10): the index maps against the
// reference's walk over the sequences, the SP invariance property (the SP
// ranks' gathered outputs equal the sp = 1 output bit for bit), the planted
// SP faults, and the refusal of virtual padding with B > 1 and L % S != 0.
// RapidCheck prints its seed; RC_PARAMS="seed=N" replays.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>

#include "../kernels/sp_host.h"
#include "../reference/reference.h"
#include "case.h"
#include "error.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {

/// (T, B, S, padding) leaning toward the SP edge cases: T < S (ranks with no
/// tokens), T mod S != 0, T = 0, B > 1. Virtual padding with B > 1 gets
/// L % S == 0 (the contract refuses the rest).
struct SpShape {
  int64_t T = 0, B = 1, S = 1;
  SpPadding padding = SpPadding::virtual_;
};

rc::Gen<SpShape> gen_sp_shape() {
  return rc::gen::exec([] {
    SpShape s;
    s.S = *rc::gen::inRange<int64_t>(1, 9);
    s.padding = *rc::gen::element(SpPadding::virtual_, SpPadding::tail);
    s.B = *rc::gen::element<int64_t>(1, 1, 2, 3);
    int64_t L = *rc::gen::inRange<int64_t>(0, 13);
    if (s.B > 1 && s.padding == SpPadding::virtual_) L = L / s.S * s.S;
    s.T = s.B * L;
    return s;
  });
}

std::vector<std::string> failed_checks(const CaseReport& r) {
  std::vector<std::string> v;
  for (const auto& ch : r.checks)
    if (ch.outcome != Outcome::PASSED) v.push_back(ch.slot + "/" + ch.tensor);
  return v;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

/// Runs the case clean (must pass) and with the fault (must be INCORRECT);
/// returns the failing "slot/tensor" names of the faulty run.
std::vector<std::string> caught_by(const Case& c, Fault f) {
  RunOptions clean;
  clean.threads = 2;
  const CaseReport ok = run_case(c, clean);
  INFO(c.name << ": " << (failed_checks(ok).empty() ? "" : failed_checks(ok).front()));
  REQUIRE(ok.outcome == Outcome::PASSED);
  RunOptions faulty = clean;
  faulty.faults.bits = uint32_t(f);
  const CaseReport r = run_case(c, faulty);
  CHECK(r.outcome == Outcome::INCORRECT);
  return failed_checks(r);
}

}  // namespace

TEST_CASE("SP shard and gather maps equal the reference walk over the sequences", "[cpu][prop][sp]") {
  rc::prop("every SP-layout row holds the token the reference places there and gathers back to it", [] {
    const SpShape s = *gen_sp_shape();
    RC_CLASSIFY(s.T < s.S, "T < S: SP ranks without tokens");
    RC_CLASSIFY(s.S > 1 && s.T % s.S != 0, "T mod S != 0");
    RC_CLASSIFY(s.B > 1, "B > 1");
    const SpLayout l = sp_layout(s.T, s.B, s.S, s.padding, FaultSet{});
    const ref::SpShard sh = ref::sp_shard(s.T, s.B, s.S,
                                          s.padding == SpPadding::tail ? ref::SpPadding::tail : ref::SpPadding::virtual_);
    RC_ASSERT(l.nlt == sh.nlt);
    for (int64_t q = 0; q < s.S; ++q) RC_ASSERT(l.rows(q) == sh.rows_per_rank[size_t(q)]);
    const std::vector<int64_t> shard = sp_shard_map(l);
    RC_ASSERT(shard.size() == sh.position.size());
    for (size_t i = 0; i < shard.size(); ++i) RC_ASSERT(shard[i] == (sh.position[i] < s.T ? sh.position[i] : -1));
    const std::vector<int64_t> gather = sp_gather_map(l);
    RC_ASSERT(int64_t(gather.size()) == sh.nlt * s.S);
    for (size_t i = 0; i < shard.size(); ++i) RC_ASSERT(gather[size_t(sh.position[i])] == int64_t(i));
    // every token of the sequence is held by exactly one SP rank
    std::vector<int> seen(size_t(s.T), 0);
    for (int64_t v : shard)
      if (v >= 0) ++seen[size_t(v)];
    for (int v : seen) RC_ASSERT(v == 1);
  });
}

TEST_CASE("SP invariance: the gathered SP output equals the sp = 1 output bit for bit", "[cpu][prop][sp]") {
  rc::prop("identity experts, random shapes, EP ranks, zero-token ranks and experts", [] {
    const SpShape s = *gen_sp_shape();
    Case c;
    c.sp = int(s.S);
    c.batch = s.B;
    c.tokens = s.T;
    c.sp_padding = s.padding;
    c.ep = *rc::gen::element(1, 1, 2, 4);
    c.num_experts = c.ep * *rc::gen::inRange(1, 5);
    c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 4) + 1);
    c.hidden = *rc::gen::inRange<int64_t>(1, 12);
    c.seed = *rc::gen::inRange<uint64_t>(0, 1000000);
    c.dtype = *rc::gen::element(DType::fp32, DType::bf16, DType::fp16);
    c.router.hot_expert = *rc::gen::element(-1, -1, 0);  // a hot expert leaves others without tokens
    c.shared.kind = *rc::gen::element(SharedKind::none, SharedKind::identity);
    c.combine.accumulate = *rc::gen::element(k::Accumulate::per_add, k::Accumulate::fp32_accumulate);
    c.score_before_experts = *rc::gen::element(Switch::off, Switch::on);
    c.backward = *rc::gen::element(Switch::off, Switch::on);
    if (s.B == 1 && c.ep > 1 && *rc::gen::arbitrary<bool>()) {  // uneven EP ranks, some empty
      for (int r = 0; r < c.ep; ++r) c.tokens_per_rank.push_back(*rc::gen::element<int64_t>(0, 1, 3, 7, 10));
    }
    RC_CLASSIFY(s.T < s.S, "T < S");
    RC_CLASSIFY(!c.tokens_per_rank.empty(), "uneven EP ranks");
    RC_CLASSIFY(s.padding == SpPadding::tail, "tail");
    RunOptions o;
    o.threads = *rc::gen::element(1, 2);
    o.keep = RunOptions::Keep::fast_board;
    // Data too small to show a bug (a hot expert's softmax score so small
    // that every fp16 product rounds to zero) is NOT_VERIFIED, an honest
    // verdict: such a draw is discarded, not failed, as in
    // test_properties.cpp (seen: seed 13673728618590620435).
    auto require_passed = [](const CaseReport& rep) {
      for (const auto& ch : rep.checks)
        if (ch.outcome == Outcome::NOT_VERIFIED && ch.note.find("cannot show a wrong result") != std::string::npos)
          RC_DISCARD("uninformative data: " + ch.note);
      RC_ASSERT(failed_checks(rep).empty());
    };
    const CaseReport r = run_case(c, o);
    require_passed(r);
    Case c1 = c;
    c1.sp = 1;
    const CaseReport r1 = run_case(c1, o);
    require_passed(r1);
    RC_ASSERT(r1.outcome == Outcome::PASSED);
    for (int q = 0; q < c.ep; ++q) {
      const Tensor& a = r.fast.at(c.sp > 1 ? "sp_out" : "out", q);
      const Tensor& b = r1.fast.at("out", q);
      RC_ASSERT(a.shape == b.shape);
      RC_ASSERT(checksum(a) == checksum(b));
      // the backward's token gradients, through the SP adjoints (docs/contract.md §10, §13)
      if (c.backward == Switch::on) {
        const Tensor& ga = r.fast.at("grad_x", q);
        const Tensor& gb = r1.fast.at("grad_x", q);
        RC_ASSERT(ga.shape == gb.shape);
        RC_ASSERT(checksum(ga) == checksum(gb));
      }
    }
  });
}

TEST_CASE("fault sp_b1_index is caught by the SP shard check with B > 1", "[cpu][fault][sp]") {
  for (const char* name : {"batch_aware[sp_padding=virtual]", "with_ep[sp_padding=virtual,align=1]"}) {
    INFO(name);
    const auto failed = caught_by(case_named("sp.yaml", name), Fault::sp_b1_index);
    CHECK((contains(failed, "sp_shard/x") || contains(failed, "sp_shard/x@0")));
  }
}

// Under tail padding (and B = 1) the SP layout is the flattened token order,
// so only the batch-aware virtual layout tells the two apart.
TEST_CASE("fault sp_bwd_token_order is caught by the SP backward with B > 1", "[cpu][fault][sp][backward]") {
  const auto failed = caught_by(case_named("sp.yaml", "backward_batch_aware[sp_padding=virtual]"), Fault::sp_bwd_token_order);
  CHECK(contains(failed, "sp_shard_bwd/grad_x"));
  CHECK(contains(failed, "sp_invariance/grad_x"));
}

TEST_CASE("fault sp_even_combine is caught by the SP gather and the sp = 1 comparison", "[cpu][fault][sp]") {
  const auto failed = caught_by(case_named("sp.yaml", "b1_uneven[sp_padding=virtual,dtype=fp32]"), Fault::sp_even_combine);
  CHECK(contains(failed, "sp_gather/sp_out"));
  CHECK(contains(failed, "sp_invariance/sp_out"));
}

TEST_CASE("fault sp_tail_pad_score is caught by the tail pad routing check", "[cpu][fault][sp]") {
  for (const char* name : {"b1_uneven[sp_padding=tail,dtype=bf16]", "batch_tail_uneven"}) {
    INFO(name);
    const auto failed = caught_by(case_named("sp.yaml", name), Fault::sp_tail_pad_score);
    CHECK(contains(failed, "sp_pad_route/topk_scores"));
  }
}

TEST_CASE("virtual SP padding with B > 1 and L % S != 0 is refused with file and line", "[cpu][sp]") {
  const std::string yaml = "cases:\n  - name: a\n    shape: {batch: 2, seq_len: 6}\n    sp: 4\n";
  CHECK_THROWS_WITH(load_cases_text(yaml, "t.yaml", {}),
                    Catch::Contains("t.yaml:3:32: shape.seq_len: virtual SP padding with batch 2 needs seq_len % sp == 0") &&
                        Catch::Contains("valid: seq_len a multiple of 4"));
  // the same shape is valid under tail padding, and virtual with L % S == 0
  CHECK(load_cases_text(yaml, "t.yaml", {"sp_padding=tail"}).size() == 1);
  CHECK(load_cases_text(yaml, "t.yaml", {"shape.seq_len=8"}).at(0).tokens == 16);
}
