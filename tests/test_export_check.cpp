// export / check internals (issue 9 §3, §4): the manifest's case round-trips
// through the case loader with every key, the .npy reader takes what
// write_npy writes and refuses other dtypes, shapes and broken files, and the
// external pipeline fed the reference's own outputs passes.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "datagen.h"
#include "error.h"
#include "export_check.h"
#include "random_case.h"
#include "stages.h"
#include "test_util.h"

using namespace moev;

TEST_CASE("export case json names every case key", "[cpu]") {
  const nlohmann::ordered_json j = case_to_json(case_named("basic.yaml", "exact_fp32"));
  for (const auto& [key, help] : case_keys()) {
    if (key.rfind("tolerance.", 0) == 0 || key == "shape.tokens_per_rank" || key == "grad_accumulate")
      continue;  // written when set
    if (key.rfind("dispatch.", 0) == 0) continue;  // written for FP8 dispatch only, below
    INFO(key);
    CHECK(j.contains(key));
  }
  const nlohmann::ordered_json f = case_to_json(case_named("fp8.yaml", "fp8_local_amax_ratio[experts.kind=identity]"));
  for (const auto& [key, help] : case_keys())
    if (key.rfind("dispatch.", 0) == 0) {
      INFO(key);
      CHECK(f.contains(key));
    }
  CHECK_FALSE(j.contains("dispatch.dtype"));  // an act case's manifest is as before FP8 existed
  Case g = case_named("basic.yaml", "exact_fp32");
  CHECK_FALSE(j.contains("grad_accumulate"));  // the default's manifest is as before the key existed
  g.grad_accumulate = GradAccumulate::per_add;
  CHECK(case_to_json(g).value("grad_accumulate", "") == "per_add");
}

TEST_CASE("export case json round-trips random configurations", "[cpu]") {
  for (uint64_t i = 0; i < 200; ++i) {
    const std::string yaml = "cases:\n  - " + random_case_yaml(99, i) + "\n";
    const Case c = load_cases_text(yaml, "random", {}).at(0);
    const nlohmann::ordered_json j = case_to_json(c);
    const Case back = case_from_json(nlohmann::json::parse(j.dump()), "manifest");
    INFO(yaml);
    CHECK(case_to_json(back) == j);
    CHECK(back.summary().substr(back.summary().find(" D=")) == c.summary().substr(c.summary().find(" D=")));
    for (int r = 0; r < c.ep; ++r) {
      REQUIRE(back.tokens_on(r) == c.tokens_on(r));
      const auto a = make_inputs(c, r, c.tokens_on(r)), b = make_inputs(back, r, back.tokens_on(r));
      for (const auto& [n, t] : a) CHECK(checksum(t) == checksum(b.at(n)));
    }
  }
}

