// The overload factor of MoE layer entries (docs/contract.md §12, docs/frameworks.md §12):
// hand-worked values from the formula, the running-sum implementation against
// the reference's timeline on random counts, the planted faults, and layer
// entries with router weights of their own.
// RapidCheck prints its seed; RC_PARAMS="seed=N" replays.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <cstring>

#include "../kernels/overload_host.h"
#include "../reference/reference.h"
#include "datagen.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {

bool same(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// actual[e][r], balanced[e][r] as the entry-major flat input of the fast path.
OverloadInput flat(const std::vector<std::vector<int64_t>>& a, const std::vector<std::vector<int64_t>>& b, bool backward) {
  OverloadInput in;
  in.entries = int(a.size());
  in.ranks = a.empty() ? 0 : int(a[0].size());
  in.backward = backward;
  for (size_t e = 0; e < a.size(); ++e) {
    in.actual.insert(in.actual.end(), a[e].begin(), a[e].end());
    in.balanced.insert(in.balanced.end(), b[e].begin(), b[e].end());
  }
  return in;
}

}  // namespace

TEST_CASE("overload factor of two entries on two ranks worked by hand", "[cpu][overload]") {
  // Entry 1: rank 0 receives 3 rows, rank 1 one; entry 2: two each; every
  // rank's balanced share is 2 rows per entry.
  const std::vector<std::vector<int64_t>> a = {{3, 1}, {2, 2}}, b = {{2, 2}, {2, 2}};
  for (bool backward : {false, true}) {
    const OverloadFactors f = overload_factors(flat(a, b, backward));
    REQUIRE(f.entries.size() == 2);
    CHECK(f.entries[0] == 3 / (2 + 1e-8));
    CHECK(f.entries[1] == 2 / (2 + 1e-8));
    CHECK(f.avg == (3 / (2 + 1e-8) + 2 / (2 + 1e-8)) / 2);
    CHECK(f.max == 3 / (2 + 1e-8));
    // rank 0: running sums 3, 5 against 2, 4 (then back down with the
    // backward): peaks 5 and 4; rank 1: 1, 3 against 2, 4.
    CHECK(f.max_cum == 5 / (4 + 1e-8));
    const ref::OverloadRef g = ref::overload_factors(a, b, backward);
    CHECK(same(g.max_cum, f.max_cum));
  }
}

TEST_CASE("a rank whose balanced share is zero contributes 0 to max_cum", "[cpu][overload]") {
  const std::vector<std::vector<int64_t>> a = {{4, 6}}, b = {{0, 8}};
  const OverloadFactors f = overload_factors(flat(a, b, false));
  CHECK(f.entries[0] == 6 / (4 + 1e-8));
  CHECK(f.max_cum == 6 / (8 + 1e-8));  // rank 0 gives 0, not 4 / 1e-8
  CHECK(ref::overload_factors(a, b, false).max_cum == f.max_cum);
}

TEST_CASE("the planted overload faults change what they break", "[cpu][overload][fault]") {
  const std::vector<std::vector<int64_t>> a = {{3, 1}, {2, 2}}, b = {{2, 2}, {2, 2}};
  FaultSet global;
  global.bits = uint32_t(Fault::overload_global_balanced);
  CHECK(overload_factors(flat(a, b, false), global).entries[0] == 3 / (4 + 1e-8));
  FaultSet final_sums;
  final_sums.bits = uint32_t(Fault::overload_cum_final);
  CHECK(overload_factors(flat(a, b, false), final_sums).max_cum == 5 / (4 + 1e-8));  // no backward: end = peak
  CHECK(overload_factors(flat(a, b, true), final_sums).max_cum == 0);               // back to zero
}

