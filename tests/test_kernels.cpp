// Kernel-level checks: determinism across runs and thread counts, the alias
// guard's byte-range logic, empty problems, and the bodies' bits with any
// number of lanes (an emulated GPU block).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "../kernels/backward_bodies.h"
#include "../kernels/host_exec.h"
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

namespace {

/// A GPU block emulated on the host (block_item), lanes in either order.
template <class Body>
void block_run(const Body& body, int64_t n, int lanes, bool descending) {
  for (int64_t i = 0; i < n; ++i) block_item(body, i, lanes, descending);
}

}  // namespace

TEST_CASE("kernel bodies give the host executor's bits with any lane count", "[cpu][bodies]") {
  // The CUDA executor runs lanes = 128 threads per item; CI has no GPU, so
  // the index math of many lanes runs here on an emulated block.
  const int64_t T = 29;
  for (int E : {8, 13, 256})
    for (k::ScoreFunc sf : {k::ScoreFunc::softmax, k::ScoreFunc::sigmoid})
      for (k::Selection sel : {k::Selection::topk, k::Selection::force_load_balance}) {
        const int K = std::min(E, 6), groups = E % 4 == 0 ? 4 : 1;
        std::vector<float> logits(static_cast<size_t>(T * E)), bias(static_cast<size_t>(E));
        for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(int((i * 37) % 23) - 11) / 4.f;  // ties
        for (int e = 0; e < E; ++e) bias[size_t(e)] = float(e % 3) / 8.f;
        auto route = [&](int lanes, bool desc) {
          std::vector<float> s(logits.size(), -1.f), c(logits.size(), -1.f), ts(size_t(T * K), -1.f);
          std::vector<int32_t> ids(size_t(T * K), -1);
          k::RouterBody b{logits.data(), bias.data(), s.data(), c.data(), ids.data(), ts.data(), T, E, K, groups,
                          groups > 1 ? 2 : 1, 2.5f, sf, sel, k::RouteNorm::on, k::TieBreak::lower_id};
          if (lanes == 0) host_run(ExecCtx{1, {}}, T, b);
          else block_run(b, T, lanes, desc);
          return std::make_tuple(s, ids, ts);
        };
        const auto want = route(0, false);
        for (int lanes : {1, 3, 32, 128})
          for (bool desc : {false, true}) {
            const auto got = route(lanes, desc);
            INFO("E " << E << " lanes " << lanes << (desc ? " descending" : ""));
            CHECK(std::memcmp(std::get<0>(got).data(), std::get<0>(want).data(), std::get<0>(want).size() * 4) == 0);
            CHECK(std::get<1>(got) == std::get<1>(want));
            CHECK(std::memcmp(std::get<2>(got).data(), std::get<2>(want).data(), std::get<2>(want).size() * 4) == 0);
          }
      }
  // Ordered combine (one column per lane on a GPU) and the SwiGLU backward's
  // elementwise body (lanes over f).
  const int K = 3;
  const int64_t D = 70, F = 45, N = T * K;
  std::vector<bf16> rows(size_t(N * D)), h13(size_t(T * 2 * F)), dH(size_t(T * F));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = from_float<bf16>(float(int(i % 41) - 20) / 8.f);
  for (size_t i = 0; i < h13.size(); ++i) h13[i] = from_float<bf16>(float(int(i % 29) - 14) / 5.f);
  for (size_t i = 0; i < dH.size(); ++i) dH[i] = from_float<bf16>(float(int(i % 17) - 8) / 3.f);
  std::vector<float> sc(static_cast<size_t>(N));
  std::vector<int32_t> row_of(static_cast<size_t>(N));
  for (int64_t a = 0; a < N; ++a) {
    sc[size_t(a)] = float(a % 7 + 1) / 7.f;
    row_of[size_t(a)] = int32_t((a * 11) % N);
  }
  auto combine = [&](int lanes) {
    std::vector<bf16> out(size_t(T * D), from_float<bf16>(-1.f));
    const k::CombineBody<bf16, 1> b{rows.data(), sc.data(), row_of.data(), nullptr, nullptr, out.data(), D, K,
                                    k::ScoreApply::after_experts, k::Accumulate::per_add, k::SharedAdd::none,
                                    k::CombineOrder::ascending_row, k::ScoreMultiply::fp32, k::CombineInit::zeros};
    block_run(b, T, lanes, lanes > 1);
    return out;
  };
  auto swiglu_bwd = [&](int lanes) {
    std::vector<bf16> H(size_t(T * F)), g(size_t(T * 2 * F));
    block_run(k::SwigluBwdBody<bf16>{h13.data(), dH.data(), H.data(), g.data(), F}, T, lanes, lanes > 1);
    return std::make_pair(H, g);
  };
  auto bits = [](const std::vector<bf16>& v) {
    std::vector<uint16_t> b;
    for (bf16 x : v) b.push_back(x.bits);
    return b;
  };
  for (int lanes : {3, 32, 128}) {
    INFO("lanes " << lanes);
    CHECK(bits(combine(lanes)) == bits(combine(1)));
    CHECK(bits(swiglu_bwd(lanes).first) == bits(swiglu_bwd(1).first));
    CHECK(bits(swiglu_bwd(lanes).second) == bits(swiglu_bwd(1).second));
  }
}
