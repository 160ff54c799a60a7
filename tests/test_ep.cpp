// Expert parallelism: the communicator's failure modes, padding offsets,
// the EP fault points, and RapidCheck properties over random EP configurations
// (docs/frameworks.md §16 T-A1..A6, T-P1..P4, T-C1..C2).
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "../kernels/ep_host.h"
#include "../kernels/moe_host.h"
#include "case.h"
#include "comm.h"
#include "config_hash.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {


}  // namespace

TEST_CASE("a collective that not every rank joins fails with the rank and collective named", "[cpu][comm]") {
  auto comms = make_local_comms(3, std::chrono::milliseconds(200));
  std::string msg0, msg1;
  std::thread t0([&] {
    try { comms[0]->barrier("test barrier"); } catch (const std::exception& e) { msg0 = e.what(); }
  });
  std::thread t1([&] {
    try { comms[1]->barrier("test barrier"); } catch (const std::exception& e) { msg1 = e.what(); }
  });
  t0.join();
  t1.join();  // rank 2 never arrives
  const std::string msg = msg0.empty() ? msg1 : msg0;
  CHECK(msg.find("test barrier") != std::string::npos);
  CHECK(msg.find("timed out") != std::string::npos);
  CHECK(msg.find("2 of 3 ranks arrived") != std::string::npos);
  CHECK_FALSE(msg1.empty());
}

TEST_CASE("a collective that every other rank has left fails at once, naming the ranks that left", "[cpu][comm]") {
  // Only the leave() notice ends this wait with that message; the timeout
  // (a minute) would say "timed out".
  auto comms = make_local_comms(4, std::chrono::minutes(1));
  std::vector<std::string> msg(4);
  std::vector<std::thread> th;
  for (int r = 0; r < 4; ++r)
    th.emplace_back([&, r] {
      try {
        if (r == 1 || r == 2) comms[size_t(r)]->barrier("test barrier");  // ranks 0 and 3 skip it
      } catch (const std::exception& e) {
        msg[size_t(r)] = e.what();
      }
      comms[size_t(r)]->leave();
    });
  for (auto& t : th) t.join();
  CHECK(msg[0].empty());
  CHECK(msg[3].empty());
  for (int r : {1, 2}) {
    INFO(msg[size_t(r)]);
    CHECK(msg[size_t(r)].find("collective test barrier on rank ") == 0);
    CHECK(msg[size_t(r)].find(": rank(s) 0 and 3 returned without joining it") != std::string::npos);
  }
}

TEST_CASE("ranks that meet in collectives of different names all fail, and nothing moves", "[cpu][comm]") {
  auto comms = make_local_comms(2, std::chrono::minutes(1));
  std::vector<std::string> msg(2);
  std::vector<int64_t> v{10, 20};
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      try {
        comms[size_t(r)]->allreduce_max(&v[size_t(r)], 1, r == 0 ? "first max" : "second max");
      } catch (const std::exception& e) {
        msg[size_t(r)] = e.what();
      }
    });
  for (auto& t : th) t.join();
  CHECK(v == std::vector<int64_t>{10, 20});  // not reduced
  for (int r : {0, 1}) {
    INFO(msg[size_t(r)]);
    CHECK(msg[size_t(r)].find("the ranks are in different collectives (rank 0: first max, rank 1: second max)") !=
          std::string::npos);
  }
}

