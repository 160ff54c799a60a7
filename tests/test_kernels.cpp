// Kernel-level checks: determinism across runs and thread counts, the alias
// guard's byte-range logic, empty problems, and the bodies' bits with any
// number of lanes (an emulated GPU block).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "../kernels/backward_bodies.h"
#include "../kernels/device.h"
#include "../kernels/gemm_plan.h"
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
  // The CUDA executor runs up to 256 threads per item; CI has no GPU, so
  // the index math of many lanes runs here on an emulated block. The router
  // is a thread-per-item body: one lane on every executor.
  static_assert(thread_per_item<k::RouterBody>::value, "the router runs a token per thread");
  static_assert(!thread_per_item<k::RowMapBody<bf16>>::value, "row bodies spread a row over lanes");
  const int64_t T = 29;
  // Ordered combine (16 bytes of columns per lane on a GPU, one vector load
  // per row where the row is 16-byte aligned: D = 64 in bf16; D = 70 takes
  // the element path), the row copies (16-byte pieces, or elements; at D =
  // 1024 a lane's four pieces in flight before it stores), the gather
  // (its score multiply by pieces or elements) and the SwiGLU backward's
  // elementwise body (lanes over f).
  const int K = 3;
  const int64_t F = 45, N = T * K;
  for (int64_t D : {int64_t(70), int64_t(64), int64_t(1024)}) {
    std::vector<bf16> rows(size_t(N * D)), h13(size_t(T * 2 * F)), dH(size_t(T * F)), init(size_t(T * D));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = from_float<bf16>(float(int(i % 41) - 20) / 8.f);
    for (size_t i = 0; i < init.size(); ++i) init[i] = from_float<bf16>(float(int(i % 13) - 6) / 4.f);
    for (size_t i = 0; i < h13.size(); ++i) h13[i] = from_float<bf16>(float(int(i % 29) - 14) / 5.f);
    for (size_t i = 0; i < dH.size(); ++i) dH[i] = from_float<bf16>(float(int(i % 17) - 8) / 3.f);
    std::vector<float> sc(static_cast<size_t>(N));
    std::vector<int32_t> row_of(static_cast<size_t>(N));
    std::vector<int64_t> map(static_cast<size_t>(N));
    for (int64_t a = 0; a < N; ++a) {
      sc[size_t(a)] = float(a % 7 + 1) / 7.f;
      row_of[size_t(a)] = int32_t((a * 11) % N);
      map[size_t(a)] = (a * 13) % (N + 1) - 1;  // some zero rows
    }
    // lanes 0: the host executor's body (kCombineSpan columns a span, one lane)
    auto combine = [&](int lanes, k::Accumulate acc, bool in_place) {
      std::vector<bf16> out = in_place ? init : std::vector<bf16>(size_t(T * D), from_float<bf16>(-1.f));
      const bf16* from = in_place ? out.data() : init.data();
      auto body = [&](auto w) {
        return k::CombineBody<bf16, decltype(w)::value>{rows.data(), sc.data(), row_of.data(), from, nullptr,
                                                        out.data(), D, K, k::ScoreApply::after_experts, acc,
                                                        k::SharedAdd::none, k::CombineOrder::ascending_row,
                                                        k::ScoreMultiply::fp32, k::CombineInit::buffer};
      };
      if (lanes == 0) block_run(body(std::integral_constant<int, k::kCombineSpan>{}), T, 1, false);
      else block_run(body(std::integral_constant<int, k::kDeviceSpan<bf16>>{}), T, lanes, true);
      return out;
    };
    auto row_map = [&](int lanes) {
      std::vector<bf16> out(size_t(N * D), from_float<bf16>(-1.f));
      block_run(k::RowMapBody<bf16>{rows.data(), map.data(), out.data(), D}, N, lanes, lanes > 1);
      return out;
    };
    auto gather = [&](int lanes, k::ScoreApply apply) {
      std::vector<bf16> out(size_t(N * D), from_float<bf16>(-1.f));
      std::vector<int32_t> perm(static_cast<size_t>(N)), tok(perm.size()), row(perm.size());
      std::vector<float> ss(perm.size());
      for (int64_t a = 0; a < N; ++a) perm[size_t(a)] = int32_t((a * 7) % N);  // 7 and N = 87 are coprime
      block_run(k::GatherBody<bf16>{init.data(), perm.data(), sc.data(), out.data(), tok.data(), ss.data(), row.data(), D,
                                    K, apply, k::ScoreMultiply::act},
                N, lanes, lanes > 1);
      return out;
    };
    // the device's dispatch: the metadata pass, then each token's row to
    // its K rows; the same rows and metadata as the gather
    auto scatter = [&](int lanes, k::ScoreApply apply) {
      std::vector<bf16> out(size_t(N * D), from_float<bf16>(-1.f)), want(out);
      std::vector<int32_t> perm(static_cast<size_t>(N)), tok(perm.size()), row(perm.size(), -1), tok1(perm.size()),
          row1(perm.size());
      std::vector<float> ss(perm.size()), ss1(perm.size());
      for (int64_t a = 0; a < N; ++a) perm[size_t(a)] = int32_t((a * 7) % N);
      block_run(k::DispatchMetaBody{perm.data(), sc.data(), tok.data(), ss.data(), row.data(), K}, N, 1, false);
      block_run(k::ScatterRowsBody<bf16>{init.data(), sc.data(), row.data(), out.data(), D, K, apply,
                                         k::ScoreMultiply::act},
                T, lanes, lanes > 1);
      block_run(k::GatherBody<bf16>{init.data(), perm.data(), sc.data(), want.data(), tok1.data(), ss1.data(),
                                    row1.data(), D, K, apply, k::ScoreMultiply::act},
                N, 1, false);
      return tok == tok1 && row == row1 && std::memcmp(ss.data(), ss1.data(), ss.size() * 4) == 0 &&
             std::memcmp(out.data(), want.data(), out.size() * 2) == 0;
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
    for (int lanes : {1, 3, 32, 128}) {
      INFO("D " << D << " lanes " << lanes);
      for (k::Accumulate acc : {k::Accumulate::per_add, k::Accumulate::fp32_accumulate})
        for (bool in_place : {false, true}) CHECK(bits(combine(lanes, acc, in_place)) == bits(combine(0, acc, in_place)));
      CHECK(bits(row_map(lanes)) == bits(row_map(1)));
      for (k::ScoreApply apply : {k::ScoreApply::before_experts, k::ScoreApply::after_experts}) {
        CHECK(bits(gather(lanes, apply)) == bits(gather(1, apply)));
        CHECK(scatter(lanes, apply));
      }
      CHECK(bits(swiglu_bwd(lanes).first) == bits(swiglu_bwd(1).first));
      CHECK(bits(swiglu_bwd(lanes).second) == bits(swiglu_bwd(1).second));
    }
  }
}

