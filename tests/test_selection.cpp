// The verdict on an outside implementation's expert selection (issue 19 §4,
// §11): exact ties at the K-th expert and at the group boundary accepted, and
// the three mistakes that an earlier check let through refused: a K-th id
// replaced by a worse expert, a strictly better expert dropped for a member of
// a tie, a repeated id.
#include <catch2/catch.hpp>

#include "selection.h"

using namespace moev;

namespace {
bool valid(const SelectionRule& r, const std::vector<float>& ch, const std::vector<int32_t>& ids) {
  REQUIRE(int(ch.size()) == r.E);
  REQUIRE(int(ids.size()) == r.K);
  return judge_selection(r, ch.data(), ids.data()).valid;
}
}  // namespace

TEST_CASE("selection: any member of an exact tie at the K-th place, in any order", "[cpu]") {
  const SelectionRule r{6, 3, 1, 0, 0.0};
  const std::vector<float> ch = {0.9f, 0.5f, 0.1f, 0.5f, 0.7f, 0.5f};
  CHECK(valid(r, ch, {0, 4, 1}));  // the lowest-index member
  CHECK(valid(r, ch, {3, 0, 4}));  // another member, unsorted
  CHECK(valid(r, ch, {5, 4, 0}));
}

TEST_CASE("selection: a worse expert, a better one left out, a repeated or foreign id are refused", "[cpu]") {
  const SelectionRule r{6, 3, 1, 0, 0.0};
  const std::vector<float> ch = {0.9f, 0.5f, 0.1f, 0.5f, 0.7f, 0.5f};
  // the K-th id replaced by an expert below the K-th value
  CHECK_FALSE(valid(r, ch, {0, 4, 2}));
  // a strictly better expert (4) dropped for two members of the tie
  CHECK_FALSE(valid(r, ch, {0, 1, 3}));
  // a repeated id, even of the best experts
  CHECK_FALSE(valid(r, ch, {0, 4, 4}));
  CHECK(judge_selection(r, ch.data(), std::vector<int32_t>{0, 4, 4}.data()).why.find("twice") != std::string::npos);
  CHECK_FALSE(valid(r, ch, {0, 4, 6}));
  CHECK_FALSE(valid(r, ch, {0, 4, -1}));
}

TEST_CASE("selection: near ties pass only with slack", "[cpu]") {
  SelectionRule r{4, 1, 1, 0, 0.0};
  const std::vector<float> ch = {0.5f, 0.50001f, 0.1f, 0.2f};
  CHECK_FALSE(valid(r, ch, {0}));
  r.slack = 1e-4;
  CHECK(valid(r, ch, {0}));
  CHECK_FALSE(valid(r, ch, {3}));
}

TEST_CASE("selection: group-limited routing accepts any group tied at the boundary", "[cpu]") {
  // 4 groups of 2, keep 2, K = 2. Group scores: g0 = 1.0, g1 = 0.6, g2 = 0.6, g3 = 0.2.
  const SelectionRule r{8, 2, 4, 2, 0.0};
  const std::vector<float> ch = {0.6f, 0.4f, 0.35f, 0.25f, 0.3f, 0.3f, 0.1f, 0.1f};
  CHECK(valid(r, ch, {0, 1}));  // both from the best group; g1 or g2 completes the kept pair
  // Group scores tied (g1, g2 = 0.6): the best expert outside g0 may come from either.
  const std::vector<float> t2 = {0.6f, 0.1f, 0.35f, 0.25f, 0.3f, 0.3f, 0.1f, 0.1f};
  CHECK(valid(r, t2, {0, 2}));   // kept g0 + g1
  CHECK(valid(r, t2, {0, 4}));   // kept g0 + g2: 0.3 is g2's best, and g1's 0.35 is then not eligible
  CHECK_FALSE(valid(r, t2, {0, 6}));  // g3 is below the boundary
  CHECK_FALSE(valid(r, t2, {2, 4}));  // g1 and g2 together leave out g0, which beats both
  CHECK_FALSE(valid(r, t2, {0, 3}));  // g1 kept, but its 0.35 beats the chosen 0.25
}

TEST_CASE("selection: the near-tie slack is the tolerance at the K-th value, not the top one", "[cpu]") {
  // A top score of 100 beside a boundary near 0.5: scaled by the top score
  // (1e-3) the slack would accept expert 2, 1e-5 below the K-th value; the
  // tolerance at the K-th value (about 5e-6) does not, and accepts a gap of 1e-6.
  const std::vector<float> ch = {100.f, 0.5f, 0.49999f, 0.499999f, 0.1f};
  const std::vector<int32_t> reference = {0, 1};
  SelectionRule r{5, 2, 1, 0, near_tie_slack(1e-7, 1e-5, 2, ch.data(), reference.data())};
  CHECK(r.slack == Approx(1e-7 + 1e-5 * 0.5).epsilon(1e-6));
  CHECK_FALSE(valid(r, ch, {0, 2}));
  CHECK(valid(r, ch, {0, 3}));
  // the order of the reference's ids does not matter
  const std::vector<int32_t> swapped = {1, 0};
  CHECK(near_tie_slack(1e-7, 1e-5, 2, ch.data(), swapped.data()) == r.slack);
}

TEST_CASE("selection: a tied filler group may hold an expert equal to the K-th value", "[cpu]") {
  // 4 groups of 2, keep 2, K = 2. g0 = {0.6, 0.5} (1.1) holds both choices;
  // g1 and g2 tie at the boundary (0.6) and either completes the kept pair.
  // g1's 0.5 equals the K-th chosen value: a tie, not an expert that beats
  // the chosen ones, so {0, 1} is valid (as are {0, 2} and {0, 4}).
  const SelectionRule r{8, 2, 4, 2, 0.0};
  const std::vector<float> ch = {0.6f, 0.5f, 0.5f, 0.1f, 0.5f, 0.1f, 0.05f, 0.05f};
  CHECK(valid(r, ch, {0, 1}));
  CHECK(valid(r, ch, {1, 0}));
  CHECK(valid(r, ch, {0, 2}));
  CHECK(valid(r, ch, {0, 4}));
  CHECK_FALSE(valid(r, ch, {0, 3}));
}