namespace {

/// Runs fn(rank, comm) on R threads over fresh local comms; returns each
/// rank's exception message ("" when it returned).
template <class Fn>
std::vector<std::string> on_ranks(int R, Fn fn, std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  auto comms = make_local_comms(R, timeout);
  std::vector<std::string> err(static_cast<size_t>(R));
  std::vector<std::thread> th;
  for (int r = 0; r < R; ++r)
    th.emplace_back([&, r] {
      try {
        fn(r, *comms[size_t(r)]);
      } catch (const std::exception& e) {
        err[size_t(r)] = e.what();
      }
    });
  for (auto& t : th) t.join();
  return err;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("a device copy that fails on one rank ends its all-to-all on every rank, with no peer left waiting",
          "[cpu][comm][device]") {
  // Rank 1's receive fails inside the exchange (after the ranks met): it must
  // still reach the exchange's closing meeting, or rank 0 waits there for
  // ever (that meeting has no deadline; ctest's timeout would end the test).
  std::vector<std::vector<int32_t>> recv(2, std::vector<int32_t>(2, -1));
  auto comms = make_local_comms(2, std::chrono::minutes(1), [&](void* d, const void* s, size_t n) {
    if (d >= static_cast<void*>(recv[1].data()) && d < static_cast<void*>(recv[1].data() + 2))
      throw std::runtime_error("device copy failed");
    std::memcpy(d, s, n);
  });
  std::vector<std::string> msg(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      const std::vector<int32_t> send = {10 * r, 10 * r + 1};
      try {
        comms[size_t(r)]->alltoallv_device(send.data(), 2, {1, 1}, recv[size_t(r)].data(), 2, {1, 1}, 4, "rows");
      } catch (const std::exception& e) {
        msg[size_t(r)] = e.what();
      }
      comms[size_t(r)]->leave();
    });
  for (auto& t : th) t.join();
  CHECK(msg[0].empty());
  CHECK(recv[0] == std::vector<int32_t>{0, 10});
  CHECK(msg[1] == "device copy failed");
}

TEST_CASE("local ranks on a device move token rows with the device copy, metadata on the host", "[cpu][comm][device]") {
  // The copy stands in for a device-to-device copy: it records what it moved.
  std::mutex m;
  size_t copied = 0;
  auto comms = make_local_comms(2, std::chrono::milliseconds(5000), [&](void* d, const void* s, size_t n) {
    std::memcpy(d, s, n);
    std::lock_guard<std::mutex> lk(m);
    copied += n;
  });
  std::vector<std::vector<int32_t>> recv(2, std::vector<int32_t>(3, -1)), counts(2, std::vector<int32_t>(2, -1));
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      Comm& c = *comms[size_t(r)];
      CHECK(c.device_buffers());
      // rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 to rank 0 and 1 to itself
      const std::vector<int32_t> send = r == 0 ? std::vector<int32_t>{10, 11, 12} : std::vector<int32_t>{20, 21, 22};
      const std::vector<int64_t> s = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
      const std::vector<int64_t> q = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
      c.alltoallv_device(send.data(), 3, s, recv[size_t(r)].data(), 3, q, 4, "rows");
      const std::vector<int32_t> mine = {r, r};
      c.alltoallv(mine.data(), 2, {1, 1}, counts[size_t(r)].data(), 2, {1, 1}, 4, "counts");
    });
  for (auto& t : th) t.join();
  CHECK(recv[0] == std::vector<int32_t>{10, 20, 21});
  CHECK(recv[1] == std::vector<int32_t>{11, 12, 22});
  CHECK(counts[0] == std::vector<int32_t>{0, 1});
  CHECK(copied == 6 * 4);  // the rows only: the count exchange stayed on the host
  // Without a device copy there is no device exchange.
  auto host = make_local_comms(1, std::chrono::milliseconds(5000));
  CHECK_FALSE(host[0]->device_buffers());
  int32_t a = 1, b = 0;
  CHECK_THROWS_AS(host[0]->alltoallv_device(&a, 1, {1}, &b, 1, {1}, 4, "rows"), std::logic_error);
}

#if defined(MOEVERIFY_HAVE_CUDA)
TEST_CASE("an NCCL communicator that cannot start fails on every rank, none waits", "[cpu][comm]") {
  // Without a usable GPU (CI) no rank can take its device; on a GPU machine
  // both ranks ask for GPU 0, which NCCL refuses (one rank per GPU). Either
  // way every rank must throw, within the deadline, instead of one rank
  // waiting in ncclCommInitRank for a peer that gave up.
  const auto err = on_ranks(2, [](int, Comm& host) { make_nccl_comm(host, 0, std::chrono::milliseconds(20000)); });
  for (const std::string& e : err) {
    INFO(e);
    CHECK(has(e, "nccl"));
  }
}
#endif

TEST_CASE("inconsistent all-to-all splits fail on every rank instead of corrupting", "[cpu][comm]") {
  // Repeated: the rank that detected the mismatch used to throw (and free its
  // send buffer) while its peer still copied from it, a use-after-free that
  // ASan saw in about a third of single runs.
  for (int rep = 0; rep < 50; ++rep) {
    const auto err = on_ranks(2, [](int r, Comm& comm) {
      std::vector<float> send(4, 1.f), recv(8, 0.f);
      // rank 0 sends 1 row to rank 1, but rank 1 expects 2 from rank 0
      const std::vector<int64_t> s = {1, 1};
      const std::vector<int64_t> rr = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
      comm.alltoallv(send.data(), 4, s, recv.data(), 8, rr, 4, "test a2a");
      throw std::runtime_error("alltoallv returned on rank " + std::to_string(r));
    });
    REQUIRE(has(err[1], "split mismatch: rank 0 sends 1 rows to rank 1, which expects 2"));
    REQUIRE(has(err[0], "collective test a2a on rank 0: not run on any rank: rank 1 failed the argument check"));
  }
}