namespace {

/// The combine as a device runs it (kDeviceSpan<T> columns a lane, `lanes`
/// lanes, lanes in descending order) against the host executor's body
/// (kCombineSpan columns, one lane), bitwise, over every mode: span by span
/// (CombineBody, four rows' pieces loaded at a time, and CombineBatchBody
/// at eight) and staged (CombineBody::lane_staged, as combine_staged_kernel
/// runs it on a GPU: the next step's pieces copied before the current
/// step's are added; here the copies are plain). Returns the configurations
/// that differ.
template <class T>
int device_combine_differs(int64_t D, int K, int lanes) {
  const int64_t tokens = 23, N = tokens * K;
  std::mt19937 g(uint32_t(D * 131 + K * 7 + lanes));
  std::uniform_int_distribution<int> u(-300, 300);
  auto fill = [&](size_t n) {
    std::vector<T> v(n);
    for (auto& x : v) x = from_float<T>(float(u(g)) / 64.f);
    return v;
  };
  const std::vector<T> rows = fill(size_t(N * D)), init = fill(size_t(tokens * D)), shared = fill(size_t(tokens * D));
  std::vector<float> sc(static_cast<size_t>(N));
  for (auto& s : sc) s = float(u(g) + 301) / 601.f;
  // row_of: a permutation of the N rows with every fifth assignment dropped (-1)
  std::vector<int32_t> row_of(static_cast<size_t>(N));
  for (int64_t a = 0; a < N; ++a) row_of[size_t(a)] = int32_t(a);
  std::shuffle(row_of.begin(), row_of.end(), g);
  for (int64_t a = 4; a < N; a += 5) row_of[size_t(a)] = -1;
  int differ = 0;
  for (auto apply : {k::ScoreApply::after_experts, k::ScoreApply::before_experts})
    for (auto acc : {k::Accumulate::per_add, k::Accumulate::fp32_accumulate})
      for (auto sh : {k::SharedAdd::none, k::SharedAdd::add_after})
        for (auto order : {k::CombineOrder::ascending_row, k::CombineOrder::descending_row})
          for (auto from : {k::CombineInit::buffer, k::CombineInit::zeros})
            for (auto smul : {k::ScoreMultiply::fp32, k::ScoreMultiply::act})
              for (bool in_place : {false, true}) {
                enum class Way { spans, batch8, staged };
                auto run = [&](auto w, int n_lanes, Way way) {
                  constexpr int W = decltype(w)::value;
                  std::vector<T> out = in_place ? init : std::vector<T>(size_t(tokens * D), from_float<T>(-1.f));
                  const k::CombineBody<T, W> body{
                      rows.data(), sc.data(), row_of.data(), in_place ? out.data() : init.data(), shared.data(),
                      out.data(), D, K, apply, acc, sh, order, smul, from};
                  for (int64_t t = 0; t < tokens; ++t) {
                    if (way == Way::spans) {
                      block_item(body, t, n_lanes, n_lanes > 1);
                      continue;
                    }
                    if (way == Way::batch8) {
                      block_item(k::CombineBatchBody<T, W, 8>{body}, t, n_lanes, n_lanes > 1);
                      continue;
                    }
                    if constexpr (W * sizeof(T) == 16)
                      for (int lane = n_lanes - 1; lane >= 0; --lane) {  // combine_staged_kernel's steps
                        if (!body.pieces_aligned(t, int64_t(lane) * W)) {
                          body(t, lane, n_lanes);
                          continue;
                        }
                        int32_t r[k::kMaxTopK];
                        k::Piece area[k::CombineBody<T, W>::kStagedPieces];
                        const int nr = body.sorted_rows(t, r);
                        body.lane_staged(t, r, nr, int64_t(lane) * W, int64_t(n_lanes) * W, area);
                      }
                  }
                  return out;
                };
                const std::vector<T> want = run(std::integral_constant<int, k::kCombineSpan>{}, 1, Way::spans);
                for (Way way : {Way::spans, Way::batch8, Way::staged}) {
                  const std::vector<T> got = run(std::integral_constant<int, k::kDeviceSpan<T>>{}, lanes, way);
                  differ += std::memcmp(want.data(), got.data(), want.size() * sizeof(T)) != 0;
                }
              }
  return differ;
}

}  // namespace