TEST_CASE("overload factor properties", "[cpu][overload][prop]") {
  rc::prop("the running sums equal the reference timeline bit for bit", [] {
    const int N = *rc::gen::inRange(1, 6), R = *rc::gen::inRange(1, 9);
    const bool backward = *rc::gen::arbitrary<bool>();
    std::vector<std::vector<int64_t>> a(static_cast<size_t>(N), std::vector<int64_t>(static_cast<size_t>(R)));
    std::vector<std::vector<int64_t>> b = a;
    for (int r = 0; r < R; ++r) {
      const int64_t share = *rc::gen::element<int64_t>(0, 0, 1, 16, 1000);  // a rank may have no tokens
      for (int e = 0; e < N; ++e) {
        a[size_t(e)][size_t(r)] = *rc::gen::inRange<int64_t>(0, 2000);
        b[size_t(e)][size_t(r)] = share;
      }
    }
    const OverloadFactors f = overload_factors(flat(a, b, backward));
    const ref::OverloadRef g = ref::overload_factors(a, b, backward);
    RC_ASSERT(f.entries.size() == g.entries.size());
    for (size_t e = 0; e < g.entries.size(); ++e) RC_ASSERT(same(f.entries[e], g.entries[e]));
    RC_ASSERT(same(f.avg, g.avg));
    RC_ASSERT(same(f.max, g.max));
    RC_ASSERT(same(f.max_cum, g.max_cum));
    // Forward only, the peaks are the totals: max_cum is the largest ratio
    // of a rank's received rows to its balanced rows over the whole run.
    if (!backward) {
      double expect = 0;
      for (int r = 0; r < R; ++r) {
        int64_t sa = 0, sb = 0;
        for (int e = 0; e < N; ++e) sa += a[size_t(e)][size_t(r)], sb += b[size_t(e)][size_t(r)];
        if (sb > 0) expect = std::max(expect, double(sa) / (double(sb) + 1e-8));
      }
      RC_ASSERT(same(f.max_cum, expect));
    }
  });
  rc::prop("with nothing dropped an entry's factor is at least 1 (the most loaded rank is above the mean)", [] {
    const int R = *rc::gen::inRange(1, 9);
    const int64_t share = *rc::gen::inRange<int64_t>(1, 500);
    // R ranks each balanced at `share`; the same total received, spread at random
    std::vector<int64_t> got(size_t(R), 0);
    for (int64_t i = 0; i < share * R; ++i) ++got[size_t(*rc::gen::inRange(0, R))];
    const OverloadFactors f = overload_factors(flat({got}, {std::vector<int64_t>(size_t(R), share)}, false));
    RC_ASSERT(f.entries[0] >= 1 - 1e-6);
  });
}

TEST_CASE("layer entries draw their own router weights and entry 1 keeps the single-layer inputs", "[cpu][overload]") {
  Case c = case_named("layers.yaml", "three_layers_backward");
  Case single = c;
  single.layers = 1;
  c.layer = 0;
  const auto in0 = make_inputs(c, 0, c.tokens_on(0));
  const auto in_single = make_inputs(single, 0, single.tokens_on(0));
  CHECK(std::memcmp(in0.at("wg").data(), in_single.at("wg").data(), in0.at("wg").bytes()) == 0);
  c.layer = 1;
  const auto in1 = make_inputs(c, 0, c.tokens_on(0));
  CHECK(std::memcmp(in0.at("wg").data(), in1.at("wg").data(), in0.at("wg").bytes()) != 0);
  CHECK(std::memcmp(in0.at("x").data(), in1.at("x").data(), in0.at("x").bytes()) == 0);
}

TEST_CASE("layer cases pass and name each entry's stages and the overload checks", "[cpu][overload]") {
  const CaseReport r = run_case(case_named("layers.yaml", "three_layers_backward"), RunOptions{});
  CHECK(r.outcome == Outcome::PASSED);
  bool entry3 = false, cum = false;
  for (const auto& ch : r.checks) {
    entry3 = entry3 || ch.slot == "layer3/ep_dispatch";
    cum = cum || (ch.slot == "overload_factor" && ch.tensor == "max_cum");
  }
  CHECK(entry3);
  CHECK(cum);
  REQUIRE(r.overload.valid);
  CHECK(r.overload.entries.size() == 3);
}

TEST_CASE("the planted overload faults are caught on the shipped layer cases", "[cpu][overload][fault]") {
  RunOptions o;
  o.faults.bits = uint32_t(Fault::overload_global_balanced);
  const auto f1 = failing(run_case(case_named("layers.yaml", "hot_expert"), o));
  CHECK(std::find(f1.begin(), f1.end(), "overload_factor/entries") != f1.end());
  o.faults.bits = uint32_t(Fault::overload_cum_final);
  const auto f2 = failing(run_case(case_named("layers.yaml", "three_layers_backward"), o));
  CHECK(std::find(f2.begin(), f2.end(), "overload_factor/max_cum") != f2.end());
}