TEST_CASE("all-to-all splits that overrun a buffer fail on every rank before any row moves", "[cpu][comm]") {
  // Sender and receiver agree on 3 rows, but the sender's buffer holds 2 (the
  // unswapped-splits bug): the split check alone would pass and read past it.
  for (const bool recv_side : {false, true}) {
    INFO((recv_side ? "receive" : "send") << " buffer too small");
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<std::vector<float>> recv(3);
      const auto err = on_ranks(3, [&](int r, Comm& comm) {
        std::vector<float> send(size_t(r == 1 && !recv_side ? 2 : 3), 5.f);
        recv[size_t(r)].assign(size_t(r == 2 && recv_side ? 2 : 3), -1.f);
        const std::vector<int64_t> s = {1, 1, 1}, rr = {1, 1, 1};
        comm.alltoallv(send.data(), int64_t(send.size()), s, recv[size_t(r)].data(), int64_t(recv[size_t(r)].size()),
                       rr, sizeof(float), "test a2a");
      });
      const int bad = recv_side ? 2 : 1;
      for (int r = 0; r < 3; ++r) {
        INFO("rank " << r << ": " << err[size_t(r)]);
        REQUIRE(has(err[size_t(r)], "collective test a2a on rank " + std::to_string(r)));
        if (r == bad)
          REQUIRE(has(err[size_t(r)], recv_side ? "receive splits sum to 3 rows but the receive buffer holds 2 rows"
                                                : "send splits sum to 3 rows but the send buffer holds 2 rows"));
        else
          REQUIRE(has(err[size_t(r)], "rank " + std::to_string(bad) + " failed the argument check"));
        for (float v : recv[size_t(r)]) REQUIRE(v == -1.f);  // no rank copied anything
      }
    }
  }
}

TEST_CASE("all-to-all-v argument faults are named: list length, negative split, row size", "[cpu][comm]") {
  auto a2a = [](int bad_rank, std::vector<int64_t> bad_send, size_t bad_row_bytes) {
    return on_ranks(2, [=](int r, Comm& comm) {
      std::vector<uint8_t> send(64, 1), recv(64, 0);
      const std::vector<int64_t> ok = {1, 1};
      comm.alltoallv(send.data(), 8, r == bad_rank ? bad_send : ok, recv.data(), 8, ok,
                     r == bad_rank ? bad_row_bytes : 4, "test a2a");
    });
  };
  auto e = a2a(1, {1, 1, 1}, 4);
  CHECK(has(e[1], "split lists have 3 (send) and 2 (receive) entries"));
  CHECK(has(e[0], "rank 1 failed the argument check"));
  e = a2a(0, {-1, 3}, 4);
  CHECK(has(e[0], "negative split -1 for rank 0"));
  CHECK_FALSE(e[1].empty());
  e = a2a(1, {1, 1}, 8);
  CHECK(has(e[1], "row size 8 bytes differs from rank 0's 4 bytes"));
  CHECK_FALSE(e[0].empty());
}

TEST_CASE("all-gather and all-reduce of different sizes fail on every rank without a hang", "[cpu][comm]") {
  for (int rep = 0; rep < 20; ++rep) {
    auto e = on_ranks(3, [](int r, Comm& comm) {
      std::vector<uint8_t> mine(size_t(r == 2 ? 3 : 4), 7), all(12, 0);
      comm.allgather(mine.data(), mine.size(), all.data(), "test gather");
    });
    for (const auto& m : e) REQUIRE((has(m, "test gather") && has(m, "ranks contribute different sizes (rank 2: 3 bytes")));
    e = on_ranks(2, [](int r, Comm& comm) {
      std::vector<int64_t> v(size_t(r + 1), 1);
      comm.allreduce_sum(v.data(), int(v.size()), "test reduce");
    });
    for (const auto& m : e) REQUIRE(has(m, "ranks reduce different lengths"));
  }
}

TEST_CASE("a rank that catches a collective failure can run the next collective with its peers", "[cpu][comm]") {
  const auto err = on_ranks(3, [](int r, Comm& comm) {
    std::vector<int64_t> send(3, r), recv(3, -1);
    try {
      const std::vector<int64_t> bad = {1, 1, r == 0 ? 2 : 1};  // rank 0 overruns its 3-row buffer
      comm.alltoallv(send.data(), 3, bad, recv.data(), 3, {1, 1, 1}, 8, "failing a2a");
    } catch (const std::exception&) {
    }
    comm.alltoallv(send.data(), 3, {1, 1, 1}, recv.data(), 3, {1, 1, 1}, 8, "next a2a");
    for (int p = 0; p < 3; ++p)
      if (recv[size_t(p)] != p) throw std::runtime_error("wrong row from rank " + std::to_string(p));
  });
  for (const auto& m : err) CHECK(m.empty());
}