TEST_CASE("the device combine gives the host executor's bits in every mode", "[cpu][bodies]") {
  // D * sizeof(T) a multiple of 16: the pieces (four rows' loads in flight,
  // pairs rounded together; K = 9 and 12 in three batches); D = 70:
  // elements. D = 264 in bf16 is 33 pieces: some lanes have two; D = 68 in
  // fp32 17 pieces (lanes with 6, 5 or no pieces); D = 260 in bf16 rows of
  // 520 bytes, not 16-byte aligned: by elements.
  for (int64_t D : {int64_t(64), int64_t(70), int64_t(264), int64_t(260), int64_t(68)})
    for (int K : {1, 2, 8, 9, 12})
      for (int lanes : {1, 3, 32, 64, 128}) {
        INFO("D " << D << " K " << K << " lanes " << lanes);
        CHECK(device_combine_differs<bf16>(D, K, lanes) == 0);
        CHECK(device_combine_differs<fp16>(D, K, lanes) == 0);
        CHECK(device_combine_differs<float>(D, K, lanes) == 0);
      }
}

TEST_CASE("BusyUnion counts overlapping intervals once", "[cpu][bench]") {
  BusyUnion u;
  CHECK(u.seconds() == 0);
  u.add(1.0, 2.0);
  u.add(1.5, 2.5);  // overlaps the first: [1, 2.5)
  u.add(4.0, 5.0);
  u.add(0.0, 0.5);
  u.add(3.0, 3.0);  // empty
  CHECK(u.seconds() == Approx(3.0));
  u.add(0.25, 4.5);  // joins all of them: [0, 5)
  CHECK(u.seconds() == Approx(5.0));
  u.add(5.0, 6.0);  // touches the end: [0, 6)
  CHECK(u.seconds() == Approx(6.0));
}

TEST_CASE("radix_key_bits: the fewest radix bits that hold every key below a bound", "[cpu][kernels]") {
  CHECK(k::radix_key_bits(1) == 1);  // one expert: keys all 0, one bit still sorted
  CHECK(k::radix_key_bits(256) == 8);  // ids 0..255 of DeepSeek-V3's 256 experts: one 8-bit pass
  CHECK(k::radix_key_bits(257) == 9);
  for (uint64_t keys = 2; keys < 5000; ++keys) {
    const int b = k::radix_key_bits(keys);
    CHECK(((keys - 1) >> b) == 0);        // the largest key fits
    CHECK(((keys - 1) >> (b - 1)) == 1);  // and one bit fewer would not
  }
  CHECK(k::radix_key_bits(uint64_t(256) * 262144) == 26);  // the planted fault's packed keys, E N
}

