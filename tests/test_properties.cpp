// RapidCheck properties over random configurations (docs/frameworks.md §16: T-L1..L6,
// T-S1, T-S2). The seed is printed on stderr; RC_PARAMS="seed=N" replays.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "case.h"
#include "runner.h"

using namespace moev;

namespace {

struct Routing {
  int64_t T = 0;
  int E = 1, K = 1;
  std::vector<int32_t> ids;  // (T, K): K distinct experts per token
};

rc::Gen<Routing> gen_routing() {
  return rc::gen::exec([] {
    Routing r;
    r.E = *rc::gen::inRange(1, 17);
    r.K = *rc::gen::inRange(1, std::min(r.E, 6) + 1);
    r.T = *rc::gen::inRange<int64_t>(0, 40);
    const bool hot = *rc::gen::arbitrary<bool>();  // lean toward one hot expert
    for (int64_t t = 0; t < r.T; ++t) {
      std::vector<int32_t> e(static_cast<size_t>(r.E));
      std::iota(e.begin(), e.end(), 0);
      const auto order = *rc::gen::container<std::vector<int>>(size_t(r.E), rc::gen::inRange(0, 1 << 20));
      std::stable_sort(e.begin(), e.end(), [&](int a, int b) { return hot ? a < b : order[size_t(a)] < order[size_t(b)]; });
      r.ids.insert(r.ids.end(), e.begin(), e.begin() + r.K);
    }
    return r;
  });
}

rc::Gen<Case> gen_case() {
  return rc::gen::exec([] {
    Case c;
    c.num_experts = *rc::gen::inRange(1, 17);
    c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 4) + 1);
    c.tokens = *rc::gen::inRange<int64_t>(0, 48);
    c.hidden = *rc::gen::inRange<int64_t>(1, 24);  // not a multiple of any vector width on purpose
    c.ffn = *rc::gen::inRange<int64_t>(1, 20);
    c.seed = *rc::gen::inRange<uint64_t>(0, 1000000);
    c.dtype = *rc::gen::element(DType::fp32, DType::bf16, DType::fp16);
    c.data = *rc::gen::element(DataMode::exact, DataMode::realistic);
    c.router.score = *rc::gen::element(k::ScoreFunc::softmax, k::ScoreFunc::sigmoid);
    c.router.bias = *rc::gen::element(Switch::off, Switch::on);
    c.router.force_load_balance = *rc::gen::element(Switch::off, Switch::off, Switch::on);
    c.router.route_norm = *rc::gen::element(Switch::off, Switch::on);
    c.experts.kind = *rc::gen::element(ExpertKind::identity, ExpertKind::swiglu);
    c.experts.impl = *rc::gen::element(ExpertsImpl::loop, ExpertsImpl::grouped);
    c.shared.kind = *rc::gen::element(SharedKind::none, SharedKind::identity, SharedKind::swiglu);
    if (c.shared.kind != SharedKind::none)
      c.shared.order = *rc::gen::element(SharedOrder::add_after, SharedOrder::init_with_shared);
    c.score_before_experts = *rc::gen::element(Switch::off, Switch::off, Switch::on);
    c.combine.accumulate = *rc::gen::element(k::Accumulate::per_add, k::Accumulate::fp32_accumulate);
    c.combine.placement = *rc::gen::element(CombinePlacement::out_of_place, CombinePlacement::in_place);
    return c;
  });
}

struct Dispatched {
  std::vector<int32_t> perm, token_sorted, row_of;
  std::vector<float> score_sorted, routed;
};

Dispatched dispatch_fp32(const Routing& r, const std::vector<float>& x, const std::vector<float>& scores, int64_t D,
                         int threads) {
  const int64_t N = r.T * r.K;
  Dispatched d;
  d.perm.assign(size_t(N), -1);
  d.token_sorted.assign(size_t(N), -1);
  d.row_of.assign(size_t(N), -1);
  d.score_sorted.assign(size_t(N), 0.f);
  d.routed.assign(size_t(N * D), 0.f);
  ExecCtx ex{threads, {}};
  expert_sort(ex, r.ids.data(), N, r.E, d.perm.data());
  dispatch_gather(ex, DType::fp32, k::ScoreApply::after_experts, x.data(), d.perm.data(), scores.data(), N, D, r.K,
                  d.routed.data(), d.token_sorted.data(), d.score_sorted.data(), d.row_of.data());
  return d;
}

std::vector<float> small_ints(size_t n) {
  return *rc::gen::container<std::vector<float>>(n, rc::gen::map(rc::gen::inRange(-8, 9), [](int v) { return float(v); }));
}

/// An integer in [lo, hi) over the whole range at every test size (inRange
/// alone narrows the range for the first tests, which would put nearly every
/// buffer at the start of its allocation).
rc::Gen<size_t> uniform(size_t lo, size_t hi) { return rc::gen::resize(rc::kNominalSize, rc::gen::inRange(lo, hi)); }