TEST_CASE("all-to-all-v properties", "[cpu][prop][comm]") {
  rc::prop("random splits and capacities: every rank throws, or every rank receives exactly its rows", [] {
    const int R = *rc::gen::inRange(1, 5);
    const bool consistent = *rc::gen::weightedOneOf<bool>({{3, rc::gen::just(true)}, {1, rc::gen::just(false)}});
    std::vector<std::vector<int64_t>> send(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R)));
    for (auto& v : send)
      for (auto& x : v) x = *rc::gen::inRange<int64_t>(0, 4);
    std::vector<std::vector<int64_t>> recv(static_cast<size_t>(R), std::vector<int64_t>(static_cast<size_t>(R)));
    for (int q = 0; q < R; ++q)
      for (int p = 0; p < R; ++p)
        recv[size_t(q)][size_t(p)] = consistent ? send[size_t(p)][size_t(q)] : *rc::gen::inRange<int64_t>(0, 4);
    std::vector<int64_t> send_cap(static_cast<size_t>(R)), recv_cap(static_cast<size_t>(R));
    bool fits = true;
    for (int r = 0; r < R; ++r) {
      const int64_t ns = std::accumulate(send[size_t(r)].begin(), send[size_t(r)].end(), int64_t(0));
      const int64_t nr = std::accumulate(recv[size_t(r)].begin(), recv[size_t(r)].end(), int64_t(0));
      send_cap[size_t(r)] = std::max<int64_t>(0, ns + *rc::gen::inRange<int64_t>(-1, 2));
      recv_cap[size_t(r)] = std::max<int64_t>(0, nr + *rc::gen::inRange<int64_t>(-1, 2));
      fits = fits && ns <= send_cap[size_t(r)] && nr <= recv_cap[size_t(r)];
    }
    bool agree = true;
    for (int q = 0; q < R; ++q)
      for (int p = 0; p < R; ++p) agree = agree && recv[size_t(q)][size_t(p)] == send[size_t(p)][size_t(q)];
    RC_CLASSIFY(agree && fits, "valid");
    RC_CLASSIFY(!agree, "split mismatch");
    RC_CLASSIFY(!fits, "buffer overrun");
    const int64_t D = 3;  // int64 columns; value = (source, destination, row, column)
    std::vector<std::vector<int64_t>> got(static_cast<size_t>(R));
    const auto err = on_ranks(R, [&](int r, Comm& comm) {
      // exactly the capacity: ASan sees any read or write past it
      std::vector<int64_t> out(size_t(send_cap[size_t(r)] * D));
      int64_t row = 0;
      for (int q = 0; q < R; ++q)
        for (int64_t i = 0; i < send[size_t(r)][size_t(q)] && row < send_cap[size_t(r)]; ++i, ++row)
          for (int64_t d = 0; d < D; ++d) out[size_t(row * D + d)] = ((r * 8 + q) * 8 + i) * 8 + d;
      got[size_t(r)].assign(size_t(recv_cap[size_t(r)] * D), -1);
      comm.alltoallv(out.data(), send_cap[size_t(r)], send[size_t(r)], got[size_t(r)].data(), recv_cap[size_t(r)],
                     recv[size_t(r)], size_t(D) * sizeof(int64_t), "prop a2a");
    });
    const bool ok = agree && fits;
    for (int r = 0; r < R; ++r) RC_ASSERT(err[size_t(r)].empty() == ok);
    if (!ok) {
      for (int r = 0; r < R; ++r)
        for (int64_t v : got[size_t(r)]) RC_ASSERT(v == -1);  // nobody copied
      return;
    }
    for (int q = 0; q < R; ++q) {
      int64_t row = 0;
      for (int p = 0; p < R; ++p)
        for (int64_t i = 0; i < recv[size_t(q)][size_t(p)]; ++i, ++row)
          for (int64_t d = 0; d < D; ++d) RC_ASSERT(got[size_t(q)][size_t(row * D + d)] == ((p * 8 + q) * 8 + i) * 8 + d);
      for (int64_t k = row * D; k < int64_t(got[size_t(q)].size()); ++k) RC_ASSERT(got[size_t(q)][size_t(k)] == -1);
    }
  });
}