namespace {
// A job of a plan test: its shape (jobs of one shape may batch) and FLOPs.
struct PlanJob {
  int shape;
  double flops;
  bool batchable;
};
std::vector<k::GemmUnit> plan_of(const std::vector<PlanJob>& jobs, int streams) {
  std::vector<bool> b;
  for (const PlanJob& j : jobs) b.push_back(j.batchable);
  return k::plan_gemm_units(
      jobs.size(), b, [&](size_t x, size_t y) { return jobs[x].shape == jobs[y].shape; },
      [&](size_t i) { return jobs[i].flops; }, streams);
}
}  // namespace

TEST_CASE("plan_gemm_units: one batched call per shape, every other GEMM alone, largest first on the least loaded stream",
          "[cpu][kernels]") {
  using J = std::vector<size_t>;
  SECTION("DeepSeek-V3's forward at equal counts: W1's and W3's GEMMs of 16 experts as one call") {
    std::vector<PlanJob> up(32, PlanJob{0, 1.0, true});
    const auto u = plan_of(up, 4);
    REQUIRE(u.size() == 1);
    CHECK(u[0].jobs.size() == 32);
    CHECK(u[0].flops == 32.0);
  }
  SECTION("a backward's jobs listed expert by expert (W1, W3, W2): one call per shape, not per neighbours") {
    std::vector<PlanJob> jobs;
    for (int e = 0; e < 4; ++e) jobs.insert(jobs.end(), {{0, 2.0, true}, {0, 2.0, true}, {1, 3.0, true}});
    const auto u = plan_of(jobs, 4);
    REQUIRE(u.size() == 2);
    CHECK(u[0].jobs == J{0, 1, 3, 4, 6, 7, 9, 10});
    CHECK(u[1].jobs == J{2, 5, 8, 11});
    CHECK(u[0].stream == 0);  // 16 FLOPs, the larger: first, on stream 0
    CHECK(u[1].stream == 1);
  }
  SECTION("a job that may not batch (fp32, unaligned operands) runs alone beside its shape's call") {
    const auto u = plan_of({{0, 1.0, true}, {0, 1.0, false}, {0, 1.0, true}}, 2);
    REQUIRE(u.size() == 2);
    CHECK(u[0].jobs == J{0, 2});
    CHECK(u[1].jobs == J{1});
  }
  SECTION("unequal counts: single GEMMs, longest processing time first") {
    const auto u = plan_of({{0, 2, true}, {1, 3, true}, {2, 5, true}, {3, 3, true}, {4, 2, true}}, 2);
    REQUIRE(u.size() == 5);
    // largest first: 5 -> s0; 3 -> s1; 3 -> s1 (3 < 5); 2 -> s0 (5 < 6); 2 -> s1 (6 < 7)
    std::vector<size_t> first;
    std::vector<int> s;
    for (const auto& x : u) first.push_back(x.jobs[0]), s.push_back(x.stream);
    CHECK(first == J{2, 1, 3, 0, 4});
    CHECK(s == std::vector<int>{0, 1, 1, 0, 1});
  }
  SECTION("random groups: every job once, a unit's jobs ascending, of one shape and batchable, one unit per shape") {
    std::mt19937 rng(36);
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<PlanJob> jobs(rng() % 24);
      for (auto& j : jobs) j = {int(rng() % 4), double(1 + rng() % 9), rng() % 4 != 0};
      const int streams = 1 + int(rng() % 5);
      const auto u = plan_of(jobs, streams);
      std::vector<int> seen(jobs.size(), 0);
      std::map<int, int> batched_units_of_shape;
      std::vector<double> load(streams, 0);
      for (const auto& x : u) {
        REQUIRE(!x.jobs.empty());
        CHECK(std::is_sorted(x.jobs.begin(), x.jobs.end()));
        double f = 0;
        for (size_t j : x.jobs) {
          ++seen[j];
          f += jobs[j].flops;
          if (x.jobs.size() > 1) CHECK((jobs[j].batchable && jobs[j].shape == jobs[x.jobs[0]].shape));
        }
        CHECK(x.flops == f);
        CHECK((x.stream >= 0 && x.stream < streams));
        load[size_t(x.stream)] += f;
        if (jobs[x.jobs[0]].batchable) ++batched_units_of_shape[jobs[x.jobs[0]].shape];
      }
      for (size_t i = 1; i < u.size(); ++i) {  // enqueue order: decreasing FLOPs, ties by first job
        CHECK(u[i - 1].flops >= u[i].flops);
        if (u[i - 1].flops == u[i].flops) CHECK(u[i - 1].jobs[0] < u[i].jobs[0]);
      }
      for (int n : seen) CHECK(n == 1);
      for (const auto& kv : batched_units_of_shape) CHECK(kv.second == 1);
      // LPT's bound: no stream carries more than the mean plus the largest unit
      double total = 0, largest = 0;
      for (const auto& x : u) total += x.flops, largest = std::max(largest, x.flops);
      for (double l : load) CHECK(l <= total / streams + largest + 1e-9);
    }
  }
}