TEST_CASE("read_npy reads what write_npy writes and refuses the rest", "[cpu]") {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/moev_npy_test";
  std::filesystem::create_directories(dir);
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16, ElemType::i32, ElemType::i64}) {
    Tensor x = Tensor::alloc(t, {3, 5}, 0);
    for (size_t i = 0; i < x.bytes(); ++i) static_cast<uint8_t*>(x.data())[i] = uint8_t(i * 7 + 1);
    const std::string p = dir + "/t.npy";
    write_npy(p, x);
    const Tensor y = read_npy(p, t, {3, 5});
    CHECK(checksum(y) == checksum(x));
    CHECK_THROWS_AS(read_npy(p, t, {5, 3}), Error);
    if (t == ElemType::i32 || t == ElemType::i64) {
      // Either integer width is accepted and converted.
      const ElemType other = t == ElemType::i32 ? ElemType::i64 : ElemType::i32;
      const Tensor small = from_ints({-3, 0, 7, 1 << 30, -(1 << 30), 5}, t, {2, 3});
      write_npy(p, small);
      CHECK(to_ints(read_npy(p, other, {2, 3})) == to_ints(small));
      if (t == ElemType::i64) {
        write_npy(p, from_ints({int64_t(1) << 40}, t, {1}));
        CHECK_THROWS_AS(read_npy(p, ElemType::i32, {1}), Error);  // does not fit
        write_npy(p, from_ints({int64_t(INT32_MIN) - 1}, t, {1}));
        CHECK_THROWS_AS(read_npy(p, ElemType::i32, {1}), Error);  // below INT32_MIN (issue 34 item 9)
        write_npy(p, from_ints({int64_t(INT32_MIN)}, t, {1}));
        CHECK(to_ints(read_npy(p, ElemType::i32, {1})) == std::vector<int64_t>{INT32_MIN});
      }
      write_npy(p, x);
      CHECK_THROWS_AS(read_npy(p, ElemType::f32, {3, 5}), Error);
    } else {
      CHECK_THROWS_AS(read_npy(p, ElemType::i32, {3, 5}), Error);
    }
    // Other columns are refused; other rows are reported, the data not read.
    CHECK_THROWS_AS(read_npy(p, t, {3, 4}), Error);
    CHECK_THROWS_AS(read_npy(p, t, {15}), Error);
    std::vector<int64_t> rows;
    CHECK(read_npy(p, t, {7, 5}, &rows).storage == nullptr);
    CHECK(rows == std::vector<int64_t>{3, 5});
    // truncated data
    std::ifstream in(p, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 1);
    CHECK_THROWS_AS(read_npy(p, t, {3, 5}), Error);
    // bytes after the data: not a file NumPy wrote (issue 34 item 9)
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes << 'x';
    CHECK_THROWS_AS(read_npy(p, t, {3, 5}), Error);
    std::ofstream(p, std::ios::binary | std::ios::trunc) << "not numpy";
    CHECK_THROWS_AS(read_npy(p, t, {3, 5}), Error);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("check passes the reference outputs and names the first wrong stage", "[cpu]") {
  for (const char* name : {"exact_fp32", "realistic_bf16"}) {
    const Case c = case_named("basic.yaml", name);
    std::vector<GoldenTensor> golden;
    REQUIRE(run_external(c, nullptr, &golden).outcome == Outcome::PASSED);
    std::map<std::string, Tensor> expected;  // by file name
    for (const auto& g : golden)
      if (g.role == "expected") expected[golden_file(g.stage, g.name, g.rank)] = g.t;
    REQUIRE(expected.count("dispatch.routed_input.rank0.npy"));
    const ActualFn same = [&](const std::string& f, const Tensor&) {
      ActualTensor a;
      auto it = expected.find(f);
      if (it != expected.end()) a.kind = ActualTensor::Kind::present, a.t = it->second;
      return a;
    };
    const CaseReport ok = run_external(c, &same, nullptr);
    CHECK(ok.outcome == Outcome::PASSED);
    CHECK(ok.checks.size() >= expected.size());
    // One wrong row of the expert outputs: INCORRECT at experts, nothing earlier.
    Tensor bad = expected.at("experts.expert_output.rank0.npy").clone();
    static_cast<uint8_t*>(bad.data())[1] ^= 0x40;
    const ActualFn one_bad = [&](const std::string& f, const Tensor& e) {
      ActualTensor a = same(f, e);
      if (f == "experts.expert_output.rank0.npy") a.t = bad;
      return a;
    };
    const CaseReport wrong = run_external(c, &one_bad, nullptr);
    CHECK(wrong.outcome == Outcome::INCORRECT);
    for (const auto& ch : wrong.checks)
      if (ch.outcome != Outcome::PASSED) {
        CHECK(ch.slot == "experts");
        break;
      }
  }
}

// Issue 19 §4: at an expert's capacity, rows whose scores tie exactly may be
// kept either way; another tied row is accepted (judged on that choice),
// a row of strictly lower score kept instead of a higher one is not, and
// --strict-ties holds the implementation to the lower token.
namespace {

/// An exact tie at the capacity boundary of case `name` of capacity.yaml:
/// another member of the tie is accepted, a dropped row of lower score kept
/// instead is not, and with sp > 1 neither is a tied row of another SP rank
/// (docs/contract.md §11: rows of different SP ranks never compete).
void check_capacity_ties(const std::string& name) {
  const Case c = case_named("capacity.yaml", name);
  INFO(name);
  std::vector<GoldenTensor> golden;
  REQUIRE(run_external(c, nullptr, &golden).outcome == Outcome::PASSED);
  std::map<std::string, Tensor> files;
  RankBoard dispatched;  // the capacity stage's inputs: the dispatch outputs
  for (const auto& g : golden) {
    if (g.role != "expected") continue;
    if (g.stage == "dispatch" || g.stage == "routing" || g.stage == "sp_shard" || g.stage == "sp_pad_route")
      dispatched[g.name] = g.t;
    if (g.stage == "router_logits" || g.stage == "routing" || g.stage == "dispatch" || g.stage == "sp_shard" ||
        g.stage == "sp_pad_route")
      files[golden_file(g.stage, g.name, g.rank)] = g.t;
  }
  const std::vector<int64_t> counts = to_ints(dispatched.at("counts")), tok = to_ints(dispatched.at("token_sorted"));
  const std::vector<float> score = to_floats(dispatched.at("score_sorted"));
  RankBoard ref_out;
  capacity_reference(c, dispatched, ref_out);
  const std::vector<int64_t> kept_tok = to_ints(ref_out.at("token_sorted"));
  // Per expert: a kept row and a dropped row of equal score (a tie) and, for
  // the negative, a dropped row of strictly lower score than a kept one.
  std::vector<uint8_t> keep(tok.size(), 0);
  int64_t s = 0, kpos = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t nk = to_ints(ref_out.at("counts"))[e];
    const std::set<int64_t> kept(kept_tok.begin() + kpos, kept_tok.begin() + kpos + nk);
    kpos += nk;
    for (int64_t i = s; i < s + counts[e]; ++i) keep[size_t(i)] = kept.count(tok[size_t(i)]) > 0;
    s += counts[e];
  }
  // The SP rank of each token row (the SP layout stacks them, sp_rows each).
  std::vector<int64_t> sp_rank_of;
  if (c.sp > 1)
    for (int64_t q = 0; q < c.sp; ++q)
      for (int64_t i = 0; i < to_ints(dispatched.at("sp_rows"))[size_t(q)]; ++i) sp_rank_of.push_back(q);
  auto rank_of = [&](int64_t i) { return sp_rank_of.empty() ? 0 : sp_rank_of[size_t(tok[size_t(i)])]; };
  std::vector<uint8_t> tie_swap, bad_swap, cross_swap;
  s = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t i = s; i < s + counts[e]; ++i)
      for (int64_t j = s; j < s + counts[e]; ++j) {
        if (!keep[size_t(i)] || keep[size_t(j)]) continue;
        std::vector<uint8_t>& swap = rank_of(i) != rank_of(j)             ? cross_swap
                                     : score[size_t(i)] == score[size_t(j)] ? tie_swap
                                                                            : bad_swap;
        if (!swap.empty() || score[size_t(j)] > score[size_t(i)]) continue;
        swap = keep, swap[size_t(i)] = 0, swap[size_t(j)] = 1;
      }
    s += counts[e];
  }
  REQUIRE(!tie_swap.empty());
  REQUIRE(!bad_swap.empty());
  if (c.sp > 1) REQUIRE(!cross_swap.empty());
  auto check_with = [&](const std::vector<uint8_t>& mask, const ExternalOptions& opt) {
    RankBoard out;
    capacity_reference(c, dispatched, out, &mask);
    std::map<std::string, Tensor> f = files;
    for (const auto& [n, t] : out) f[golden_file("capacity", n, 0)] = t;
    const ActualFn fn = [&](const std::string& name, const Tensor&) {
      ActualTensor a;
      if (auto it = f.find(name); it != f.end()) a.kind = ActualTensor::Kind::present, a.t = it->second;
      return a;
    };
    return run_external(c, &fn, nullptr, opt);
  };
  const CaseReport tie = check_with(tie_swap, {});
  CHECK(failing(tie).empty());
  CHECK(tie.outcome == Outcome::PASSED);
  CHECK(std::any_of(tie.notes.begin(), tie.notes.end(), [](const std::string& n) { return n.find("tied exactly") != std::string::npos; }));
  const CaseReport strict = check_with(tie_swap, ExternalOptions{true});
  CHECK(strict.outcome == Outcome::INCORRECT);
  const CaseReport bad = check_with(bad_swap, {});
  CHECK(bad.outcome == Outcome::INCORRECT);
  CHECK(any_starts(failing(bad), "capacity/"));
  if (c.sp > 1) {
    const CaseReport cross = check_with(cross_swap, {});
    CHECK(cross.outcome == Outcome::INCORRECT);
    CHECK(any_starts(failing(cross), "capacity/"));
  }
}

}  // namespace

TEST_CASE("check accepts another member of an exact tie at the capacity boundary", "[cpu]") {
  check_capacity_ties("exact_ties");
  check_capacity_ties("sp_exact_ties");  // per SP rank (docs/contract.md §11)
}
