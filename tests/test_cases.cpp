// Case files: strict validation with file:line:column, sweeps, --set overrides.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <vector>
#include <fstream>
#include <unistd.h>

#include "case.h"
#include "diff.h"
#include "error.h"

using namespace moev;

namespace {

/// A case file of `text` under the system's temporary folder (not the
/// working directory, which ctest's is the build tree), removed at exit.
std::string write_tmp(const std::string& text) {
  static int n = 0;
  static struct Cleanup {
    std::vector<std::string> paths;
    ~Cleanup() {
      for (const auto& p : paths) std::remove(p.c_str());
    }
  } made;
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("moev_case_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".yaml"))
                               .string();
  std::ofstream(path) << text;
  made.paths.push_back(path);
  return path;
}

/// The error message of loading `text`; fails the test if it loads.
std::string load_error(const std::string& text, const std::vector<std::string>& sets = {}) {
  const std::string path = write_tmp(text);
  try {
    load_cases(path, sets);
  } catch (const Error& e) {
    CHECK(e.kind == ErrorKind::bad_input);
    return e.what();
  }
  FAIL("the case file loaded but should have been rejected:\n" << text);
  return "";
}

}  // namespace

TEST_CASE("a valid file loads with defaults, nesting, dotted keys and sweeps", "[cpu][cases]") {
  const auto cases = load_cases(write_tmp(R"(defaults:
  shape: {tokens: 10, experts: 4}
cases:
  - name: a
    shape.top_k: 3
    router: {score: sigmoid, route_norm: true}
  - name: b
    sweep: {dtype: [fp32, bf16], shape.top_k: [1, 2, 4]}
)"), {});
  REQUIRE(cases.size() == 7);
  CHECK(cases[0].name == "a");
  CHECK(cases[0].tokens == 10);
  CHECK(cases[0].top_k == 3);
  CHECK(cases[0].router.score == k::ScoreFunc::sigmoid);
  CHECK(cases[0].router.route_norm == Switch::on);
  CHECK(cases[1].name == "b[dtype=fp32,shape.top_k=1]");
  CHECK(cases[6].name == "b[dtype=bf16,shape.top_k=4]");
  CHECK(cases[6].dtype == DType::bf16);
}

TEST_CASE("set overrides from the command line apply to every case", "[cpu][cases]") {
  const auto cases = load_cases(write_tmp("cases:\n  - name: a\n    shape: {tokens: 10}\n"), {"shape.tokens=77", "dtype=fp16"});
  REQUIRE(cases.size() == 1);
  CHECK(cases[0].tokens == 77);
  CHECK(cases[0].dtype == DType::fp16);
}

// shape.tokens_per_rank stands in place of shape.tokens: --set shape.tokens
// leaves such a case out with a note instead of running it unchanged.
TEST_CASE("set shape.tokens leaves a case with tokens_per_rank out, said", "[cpu][cases]") {
  const std::string f = write_tmp(
      "cases:\n  - name: a\n    ep: 2\n    shape: {tokens_per_rank: [3, 0]}\n  - name: b\n    ep: 2\n");
  LoadNotes notes;
  const auto cases = load_cases(f, {"shape.tokens=5"}, &notes);
  REQUIRE(cases.size() == 1);
  CHECK(cases[0].name == "b");
  CHECK(cases[0].tokens == 5);
  REQUIRE(notes.left_out.size() == 1);
  const std::string left = left_out_note(notes.left_out[0]);
  CHECK(left.find("case a left out (--set does not fit it): ") == 0);
  CHECK(left.find("does not apply to a case with shape.tokens_per_rank [3,0]") != std::string::npos);
  // both set on the command line: the per-rank counts win, nothing left out
  notes = {};
  const auto both = load_cases(f, {"shape.tokens=5", "shape.tokens_per_rank=[1,2]"}, &notes);
  CHECK(both.size() == 2);
  CHECK(notes.left_out.empty());
}

TEST_CASE("bad input names file, line, column, the key and what is valid", "[cpu][cases]") {
  struct Bad {
    const char* text;
    const char* loc;   // ":line:col:" expected in the message
    const char* what;  // a fragment of the message
  };
  const std::vector<Bad> bad = {
      {"cases:\n  - name: a\n    shape: {tokens: 10, topk: 2}\n", ":3:25:", "unknown key"},
      {"cases:\n  - name: a\n    shape: {experts: 4, top_k: 5}\n", ":3:32:", "top_k 5 exceeds experts 4"},
      {"cases:\n  - name: a\n    dtype: fp64\n", ":3:12:", "valid: fp32 | bf16 | fp16"},
      {"cases:\n  - name: a\n    shape: {tokens: many}\n", ":3:21:", "expected an integer"},
      {"cases:\n  - name: a\n    shape: {tokens: -1}\n", ":3:21:", "out of range"},
      {"cases:\n  - name: a\n    shape: {experts: 10}\n    router: {groups: 4}\n", ":4:22:", "not divisible by groups"},
      {"cases:\n  - name: a\n    shape: {experts: 8}\n    router: {groups: 2, limited_groups: 3}\n", ":4:41:",
       "exceeds groups"},
      {"cases:\n  - name: a\n    combine: {buffer: alias_x}\n", ":3:23:", "identity shared expert"},
      {"cases:\n  - name: a\n  - name: a\n", ":3:5:", "duplicate case name"},
      {"cases:\n  - shape: {tokens: 3}\n", ":2:5:", "every case needs a name"},
      {"cases: [\n", ":2:1:", "YAML syntax error"},
      {"case:\n  - name: a\n", ":1:1:", "unknown top-level key"},
      {"cases:\n  - name: a\n    sweep: {shape.tokens: 5}\n", ":3:27:", "non-empty list"},
      {"cases:\n  - name: a\n    router: {route_scale: 0}\n", ":3:27:", "must be positive"},
  };
  for (const auto& b : bad) {
    INFO(b.text);
    const std::string msg = load_error(b.text);
    INFO(msg);
    CHECK(msg.find(b.loc) != std::string::npos);
    CHECK(msg.find(b.what) != std::string::npos);
    CHECK(msg.find("; ") != std::string::npos);  // "what is wrong; what would be valid"
    CHECK(msg.find('\n') == std::string::npos);  // one line
  }
}

TEST_CASE("a missing file and a bad --set are bad input", "[cpu][cases]") {
  CHECK_THROWS_AS(load_cases("/nonexistent/case.yaml", {}), Error);
  CHECK(load_error("cases:\n  - name: a\n", {"shape.tokenz=3"}).find("unknown key 'shape.tokenz'") != std::string::npos);
  CHECK(load_error("cases:\n  - name: a\n", {"shape.tokens=x"}).find("--set shape.tokens") != std::string::npos);
}

TEST_CASE("a case's override never leaks into the defaults of the next case", "[cpu][cases]") {
  const auto cases = load_cases(write_tmp(R"(defaults:
  shape: {hidden: 16}
  data: exact
cases:
  - name: a
    shape: {hidden: 32}
    data: realistic
  - name: b
)"), {});
  REQUIRE(cases.size() == 2);
  CHECK(cases[0].hidden == 32);
  CHECK(cases[1].hidden == 16);
  CHECK(cases[1].data == DataMode::exact);
}

TEST_CASE("a tolerance override of 0 applies, and only the parts given replace the table", "[cpu][cases]") {
  const auto cases = load_cases(write_tmp("cases:\n  - name: a\n    dtype: bf16\n    tolerance: {gemm: {atol: 0}, scores: {rtol: 0, atol: 0}}\n"), {});
  REQUIRE(cases.size() == 1);
  const Tolerance table = default_tolerance(CompareClass::gemm, DType::bf16);
  REQUIRE(table.atol > 0);
  CHECK(tolerance_for(cases[0], CompareClass::gemm).atol == 0);
  CHECK(tolerance_for(cases[0], CompareClass::gemm).rtol == table.rtol);
  CHECK(tolerance_for(cases[0], CompareClass::scores).rtol == 0);
  CHECK(tolerance_for(cases[0], CompareClass::scores).atol == 0);
  CHECK(tolerance_for(cases[0], CompareClass::logits).rtol == default_tolerance(CompareClass::logits, DType::bf16).rtol);
}