TEST_CASE("config_hash changes with every field that affects results, not with the source location", "[cpu][comm]") {
  const Case base = case_named("ep.yaml", "ep2_basic[experts.kind=identity]");
  const uint64_t h0 = config_hash(base);
  Case same = base;
  same.source = "/elsewhere/copy.yaml:3";
  CHECK(config_hash(same) == h0);
  std::vector<std::pair<const char*, std::function<void(Case&)>>> edits = {
      {"name", [](Case& c) { c.name += "x"; }},
      {"tokens", [](Case& c) { c.tokens += 1; }},
      {"hidden", [](Case& c) { c.hidden += 1; }},
      {"ffn", [](Case& c) { c.ffn += 1; }},
      {"num_experts", [](Case& c) { c.num_experts *= 2; }},
      {"top_k", [](Case& c) { c.top_k += 1; }},
      {"dtype", [](Case& c) { c.dtype = DType::bf16; }},
      {"seed", [](Case& c) { c.seed += 1; }},
      {"data", [](Case& c) { c.data = DataMode::realistic; }},
      {"router.score", [](Case& c) { c.router.score = k::ScoreFunc::sigmoid; }},
      {"router.bias", [](Case& c) { c.router.bias = Switch::on; }},
      {"router.groups", [](Case& c) { c.router.groups = 2; }},
      {"router.limited_groups", [](Case& c) { c.router.limited_groups = 2; }},
      {"router.force_load_balance", [](Case& c) { c.router.force_load_balance = Switch::on; }},
      {"router.route_norm", [](Case& c) { c.router.route_norm = Switch::on; }},
      {"router.route_scale", [](Case& c) { c.router.route_scale = 2.5f; }},
      {"router.hot_expert", [](Case& c) { c.router.hot_expert = 0; }},
      {"experts.kind", [](Case& c) { c.experts.kind = ExpertKind::swiglu; }},
      {"experts.impl", [](Case& c) { c.experts.impl = ExpertsImpl::grouped; }},
      {"experts.weights", [](Case& c) { c.experts.weights = WeightStorage::streamed; }},
      {"shared.kind", [](Case& c) { c.shared.kind = SharedKind::identity; }},
      {"shared.order", [](Case& c) { c.shared.order = SharedOrder::init_with_shared; }},
      {"score_before_experts", [](Case& c) { c.score_before_experts = Switch::on; }},
      {"combine.accumulate", [](Case& c) { c.combine.accumulate = k::Accumulate::fp32_accumulate; }},
      {"combine.placement", [](Case& c) { c.combine.placement = CombinePlacement::in_place; }},
      {"combine.buffer", [](Case& c) { c.combine.buffer = OutBuffer::alias_x; }},
      {"combine.alias_offset", [](Case& c) { c.combine.alias_offset = 3; }},
      {"tolerance_override", [](Case& c) { c.tolerance_override[CompareClass::gemm] = Case::ToleranceOverride{1e-3, 1e-5}; }},
      {"ep", [](Case& c) { c.ep = 4; }},
      {"tokens_per_rank", [](Case& c) { c.tokens_per_rank = {24, 23}; }},
      {"tokens_uniform_lo", [](Case& c) { c.tokens_uniform_lo = 0; }},
      {"tokens_uniform_hi", [](Case& c) { c.tokens_uniform_hi = 9; }},
      {"align", [](Case& c) { c.align = 8; }},
      {"empty_groups", [](Case& c) { c.empty_groups = EmptyGroups::pad; }},
      {"permute", [](Case& c) { c.permute = PermuteMode::generic; }},
      {"equal_split.policy", [](Case& c) { c.equal_split.policy = EqualSplitPolicy::force; }},
      {"equal_split.threshold", [](Case& c) { c.equal_split.threshold = 0.25; }},
  };
  for (const auto& [field, edit] : edits) {
    INFO(field);
    Case c = base;
    edit(c);
    CHECK(config_hash(c) != h0);
  }
  FaultSet f;
  f.bits = uint32_t(Fault::unswapped_combine_splits);
  CHECK(config_hash(base, f) != config_hash(base, FaultSet{}));
}

TEST_CASE("group offsets are 64-bit: groups past 2^31 rows, and the 32-bit fault wraps", "[cpu][fault][pad]") {
  const std::vector<int64_t> counts = {int64_t(1) << 30, int64_t(1) << 30, 3, int64_t(1) << 30};
  const PadLayout good = pad_layout(counts.data(), 4, 8, EmptyGroupRows::zero, FaultSet{});
  CHECK(good.start[3] == (int64_t(1) << 31) + 8);
  CHECK(good.start[4] == 3 * (int64_t(1) << 30) + 8);
  FaultSet f;
  f.bits = uint32_t(Fault::offsets_32bit);
  const PadLayout bad = pad_layout(counts.data(), 4, 8, EmptyGroupRows::zero, f);
  CHECK(bad.start[3] != good.start[3]);
}

TEST_CASE("fault pad_rows_first is caught by the padding layout check", "[cpu][fault][pad]") {
  const Case c = case_named("ep.yaml", "ep8_align16[empty_groups=zero]");
  REQUIRE(run_case(c, RunOptions{}).outcome == Outcome::PASSED);
  RunOptions o;
  o.faults.bits = uint32_t(Fault::pad_rows_first);
  const CaseReport r = run_case(c, o);
  CHECK(any_starts(failing(r), "align_pad/expert_input"));
  // The EP = 1 runs of the invariance check run the fast path alone; when
  // their output differs they run again with every stage checked, and the
  // invariance check names the first stage of that run that failed.
  bool named = false;
  for (const auto& ch : r.checks)
    named = named || (ch.slot == "ep_invariance" && ch.outcome == Outcome::INCORRECT &&
                      ch.note.find("EP = 1 run of this rank's tokens was INCORRECT at align_pad/") != std::string::npos);
  CHECK(named);
}