/// A 4-byte aligned byte buffer (float and int32 inputs may sit in it).
struct Words {
  std::vector<uint32_t> w;
  size_t bytes = 0;
  uint8_t* p() { return reinterpret_cast<uint8_t*>(w.data()); }
  const uint8_t* p() const { return reinterpret_cast<const uint8_t*>(w.data()); }
};

/// `n` bytes copied from src (zeros when src is null).
Words raw_words(const void* src, size_t n) {
  Words b;
  b.w.assign(n / 4 + 1, 0u);
  b.bytes = n;
  if (src && n) std::memcpy(b.p(), src, n);
  return b;
}

/// Values stored as the activation type dt.
Words act_words(const std::vector<float>& v, DType dt) {
  Words b = raw_words(nullptr, v.size() * dtype_bytes(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::fp32) {
      std::memcpy(b.p() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dt == DType::bf16 ? from_float<bf16>(v[i]).bits : from_float<fp16>(v[i]).bits;
      std::memcpy(b.p() + 2 * i, &h, 2);
    }
  }
  return b;
}

}  // namespace

TEST_CASE("local dispatch", "[cpu][prop]") {
  rc::prop("is a permutation in contract order: expert-major, ascending token (T-L1, L2, L3)", [] {
    const Routing r = *gen_routing();
    const int64_t N = r.T * r.K, D = 3;
    RC_CLASSIFY(N < r.E, "some experts get no token");
    const std::vector<float> x = small_ints(size_t(r.T * D)), s(size_t(N), 1.f);
    const Dispatched d = dispatch_fp32(r, x, s, D, *rc::gen::inRange(1, 5));
    std::vector<int> seen(size_t(N), 0), per_token(size_t(r.T), 0);
    for (int64_t i = 0; i < N; ++i) {
      const int32_t a = d.perm[size_t(i)];
      RC_ASSERT(a >= 0);
      RC_ASSERT(a < N);
      ++seen[size_t(a)];
      ++per_token[size_t(d.token_sorted[size_t(i)])];
      RC_ASSERT(d.row_of[size_t(a)] == i);
      RC_ASSERT(d.token_sorted[size_t(i)] == a / r.K);
      for (int64_t c = 0; c < D; ++c) RC_ASSERT(d.routed[size_t(i * D + c)] == x[size_t((a / r.K) * D + c)]);
      if (i > 0) {
        const int32_t p = d.perm[size_t(i - 1)];
        const int32_t ep = r.ids[size_t(p)], ea = r.ids[size_t(a)];
        RC_ASSERT(ep <= ea);
        if (ep == ea) RC_ASSERT(d.token_sorted[size_t(i - 1)] < d.token_sorted[size_t(i)]);
      }
    }
    for (int v : seen) RC_ASSERT(v == 1);
    for (int v : per_token) RC_ASSERT(v == r.K);
  });
}

