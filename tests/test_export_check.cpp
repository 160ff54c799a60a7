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
#include "test_util.h"

using namespace moev;

TEST_CASE("export case json names every case key", "[cpu]") {
  const nlohmann::ordered_json j = case_to_json(case_named("basic.yaml", "exact_fp32"));
  for (const auto& [key, help] : case_keys()) {
    if (key.rfind("tolerance.", 0) == 0 || key == "shape.tokens_per_rank") continue;  // written when set
    INFO(key);
    CHECK(j.contains(key));
  }
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