TEST_CASE("fault unswapped_combine_splits is caught on uneven splits", "[cpu][fault]") {
  const Case c = case_named("ep4.yaml", "ep4_zero_token_rank");
  REQUIRE(run_case(c, RunOptions{}).outcome == Outcome::PASSED);
  RunOptions o;
  o.faults.bits = uint32_t(Fault::unswapped_combine_splits);
  const CaseReport r = run_case(c, o);
  CHECK(r.outcome != Outcome::PASSED);
  CHECK(any_starts(failing(r), "ep_combine/"));
}

TEST_CASE("equal-count permute runs where every segment is equal and agrees with generic", "[cpu][permute]") {
  const CaseReport r = run_case(case_named("ep4.yaml", "ep4_equal_count"), RunOptions{});
  REQUIRE(r.outcome == Outcome::PASSED);
  bool ran = false, compared = false;
  for (const auto& d : r.decisions) ran = ran || (d.slot == "ep_permute" && d.variant == "equal_count" && d.ran && d.primary);
  for (const auto& ch : r.checks) compared = compared || (ch.slot == "ep_permute" && ch.against == "equal_count");
  CHECK(ran);
  CHECK(compared);
}

TEST_CASE("fault pad_front is caught: equal-split padding must follow the data", "[cpu][fault][equal_split]") {
  const Case c = case_named("equal_split.yaml", "equal_split_force");
  REQUIRE(run_case(c, RunOptions{}).outcome == Outcome::PASSED);
  RunOptions o;
  o.faults.bits = uint32_t(Fault::pad_front);
  const auto failed = failing(run_case(c, o));
  CHECK(any_starts(failed, "ep_dispatch/recv"));
}

TEST_CASE("ranks with different local padding overheads take the same equal-split branch", "[cpu][equal_split]") {
  // threshold 50%: the global overhead (221%) is above it, but some ranks' own
  // overhead is below it. Reduced, every rank declines the padding (PASSED);
  // decided locally, ranks disagree: the one rank that pads waits in its
  // all-to-all for peers that have returned, and says so at once (ERROR),
  // not after the timeout (a minute here, with another message).
  const Case c = case_named("equal_split.yaml", "equal_split_adaptive[equal_split.threshold=0.5]");
  RunOptions o;
  o.collective_timeout_ms = 60 * 1000;
  const CaseReport good = run_case(c, o);
  CHECK(good.outcome == Outcome::PASSED);
  bool declined = false;
  for (const auto& d : good.decisions)
    declined = declined || (d.variant == "a2a_equal_split" && !d.ran && d.reason.find("> threshold 50%") != std::string::npos);
  CHECK(declined);
  o.faults.bits = uint32_t(Fault::local_equal_split_decision);
  const CaseReport bad = run_case(c, o);
  CHECK(bad.outcome == Outcome::ERROR);
  bool deserted = false;
  for (const auto& ch : bad.checks)
    deserted = deserted || has(ch.note, "equal-split all-to-all (dispatch) on rank 1: rank(s) 0, 2 and 3 returned "
                                        "without joining it (the ranks disagree on which collectives run)");
  CHECK(deserted);
}

TEST_CASE("batched experts: the weight cache is rebuilt when the version changes, and the stale fault is caught",
          "[cpu][fault][batched]") {
  const int E_l = 3;
  const int64_t c = 70, D = 12, F = 10;  // c > one GEMM tile
  std::vector<float> X(size_t(E_l * c * D)), W1(size_t(E_l * F * D)), W3(W1.size()), W2(W1.size());
  float v = 0.f;
  for (auto* w : {&X, &W1, &W3, &W2})
    for (auto& e : *w) e = (v = std::fmod(v * 1.7f + 0.37f, 2.f)) - 1.f;
  const std::vector<int64_t> counts(size_t(E_l), c);
  auto loop = [&] {
    std::vector<float> Y(X.size());
    experts_swiglu(ExecCtx{2, {}}, DType::fp32, ExpertsImpl::loop, X.data(), counts.data(), E_l, D, F, W1.data(),
                   W3.data(), W2.data(), Y.data());
    return Y;
  };
  auto close = [](const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      if (std::fabs(a[i] - b[i]) > 1e-5 + 1e-5 * std::fabs(b[i])) return false;
    return true;
  };
  for (bool fault : {false, true}) {
    ExecCtx ex{2, {}};
    if (fault) ex.faults.bits = uint32_t(Fault::stale_weight_cache);
    BatchedWeightCache cache;
    std::vector<float> Y(X.size());
    experts_swiglu_batched(ex, DType::fp32, X.data(), c, E_l, D, F, W1.data(), W3.data(), W2.data(), 1, cache, Y.data());
    CHECK(close(Y, loop()));  // batched == loop within the GEMM tolerance
    experts_swiglu_batched(ex, DType::fp32, X.data(), c, E_l, D, F, W1.data(), W3.data(), W2.data(), 1, cache, Y.data());
    CHECK(cache.builds == 1);  // same version: the cache is reused
    for (auto& e : W3) e *= 0.5f;  // the weights change in place; the owner bumps the version
    experts_swiglu_batched(ex, DType::fp32, X.data(), c, E_l, D, F, W1.data(), W3.data(), W2.data(), 2, cache, Y.data());
    CHECK(close(Y, loop()) == !fault);  // a stale cache gives the old weights' result
    CHECK(cache.builds == (fault ? 1 : 2));
    for (auto& e : W3) e *= 2.f;
  }
}