TEST_CASE("combine", "[cpu][prop]") {
  rc::prop("identity experts with unit scores give K*x exactly (T-L4)", [] {
    const Routing r = *gen_routing();
    const int64_t D = *rc::gen::inRange<int64_t>(1, 9), N = r.T * r.K;
    const std::vector<float> x = small_ints(size_t(r.T * D)), s(size_t(N), 1.f);
    const Dispatched d = dispatch_fp32(r, x, s, D, 2);
    for (DType dt : {DType::fp32, DType::bf16, DType::fp16}) {
      CombineArgs a;
      a.dt = dt;
      a.T = r.T;
      a.D = D;
      a.K = r.K;
      a.score_sorted = d.score_sorted.data();
      a.row_of = d.row_of.data();
      a.acc = *rc::gen::element(k::Accumulate::per_add, k::Accumulate::fp32_accumulate);
      std::vector<uint16_t> ro16(size_t(N * D)), init16(size_t(r.T * D), 0), out16(size_t(r.T * D), 0xFFFF);
      std::vector<float> init32(size_t(r.T * D), 0.f), out32(size_t(r.T * D), NAN);
      for (size_t i = 0; i < ro16.size(); ++i)
        ro16[i] = dt == DType::bf16 ? from_float<bf16>(d.routed[i]).bits : from_float<fp16>(d.routed[i]).bits;
      a.routed_out = dt == DType::fp32 ? static_cast<const void*>(d.routed.data()) : ro16.data();
      combine(ExecCtx{2, {}}, a, dt == DType::fp32 ? static_cast<const void*>(init32.data()) : init16.data(),
              dt == DType::fp32 ? static_cast<void*>(out32.data()) : out16.data());
      for (int64_t i = 0; i < r.T * D; ++i) {
        const float got = dt == DType::fp32 ? out32[size_t(i)]
                          : dt == DType::bf16 ? to_float(bf16{out16[size_t(i)]}) : to_float(fp16{out16[size_t(i)]});
        RC_ASSERT(got == float(r.K) * x[size_t(i)]);
      }
    }
  });

  rc::prop("is the adjoint of dispatch: <combine(Y), G> = <Y, s * G[token]> in fp64 (T-L5)", [] {
    const Routing r = *gen_routing();
    const int64_t D = *rc::gen::inRange<int64_t>(1, 9), N = r.T * r.K;
    const std::vector<float> x(size_t(r.T * D), 0.f);
    std::vector<float> s(static_cast<size_t>(N));
    for (auto& v : s) v = float(*rc::gen::inRange(1, 1000)) / 997.f;
    const Dispatched d = dispatch_fp32(r, x, s, D, 1);
    std::vector<float> Y(size_t(N * D)), G(size_t(r.T * D)), init(size_t(r.T * D), 0.f), out(size_t(r.T * D));
    for (auto& v : Y) v = float(*rc::gen::inRange(-1000, 1001)) / 1000.f;
    for (auto& v : G) v = float(*rc::gen::inRange(-1000, 1001)) / 1000.f;
    CombineArgs a;
    a.dt = DType::fp32;
    a.routed_out = Y.data();
    a.score_sorted = d.score_sorted.data();
    a.row_of = d.row_of.data();
    a.T = r.T;
    a.D = D;
    a.K = r.K;
    a.acc = k::Accumulate::fp32_accumulate;
    combine(ExecCtx{1, {}}, a, init.data(), out.data());
    double lhs = 0, rhs = 0, mag = 0;
    for (int64_t i = 0; i < r.T * D; ++i) lhs += double(out[size_t(i)]) * G[size_t(i)];
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < D; ++c) {
        const double term = double(Y[size_t(i * D + c)]) * d.score_sorted[size_t(i)] *
                            G[size_t(d.token_sorted[size_t(i)] * D + c)];
        rhs += term;
        mag += std::fabs(term);
      }
    // fp32 rounding of each product and partial sum bounds the gap
    RC_ASSERT(std::fabs(lhs - rhs) <= 1e-6 * (mag + 1) * (r.K + 2));
  });

  // docs/frameworks.md §9.2 pitfalls: the guard must check the caller's buffer against
  // EVERY protected input by byte range, not only x (the one FK checks) and not
  // only the first range it is given. The buffer shares one allocation with a
  // drawn input (x, routed_output, score_sorted, row_of, token_sorted or
  // shared_out, in the order the pipeline passes them: src/paths/stages_local.cpp
  // combine_inputs) at random offsets, in a drawn dtype; the other inputs live
  // in their own allocations.
  rc::prop("in-place equals out-of-place bitwise for random overlaps with any protected input; inputs untouched (T-S1)",
           [] {
    const Routing r = *gen_routing();
    RC_PRE(r.T > 0);
    const DType dt = *rc::gen::element(DType::fp32, DType::bf16, DType::fp16);
    const size_t ab = dtype_bytes(dt);
    const int64_t D = int64_t(*uniform(1, 33)), N = r.T * r.K, TD = r.T * D;  // overlaps of hundreds of elements
    std::vector<float> s(static_cast<size_t>(N));
    for (auto& v : s) v = float(*rc::gen::inRange(1, 64)) / 16.f;
    const Dispatched d = dispatch_fp32(r, std::vector<float>(size_t(TD), 0.f), s, D, 1);
    enum In { kX, kRouted, kScore, kRowOf, kTokenSorted, kShared, kNum };
    const char* names[kNum] = {"x", "routed_output", "score_sorted", "row_of", "token_sorted", "shared_out"};
    // pre-call contents of every input, 4-byte aligned
    std::vector<Words> before(kNum);
    before[kX] = act_words(small_ints(size_t(TD)), dt);
    before[kRouted] = act_words(small_ints(size_t(N * D)), dt);
    before[kScore] = raw_words(d.score_sorted.data(), size_t(N) * 4);
    before[kRowOf] = raw_words(d.row_of.data(), size_t(N) * 4);
    before[kTokenSorted] = raw_words(d.token_sorted.data(), size_t(N) * 4);
    before[kShared] = act_words(small_ints(size_t(TD)), dt);
    const size_t elem[kNum] = {ab, ab, 4, 4, 4, ab};
    const int target = *rc::gen::element(0, 1, 2, 3, 4, 5);
    const size_t in_bytes = before[size_t(target)].bytes, buf_bytes = size_t(TD) * ab;
    // One allocation holds the target input at in_off and the caller's buffer at buf_off.
    const size_t total = in_bytes + buf_bytes + ab * *uniform(0, 2 * (in_bytes + buf_bytes) / ab + 2);
    Words arena = act_words(small_ints(total / ab), dt);
    const size_t in_off = elem[target] * *uniform(0, (total - in_bytes) / elem[target] + 1);
    const size_t buf_off = ab * *uniform(0, (total - buf_bytes) / ab + 1);
    std::memcpy(arena.p() + in_off, before[size_t(target)].p(), in_bytes);
    const bool overlap = buf_off < in_off + in_bytes && in_off < buf_off + buf_bytes;
    const size_t overlap_elems =
        overlap ? (std::min(buf_off + buf_bytes, in_off + in_bytes) - std::max(buf_off, in_off)) / ab : 0;
    RC_CLASSIFY(overlap, std::string("buffer overlaps ") + names[target]);
    RC_CLASSIFY(!overlap, "no overlap");
    RC_CLASSIFY(overlap_elems >= 100, "overlap of >= 100 elements");
    const Words init = raw_words(arena.p() + buf_off, buf_bytes);
    std::vector<Words> own = before;  // the non-target inputs' own allocations
    uint8_t* ptr[kNum];
    for (int i = 0; i < kNum; ++i) ptr[i] = i == target ? arena.p() + in_off : own[size_t(i)].p();

    CombineArgs a;
    a.dt = dt;
    a.T = r.T;
    a.D = D;
    a.K = r.K;
    a.acc = *rc::gen::element(k::Accumulate::per_add, k::Accumulate::fp32_accumulate);
    a.shared_add = *rc::gen::element(k::SharedAdd::none, k::SharedAdd::add_after);
    // expected: out-of-place on private copies of every input
    a.routed_out = before[kRouted].p();
    a.score_sorted = reinterpret_cast<const float*>(before[kScore].p());
    a.row_of = reinterpret_cast<const int32_t*>(before[kRowOf].p());
    a.shared = before[kShared].p();
    Words expect = raw_words(nullptr, buf_bytes);
    combine(ExecCtx{1, {}}, a, init.p(), expect.p());

    a.routed_out = ptr[kRouted];
    a.score_sorted = reinterpret_cast<const float*>(ptr[kScore]);
    a.row_of = reinterpret_cast<const int32_t*>(ptr[kRowOf]);
    a.shared = ptr[kShared];
    ByteRange inputs[kNum];
    for (int i = 0; i < kNum; ++i) inputs[i] = {ptr[i], before[size_t(i)].bytes};
    Words fallback = raw_words(nullptr, buf_bytes);
    const InPlaceResult res = combine_in_place(ExecCtx{*rc::gen::inRange(1, 4), {}}, a, arena.p() + buf_off,
                                               fallback.p(), inputs, names, kNum);
    RC_ASSERT((res.placement == Placement::out_of_place_fallback) == overlap);
    const uint8_t* got = res.placement == Placement::in_place ? arena.p() + buf_off : fallback.p();
    RC_ASSERT(std::memcmp(got, expect.p(), buf_bytes) == 0);
    RC_LOG() << "buffer shares an allocation with " << names[target] << ", overlap " << overlap_elems
             << " elements, placement " << (res.placement == Placement::in_place ? "in_place" : "fallback") << "\n";
    for (int i = 0; i < kNum; ++i) RC_ASSERT(std::memcmp(ptr[i], before[size_t(i)].p(), before[size_t(i)].bytes) == 0);
  });
}