TEST_CASE("BlockCache gives a freed block back for its exact size, keeps a bounded amount, flushes when out of memory",
          "[cpu][device]") {
  // a device of 1000 bytes: the allocator fails past it
  size_t used = 0, allocs = 0, frees = 0;
  std::map<void*, size_t> live;
  auto alloc = [&](size_t n) -> void* {
    if (used + n > 1000) return nullptr;
    used += n;
    ++allocs;
    void* p = std::malloc(n);
    live[p] = n;
    return p;
  };
  auto release = [&](void* p) {
    used -= live.at(p);
    live.erase(p);
    ++frees;
    std::free(p);
  };
  {
    BlockCache c(alloc, release, 500);
    void* a = c.take(300);
    void* b = c.take(200);
    REQUIRE((a && b));
    c.give(a);
    CHECK(c.kept_bytes() == 300);
    CHECK(c.take(300) == a);  // the same size: the kept block, no new allocation
    CHECK(allocs == 2);
    CHECK(c.kept_bytes() == 0);
    c.give(a);
    void* d = c.take(100);  // another size: a new block
    CHECK((d && d != a));
    CHECK(allocs == 3);
    c.give(b);  // 300 + 200 kept: at the bound, nothing dropped
    CHECK(c.kept_bytes() == 500);
    CHECK(frees == 0);
    c.give(d);  // 600 kept: the largest (a, 300) freed
    CHECK(c.kept_bytes() == 300);
    CHECK(frees == 1);
    CHECK(live.count(a) == 0);
    void* e = c.take(900);  // 300 kept + 900 > 1000: the kept ones flushed, then it fits
    CHECK(e != nullptr);
    CHECK(c.kept_bytes() == 0);
    CHECK(used == 900);
    CHECK(c.take(200) == nullptr);  // out of memory with nothing kept
    c.give(e);
    CHECK(c.kept_bytes() == 0);  // over the bound alone: freed at once
    CHECK(used == 0);
    void* f = c.take(50);
    c.give(f);
  }
  CHECK(live.empty());  // the destructor frees what was kept
  CHECK(used == 0);
}

TEST_CASE("BusyWindow splits a window's union by part, each part's intervals counted once", "[cpu][bench]") {
  BusyWindow w;
  w.add("sort", 0.0, 1.0, 1.0);  // closed: not counted
  w.begin();
  w.add("ScatterRowsBody", 1.0, 3.0, 0.25);
  w.add("ScatterRowsBody", 2.0, 4.0, 0.5);  // a second rank's, overlapping: [1, 4)
  w.add("sort", 0.5, 1.5, 0.75);            // overlaps the scatter's by 0.5
  w.add("copy", 6.0, 6.5, 0.125);
  CHECK(w.end() == Approx(4.0));            // [0.5, 4) and [6, 6.5)
  w.add("copy", 7.0, 9.0, 2.0);             // after the window: not counted
  const std::vector<WindowPart> p = w.parts();
  REQUIRE(p.size() == 3);
  CHECK(p[0].name == "ScatterRowsBody");  // longest first
  CHECK(p[0].seconds == Approx(3.0));
  CHECK(p[0].calls == 2);
  CHECK(p[0].interval_seconds == Approx(4.0));  // the sum of its calls', beside their union's 3
  CHECK(p[0].host_seconds == Approx(0.75));
  CHECK(p[1].name == "sort");
  CHECK(p[1].seconds == Approx(1.0));
  CHECK(p[1].host_seconds == Approx(0.75));  // the closed window's call not counted
  CHECK(p[2].name == "copy");
  CHECK(p[2].seconds == Approx(0.5));
  CHECK(p[2].calls == 1);
  CHECK(p[2].interval_seconds == Approx(0.5));
  CHECK(p[2].host_seconds == Approx(0.125));
  w.begin();  // a new window starts empty
  CHECK(w.parts().empty());
  CHECK(w.end() == 0);
  CHECK(short_type_name(typeid(k::ScatterRowsBody<bf16>)) == "ScatterRowsBody");
  CHECK(short_type_name(typeid(int)) == "int");
}
