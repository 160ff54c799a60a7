// Kernel-level checks: determinism across runs and thread counts, the alias
// guard's byte-range logic, empty problems.
#include <catch2/catch.hpp>

#include <cstring>

#include "case.h"
#include "runner.h"

using namespace moev;

namespace {

Board fast_board(const Case& c, int threads) {
  RunOptions o;
  o.threads = threads;
  o.keep = RunOptions::Keep::fast_board;
  CaseReport r = run_case(c, o);
  REQUIRE(r.outcome == Outcome::PASSED);
  return r.fast;
}

}  // namespace

TEST_CASE("every fast output is bitwise identical across repeated runs and 1..4 threads", "[cpu][determinism]") {
  Case c;
  c.tokens = 300;  // several GEMM tiles and sort chunks
  c.hidden = 40;
  c.ffn = 24;
  c.num_experts = 12;
  c.top_k = 3;
  c.dtype = DType::bf16;
  c.data = DataMode::realistic;
  c.experts.kind = ExpertKind::swiglu;
  c.shared.kind = SharedKind::swiglu;
  const Board base = fast_board(c, 1);
  for (int threads : {1, 2, 3, 4}) {
    const Board b = fast_board(c, threads);
    for (const auto& [name, t] : base.ranks[0]) {
      INFO("tensor " << name << ", threads " << threads);
      const Tensor& u = b.at(name, 0);
      REQUIRE(u.bytes() == t.bytes());
      CHECK(std::memcmp(u.data(), t.data(), t.bytes()) == 0);
    }
  }
}

TEST_CASE("byte-range overlap", "[cpu][alias]") {
  alignas(8) uint8_t buf[64] = {};
  CHECK(ranges_overlap({buf, 16}, {buf + 15, 4}));
  CHECK_FALSE(ranges_overlap({buf, 16}, {buf + 16, 4}));
  CHECK(ranges_overlap({buf + 8, 4}, {buf, 64}));
  CHECK_FALSE(ranges_overlap({buf, 0}, {buf, 64}));  // empty never overlaps
  CHECK(ranges_overlap({buf, 1}, {buf, 1}));
}

TEST_CASE("zero tokens: every stage runs on empty tensors and passes", "[cpu][empty]") {
  Case c;
  c.tokens = 0;
  c.experts.kind = ExpertKind::swiglu;
  RunOptions o;
  const CaseReport r = run_case(c, o);
  CHECK(r.outcome == Outcome::PASSED);
  CHECK(r.checks.size() > 8);
}