TEST_CASE("force-LB fast path: analytic splits equal the exchanged ones, and the unguarded direct route is caught",
          "[cpu][fault][force_lb]") {
  for (const char* name : {"unguarded_shortcut_T6_E8_K2_R2", "unguarded_shortcut_T6_E4_K1_R2"}) {
    INFO(name);
    const Case c = case_named("force_lb.yaml", name);
    const CaseReport good = run_case(c, RunOptions{});
    REQUIRE(good.outcome == Outcome::PASSED);
    bool compared = false;  // a2a_force_lb's splits and rows vs the variable path, bitwise
    for (const auto& ch : good.checks)
      compared = compared || (ch.variant == "a2a_force_lb" && ch.against == "a2a_variable" &&
                              ch.tensor.rfind("output_splits", 0) == 0 && ch.outcome == Outcome::PASSED);
    CHECK(compared);
    RunOptions o;
    o.faults.bits = uint32_t(Fault::direct_route_unguarded);
    CHECK(any_starts(failing(run_case(c, o)), "ep_dispatch/recv"));
  }
}

TEST_CASE("expert-parallel properties", "[cpu][prop][ep]") {
  rc::prop("equal-split compact(pad(X, s, M*), s, M*) == X for any M* >= max(s) (Q1)", [] {
    const int R = *rc::gen::inRange(1, 7);
    std::vector<int64_t> s(static_cast<size_t>(R));
    for (auto& v : s) v = *rc::gen::inRange<int64_t>(0, 9);
    const int64_t mstar = *std::max_element(s.begin(), s.end()) + *rc::gen::inRange<int64_t>(0, 4);
    const std::vector<int64_t> pad = equal_split_pad_map(s, mstar, FaultSet{});
    const std::vector<int64_t> compact = equal_split_compact_map(s, mstar);
    int64_t n = 0;
    for (int64_t v : s) n += v;
    RC_ASSERT(int64_t(compact.size()) == n);
    for (int64_t i = 0; i < n; ++i) RC_ASSERT(pad[size_t(compact[size_t(i)])] == i);  // round trip
    for (int p = 0; p < R; ++p)  // data first, zeros after, in every chunk
      for (int64_t r = 0; r < mstar; ++r) RC_ASSERT((pad[size_t(p * mstar + r)] < 0) == (r >= s[size_t(p)]));
  });

  rc::prop("random R, E_l, per-rank T (zeros too) and A: every stage, EP invariance and padding pass", [] {
    Case c;
    c.ep = *rc::gen::inRange(1, 6);
    const int E_l = *rc::gen::inRange(1, 4);
    c.num_experts = c.ep * E_l;
    c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 3) + 1);
    c.hidden = *rc::gen::inRange<int64_t>(1, 9);
    c.ffn = *rc::gen::inRange<int64_t>(1, 9);
    c.seed = *rc::gen::inRange<uint64_t>(0, 100000);
    for (int r = 0; r < c.ep; ++r)
      c.tokens_per_rank.push_back(*rc::gen::weightedOneOf<int64_t>({{1, rc::gen::just<int64_t>(0)}, {3, rc::gen::inRange<int64_t>(1, 20)}}));
    c.align = *rc::gen::element<int64_t>(1, 1, 2, 8);
    c.empty_groups = *rc::gen::element(EmptyGroups::zero, EmptyGroups::pad);
    c.permute = *rc::gen::element(PermuteMode::auto_, PermuteMode::generic);
    c.router.force_load_balance = *rc::gen::element(Switch::off, Switch::on);
    c.router.hot_expert = *rc::gen::element(-1, -1, 0);
    c.equal_split.policy = *rc::gen::element(EqualSplitPolicy::off, EqualSplitPolicy::force, EqualSplitPolicy::adaptive);
    c.equal_split.threshold = *rc::gen::element(0.0, 0.1, 1.0);
    c.data = *rc::gen::element(DataMode::exact, DataMode::realistic);
    c.dtype = *rc::gen::element(DType::fp32, DType::bf16);
    c.experts.kind = *rc::gen::element(ExpertKind::identity, ExpertKind::swiglu);
    int64_t total = 0;
    for (int64_t t : c.tokens_per_rank) total += t;
    RC_CLASSIFY(std::count(c.tokens_per_rank.begin(), c.tokens_per_rank.end(), 0) > 0, "a rank without tokens");
    RC_CLASSIFY(total * c.top_k < c.num_experts, "T*K < E");
    RC_CLASSIFY(c.align > 1, "A > 1");
    const CaseReport r = run_case(c, RunOptions{});
    bool invariance = false;
    for (const auto& ch : r.checks) {
      invariance = invariance || ch.slot == "ep_invariance";
      if (ch.outcome != Outcome::PASSED)
        RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) + " " + ch.note);
    }
    RC_ASSERT(invariance == (c.ep > 1));
  });

  rc::prop("generic permute is a bijection and equals the equal-count transpose where it applies", [] {
    const int R = *rc::gen::inRange(1, 6), E_l = *rc::gen::inRange(1, 5);
    const bool equal = *rc::gen::arbitrary<bool>();
    const int64_t c = *rc::gen::inRange<int64_t>(1, 5);
    std::vector<int64_t> counts(static_cast<size_t>(R * E_l));
    for (auto& v : counts) v = equal ? c : *rc::gen::inRange<int64_t>(0, 5);
    const std::vector<int64_t> map = permute_map_generic(counts.data(), R, E_l);
    std::vector<int64_t> sorted = map;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) RC_ASSERT(sorted[i] == int64_t(i));
    const std::vector<int64_t> inv = invert_map(map);
    for (size_t q = 0; q < map.size(); ++q) RC_ASSERT(inv[size_t(map[q])] == int64_t(q));
    if (equal) {
      const EqualCountMap fwd{R, E_l, c, 0}, back{R, E_l, c, 1};
      for (size_t q = 0; q < map.size(); ++q) {
        RC_ASSERT(fwd(int64_t(q)) == map[q]);
        RC_ASSERT(back(int64_t(q)) == inv[q]);
      }
    }
  });

  rc::prop("padding layout: groups are multiples of A, data first, pad rows map to nothing, unpad inverts", [] {
    const int E_l = *rc::gen::inRange(1, 6);
    const int64_t A = *rc::gen::element<int64_t>(1, 2, 8, 16);
    const EmptyGroupRows mode = *rc::gen::element(EmptyGroupRows::zero, EmptyGroupRows::align);
    std::vector<int64_t> n(static_cast<size_t>(E_l));
    for (auto& v : n) v = *rc::gen::inRange<int64_t>(0, 40);
    const PadLayout l = pad_layout(n.data(), E_l, A, mode, FaultSet{});
    const std::vector<int64_t> map = pad_map(n.data(), l, FaultSet{});
    const std::vector<int64_t> un = unpad_map(n.data(), l);
    int64_t M = 0, src = 0;
    for (int64_t v : n) M += v;
    RC_ASSERT(l.buffer_rows % A == 0);
    for (int j = 0; j < E_l; ++j) {
      RC_ASSERT(l.rows[size_t(j)] % A == 0);
      RC_ASSERT(l.rows[size_t(j)] >= n[size_t(j)]);
      if (mode == EmptyGroupRows::align && n[size_t(j)] == 0) RC_ASSERT(l.rows[size_t(j)] == A);
      for (int64_t i = 0; i < l.rows[size_t(j)]; ++i)
        RC_ASSERT(map[size_t(l.start[size_t(j)] + i)] == (i < n[size_t(j)] ? src + i : -1));
      src += n[size_t(j)];
    }
    for (int64_t q = l.start[size_t(E_l)]; q < l.buffer_rows; ++q) RC_ASSERT(map[size_t(q)] == -1);
    RC_ASSERT(int64_t(un.size()) == M);
    for (int64_t i = 0; i < M; ++i) RC_ASSERT(map[size_t(un[size_t(i)])] == i);
  });
}

// issue 34 item 9: MPI's counts and displacements are int; a split, an offset
// or a row size past INT_MAX is refused before the exchange (comm_mpi.cpp),
// one that just fits is not.
TEST_CASE("the MPI all-to-all refuses counts and offsets past INT_MAX", "[cpu]") {
  using comm_detail::mpi_count_overflow;
  const int64_t M = INT_MAX;
  CHECK(mpi_count_overflow({M, 0}, {1, 1}, 8) == -1);           // the largest split, the largest offset
  CHECK(mpi_count_overflow({M, 1, 0}, {0, 0, 0}, 8) == M + 1);  // a zero split's displacement is an int too
  CHECK(mpi_count_overflow({M - 1, 1, 1}, {0, 0, 0}, 8) == -1); // offsets 0, M - 1, M
  CHECK(mpi_count_overflow({M, 1, 1}, {0, 0, 0}, 8) == M + 1);  // the offset of rank 2 is M + 1
  CHECK(mpi_count_overflow({0, 0}, {M + 1, 0}, 8) == M + 1);    // a received split
  CHECK(mpi_count_overflow({1}, {1}, size_t(M) + 1) == M + 1);  // a row of more than INT_MAX bytes
}