TEST_CASE("whole pipeline", "[cpu][prop]") {
  rc::prop("fast == reference, stage by stage and end to end, for random shapes and dtypes, host and emulated device",
           [] {
    Case c = *gen_case();
    // The emulated device: the device plumbing (residency, poisoning,
    // pointer translation, device-to-device exchange) under the same checks.
    c.backend = *rc::gen::element(Backend::host, Backend::emulated);
    RC_CLASSIFY(c.backend == Backend::emulated, "emulated device");
    RC_CLASSIFY(c.dtype == DType::fp32, "fp32");
    RC_CLASSIFY(c.dtype == DType::bf16, "bf16");
    RC_CLASSIFY(c.tokens * c.top_k < c.num_experts, "T*K < E");
    RC_CLASSIFY(c.tokens == 0, "T = 0");
    RunOptions o;
    o.threads = *rc::gen::inRange(1, 4);
    const CaseReport r = run_case(c, o);
    for (const auto& ch : r.checks) {
      // Data too small to show a bug (fp16 products of tiny values rounding
      // to zero) is NOT_VERIFIED, an honest verdict: such a draw is
      // discarded, not failed (a draw of one token with D = F = 1 in fp16).
      if (ch.outcome == Outcome::NOT_VERIFIED && ch.note.find("cannot show a wrong result") != std::string::npos)
        RC_DISCARD("uninformative data: " + ch.note);
      if (ch.outcome != Outcome::PASSED)
        RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) +
                " " + ch.note);
    }
    RC_ASSERT(r.outcome == Outcome::PASSED);
  });
}
