// Backward of the token path (docs/contract.md §13, docs/frameworks.md §13; src/paths/stages_backward.cpp):
// the adjoint identities in fp64 on the fast kernels (exact data, so the
// fp32 results are the exact values), the round trip of the gradient rows
// through the whole EP backward (identity experts: every backward stage is
// data movement, so the gradient arriving at dispatch equals the one leaving
// the combine bit for bit), determinism across thread counts and runs, the
// planted backward faults caught on the shipped cases, and the load-time
// refusals. RapidCheck prints its seed; RC_PARAMS="seed=N" replays.
#include <catch2/catch.hpp>
#include <rapidcheck/catch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../kernels/backward_host.h"
#include "../kernels/moe_host.h"
#include "../reference/backward.h"
#include "case.h"
#include "error.h"
#include "runner.h"
#include "test_util.h"

using namespace moev;

namespace {


/// Runs the shipped case clean (it must pass) and with the fault; returns the
/// failing "slot/tensor" names of the faulty run.
std::vector<std::string> caught_by(const Case& c, Fault f) {
  REQUIRE(run_case(c, RunOptions{}).outcome == Outcome::PASSED);
  RunOptions o;
  o.faults.bits = uint64_t(f);
  const CaseReport r = run_case(c, o);
  CHECK(r.outcome != Outcome::PASSED);
  return failing(r);
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

/// A random local routing with exact data: T tokens, K distinct experts out
/// of E per token (experts with no rows when T*K < E), scores powers of two,
/// x, G and expert outputs small integers. Every fp32 product and sum below is
/// then exact, so the fast results are the exact values.
struct Routing {
  int64_t T = 0, D = 0, N = 0;
  int K = 1, E = 1;
  std::vector<int32_t> ids, perm, token_sorted, row_of;
  std::vector<float> topk_scores, score_sorted, x, G, Y;
};

rc::Gen<Routing> gen_routing() {
  return rc::gen::exec([] {
    Routing r;
    r.E = *rc::gen::inRange(1, 9);
    r.K = *rc::gen::inRange(1, std::min(r.E, 4) + 1);
    r.T = *rc::gen::weightedOneOf<int64_t>({{1, rc::gen::just<int64_t>(0)}, {4, rc::gen::inRange<int64_t>(1, 12)}});
    r.D = *rc::gen::inRange<int64_t>(1, 9);
    r.N = r.T * r.K;
    for (int64_t t = 0; t < r.T; ++t) {
      std::vector<int32_t> pool(static_cast<size_t>(r.E));
      for (int e = 0; e < r.E; ++e) pool[size_t(e)] = e;
      for (int k = 0; k < r.K; ++k) {
        const size_t j = size_t(*rc::gen::inRange<int64_t>(int64_t(k), r.E));
        std::swap(pool[size_t(k)], pool[j]);
        r.ids.push_back(pool[size_t(k)]);
        r.topk_scores.push_back(std::ldexp(1.f, -*rc::gen::inRange(0, 6)));
      }
    }
    auto ints = [](int64_t n) {
      std::vector<float> v;
      for (int64_t i = 0; i < n; ++i) v.push_back(float(*rc::gen::inRange(-4, 5)));
      return v;
    };
    r.x = ints(r.T * r.D);
    r.G = ints(r.T * r.D);
    r.Y = ints(r.N * r.D);
    return r;
  });
}

/// The local dispatch of the routing by the fast path (sort, gather).
void dispatch(Routing& r, std::vector<float>& routed) {
  r.perm.assign(size_t(r.N), 0);
  r.token_sorted.assign(size_t(r.N), 0);
  r.score_sorted.assign(size_t(r.N), 0.f);
  r.row_of.assign(size_t(r.N), 0);
  routed.assign(size_t(r.N * r.D), 0.f);
  expert_sort(ExecCtx{}, r.ids.data(), r.N, r.E, r.perm.data());
  dispatch_gather(ExecCtx{}, DType::fp32, k::ScoreApply::after_experts, r.x.data(), r.perm.data(), r.topk_scores.data(),
                  r.N, r.D, r.K, routed.data(), r.token_sorted.data(), r.score_sorted.data(), r.row_of.data());
}

}  // namespace

TEST_CASE("backward adjoint identities in fp64 on random routings", "[cpu][backward][property]") {
  rc::prop("<combine(Y), G> = <Y, s * G[token]> = sum s * grad_s, and <gather(x), g> = <x, scatter_add(g)>", [] {
    Routing r = *gen_routing();
    std::vector<int64_t> counts(static_cast<size_t>(r.E), 0);
    for (int32_t e : r.ids) ++counts[size_t(e)];
    RC_CLASSIFY(std::count(counts.begin(), counts.end(), 0) > 0, "an expert with no rows");
    RC_CLASSIFY(r.T == 0, "no tokens");
    std::vector<float> routed;
    dispatch(r, routed);
    // forward combine of Y: out[t] = sum over the token's rows of s * Y[row]
    CombineArgs a;
    a.routed_out = r.Y.data();
    a.score_sorted = r.score_sorted.data();
    a.row_of = r.row_of.data();
    a.T = r.T;
    a.D = r.D;
    a.K = r.K;
    std::vector<float> out(size_t(r.T * r.D), 0.f);
    combine_from_zeros(ExecCtx{}, a, out.data());
    // its backward: grad rows and the score gradient
    std::vector<float> grad_rows(size_t(r.N * r.D), NAN), grad_s(size_t(r.N), NAN);
    combine_backward(ExecCtx{}, DType::fp32, k::ScoreApply::after_experts, k::ScoreMultiply::fp32, r.G.data(),
                     r.Y.data(), r.score_sorted.data(), r.token_sorted.data(), r.row_of.data(), r.T, r.N, r.D, r.K,
                     grad_rows.data(), grad_s.data());
    const double lhs = dot(out, r.G);
    RC_ASSERT(lhs == dot(r.Y, grad_rows));
    RC_ASSERT(lhs == dot(r.topk_scores, grad_s));  // combine is linear in the scores too
    // dispatch: <gather(x), g> = <x, scatter_add(g)> with g = the grad rows
    std::vector<float> grad_x(size_t(r.T * r.D), NAN);
    dispatch_backward(ExecCtx{}, DType::fp32, k::ScoreApply::after_experts, k::ScoreMultiply::fp32,
                      k::Accumulate::per_add, grad_rows.data(), r.score_sorted.data(), r.row_of.data(), r.x.data(),
                      SharedGrad::none, nullptr, r.T, r.D, r.K, grad_x.data(), nullptr);
    RC_ASSERT(dot(routed, grad_rows) == dot(r.x, grad_x));
  });
}

TEST_CASE("score before the experts: the dispatch backward is the adjoint of the scaled gather", "[cpu][backward][property]") {
  rc::prop("<gather_s(x), g> = <x, grad_x> = sum s * grad_s", [] {
    Routing r = *gen_routing();
    std::vector<float> unscaled;
    dispatch(r, unscaled);
    std::vector<float> scaled(size_t(r.N * r.D), 0.f);
    std::vector<int32_t> tok(size_t(r.N)), row_of(size_t(r.N));
    std::vector<float> ss(size_t(r.N));
    dispatch_gather(ExecCtx{}, DType::fp32, k::ScoreApply::before_experts, r.x.data(), r.perm.data(),
                    r.topk_scores.data(), r.N, r.D, r.K, scaled.data(), tok.data(), ss.data(), row_of.data());
    std::vector<float> grad_x(size_t(r.T * r.D), NAN), grad_s(size_t(r.N), NAN);
    dispatch_backward(ExecCtx{}, DType::fp32, k::ScoreApply::before_experts, k::ScoreMultiply::fp32,
                      k::Accumulate::fp32_accumulate, r.Y.data(), r.score_sorted.data(), r.row_of.data(), r.x.data(),
                      SharedGrad::none, nullptr, r.T, r.D, r.K, grad_x.data(), grad_s.data());
    const double lhs = dot(scaled, r.Y);  // Y plays the gradient of the scaled rows
    RC_ASSERT(lhs == dot(r.x, grad_x));
    RC_ASSERT(lhs == dot(r.topk_scores, grad_s));
  });
}

TEST_CASE("EP backward: the gradient rows come back to dispatch unchanged on random EP configurations", "[cpu][backward][property]") {
  rc::prop("identity experts: grad_routed_input == grad_routed_output bitwise, every stage passes", [] {
    Case c;
    c.backward = Switch::on;
    c.ep = *rc::gen::inRange(1, 5);
    const int E_l = *rc::gen::inRange(1, 4);
    c.num_experts = c.ep * E_l;
    c.top_k = *rc::gen::inRange(1, std::min(c.num_experts, 3) + 1);
    c.hidden = *rc::gen::inRange<int64_t>(1, 9);
    c.seed = *rc::gen::inRange<uint64_t>(0, 100000);
    for (int r = 0; r < c.ep; ++r)
      c.tokens_per_rank.push_back(
          *rc::gen::weightedOneOf<int64_t>({{1, rc::gen::just<int64_t>(0)}, {3, rc::gen::inRange<int64_t>(1, 16)}}));
    c.align = *rc::gen::element<int64_t>(1, 1, 2, 8);
    c.empty_groups = *rc::gen::element(EmptyGroups::zero, EmptyGroups::pad);
    c.permute = *rc::gen::element(PermuteMode::auto_, PermuteMode::generic);
    c.router.force_load_balance = *rc::gen::element(Switch::off, Switch::on);
    c.equal_split.policy = *rc::gen::element(EqualSplitPolicy::off, EqualSplitPolicy::force);
    c.score_before_experts = *rc::gen::element(Switch::off, Switch::on);
    c.shared.kind = *rc::gen::element(SharedKind::none, SharedKind::identity);
    c.combine.accumulate = *rc::gen::element(k::Accumulate::per_add, k::Accumulate::fp32_accumulate);
    c.data = *rc::gen::element(DataMode::exact, DataMode::realistic);
    c.dtype = *rc::gen::element(DType::fp32, DType::bf16, DType::fp16);
    RC_CLASSIFY(std::count(c.tokens_per_rank.begin(), c.tokens_per_rank.end(), 0) > 0, "a rank without tokens");
    RunOptions o;
    o.keep = RunOptions::Keep::fast_board;
    const CaseReport r = run_case(c, o);
    for (const auto& ch : r.checks)
      if (token_path_fails(ch))
        RC_FAIL(c.summary() + ": " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) + " " +
                ch.note);
    for (int q = 0; q < c.ep; ++q) {
      const Tensor& back = r.fast.at("grad_routed_input", q);
      const Tensor& sent = r.fast.at("grad_routed_output", q);
      RC_ASSERT(back.shape == sent.shape);
      // evaluated before RC_ASSERT: its expression capture does not short-circuit ||
      const bool same_bytes = back.bytes() == 0 || std::memcmp(back.data(), sent.data(), back.bytes()) == 0;
      RC_ASSERT(same_bytes);
    }
  });
}

TEST_CASE("gradients are deterministic across thread counts and runs", "[cpu][backward]") {
  for (const char* name : {"bwd_local_bf16_k4", "bwd_ep4_zero_rank_pad", "bwd_score_before_experts"}) {
    Case c = case_named("backward.yaml", name);
    c.tokens = 600;  // rows enough for several threads
    c.tokens_per_rank.clear();
    std::vector<std::vector<uint8_t>> seen;
    for (int threads : {1, 8, 8}) {
      RunOptions o;
      o.threads = threads;
      o.keep = RunOptions::Keep::fast_board;
      const CaseReport r = run_case(c, o);
      REQUIRE(r.outcome == Outcome::PASSED);
      std::vector<uint8_t> bytes;
      for (int q = 0; q < c.ep; ++q)
        for (const char* t : {"grad_x", "grad_topk_scores"}) {
          const Tensor& g = r.fast.at(t, q);
          const auto* p = static_cast<const uint8_t*>(g.data());
          bytes.insert(bytes.end(), p, p + g.bytes());
        }
      seen.push_back(bytes);
    }
    CHECK(seen[0] == seen[1]);
    CHECK(seen[1] == seen[2]);
  }
}

TEST_CASE("fault bwd_unswapped_splits is caught at the gradient all-to-all", "[cpu][backward][fault]") {
  for (const char* name : {"bwd_ep2_align8", "bwd_ep4_zero_rank_pad"})
    CHECK(any_starts(caught_by(case_named("backward.yaml", name), Fault::bwd_unswapped_splits), "ep_combine_bwd/"));
}

TEST_CASE("fault bwd_unordered_scatter is caught by the ordered scatter-add check", "[cpu][backward][fault]") {
  for (const char* name : {"bwd_local_bf16_k4", "bwd_ep4_zero_rank_pad", "bwd_score_before_experts"})
    CHECK(any_starts(caught_by(case_named("backward.yaml", name), Fault::bwd_unordered_scatter), "dispatch_bwd/grad_x"));
}

TEST_CASE("fault bwd_score_grad_rounded is caught by the score gradient check", "[cpu][backward][fault]") {
  CHECK(any_starts(caught_by(case_named("backward.yaml", "bwd_bf16_realistic"), Fault::bwd_score_grad_rounded),
                   "combine_bwd/grad_topk_scores"));
  CHECK(any_starts(caught_by(case_named("backward.yaml", "bwd_score_before_ep2_act_multiply"),
                             Fault::bwd_score_grad_rounded),
                   "dispatch_bwd/grad_topk_scores"));
}

TEST_CASE("fault bwd_pad_grad_kept is caught by the padding backward check", "[cpu][backward][fault]") {
  for (const char* name : {"bwd_ep2_align8", "bwd_ep4_zero_rank_pad"})
    CHECK(any_starts(caught_by(case_named("backward.yaml", name), Fault::bwd_pad_grad_kept), "align_pad_bwd/grad_permuted"));
}

TEST_CASE("backward is refused with an output buffer aliasing x, and runs with sp > 1", "[cpu][backward]") {
  const std::string sp = "cases:\n  - name: a\n    sp: 2\n    backward: on\n";
  CHECK(load_cases_text(sp, "t.yaml", {}).size() == 1);
  const std::string alias =
      "cases:\n  - name: a\n    backward: on\n    shared_experts: {kind: identity, order: init_with_shared}\n"
      "    combine: {buffer: alias_x}\n";
  CHECK_THROWS_WITH(load_cases_text(alias, "t.yaml", {}), Catch::Contains("valid: combine.buffer: fresh with backward: on"));
}

// Every expert convention has a backward contract (docs/contract.md §13): SwiGLU
// cases under experts.rounding torchtitan or experts.compute_dtype bf16 run
// the autograd variants and pass, never NOT_SUPPORTED (issue 25 item 2 kept
// NOT_SUPPORTED for a convention without one).
TEST_CASE("SwiGLU cases run experts_bwd swiglu, and swiglu_autograd under the torchtitan and bf16 conventions",
          "[cpu][backward]") {
  Case c;
  c.backward = Switch::on;
  c.experts.kind = ExpertKind::swiglu;
  c.shared.kind = SharedKind::swiglu;
  auto ran = [](const CaseReport& r, const std::string& slot, const std::string& variant) {
    for (const auto& d : r.decisions)
      if (d.slot == slot && d.variant == variant && d.ran) return true;
    return false;
  };
  const CaseReport r = run_case(c, RunOptions{});
  CHECK(r.outcome == Outcome::PASSED);
  CHECK(ran(r, "experts_bwd", "swiglu"));
  CHECK(ran(r, "shared_experts_bwd", "shared_swiglu"));
  for (int which = 0; which < 3; ++which) {
    Case t = c;
    if (which != 1) t.experts.rounding = k::SiluRounding::rounded_to_act;
    if (which != 0) t.experts.compute_dtype = ComputeDtype::bf16;
    const CaseReport rt = run_case(t, RunOptions{});
    INFO("which " << which);
    CHECK(rt.outcome == Outcome::PASSED);
    CHECK(ran(rt, "experts_bwd", "swiglu_autograd"));
    CHECK(!ran(rt, "experts_bwd", "swiglu"));
    // the shared expert follows experts.rounding only (its compute dtype is act)
    CHECK(ran(rt, "shared_experts_bwd", which == 1 ? "shared_swiglu" : "shared_swiglu_autograd"));
  }
}

namespace {

/// The router forward in fp64 for given ids (docs/contract.md §1 steps 1, 5, 7, 8):
/// L = sum_{t,k} g[t,k] * topk_score(t, k) with logits = x wg^T. Written
/// here, apart from reference/router_bwd.cpp, so that its central
/// differences check the reference's chain rule.
struct RouterLoss {
  int64_t T = 0, D = 0;
  int E = 0, K = 0;
  bool sigmoid = false, norm = false;
  double scale = 1;
  std::vector<int32_t> ids;
  std::vector<double> g;
  std::vector<double> scores_of(const std::vector<double>& x, const std::vector<double>& wg) const {
    std::vector<double> s(size_t(T * E));
    for (int64_t t = 0; t < T; ++t) {
      double m = -1e300, sum = 0;
      for (int e = 0; e < E; ++e) {
        double l = 0;
        for (int64_t d = 0; d < D; ++d) l += x[size_t(t * D + d)] * wg[size_t(e * D + d)];
        s[size_t(t * E + e)] = l;
        m = std::max(m, l);
      }
      for (int e = 0; e < E; ++e) {
        double& v = s[size_t(t * E + e)];
        v = sigmoid ? 1 / (1 + std::exp(-v)) : std::exp(v - m);
        sum += v;
      }
      if (!sigmoid)
        for (int e = 0; e < E; ++e) s[size_t(t * E + e)] /= sum;
    }
    return s;
  }
  double operator()(const std::vector<double>& x, const std::vector<double>& wg) const {
    const std::vector<double> s = scores_of(x, wg);
    double L = 0;
    for (int64_t t = 0; t < T; ++t) {
      double den = 1e-20;
      for (int k = 0; k < K; ++k) den += s[size_t(t * E + ids[size_t(t * K + k)])];
      for (int k = 0; k < K; ++k) {
        const double p = s[size_t(t * E + ids[size_t(t * K + k)])];
        L += g[size_t(t * K + k)] * scale * (norm ? p / den : p);
      }
    }
    return L;
  }
};

}  // namespace

TEST_CASE("router backward reference: central differences of the router forward agree on random routers",
          "[cpu][backward][property]") {
  rc::prop("grad_wg and grad_x of ref::router_backward = dL/dwg and dL/dx", [] {
    RouterLoss f;
    f.E = *rc::gen::inRange(2, 10);
    f.K = *rc::gen::inRange(1, std::min(f.E, 4) + 1);
    f.T = *rc::gen::inRange(1, 5);
    f.D = *rc::gen::inRange(1, 6);
    f.sigmoid = *rc::gen::arbitrary<bool>();
    f.norm = *rc::gen::arbitrary<bool>();
    f.scale = *rc::gen::element(1.0, 2.5);
    const auto unit = [] { return *rc::gen::inRange(-1000, 1001) / 1000.0; };
    std::vector<double> x(size_t(f.T * f.D)), wg(size_t(f.E * f.D));
    for (double& v : x) v = unit();
    for (double& v : wg) v = unit();
    for (int64_t t = 0; t < f.T; ++t) {
      std::vector<int32_t> order(size_t(f.E));
      for (int i = 0; i < f.E; ++i) order[size_t(i)] = i;
      for (int k = 0; k < f.K; ++k) {  // K distinct experts: the first K of a random permutation
        std::swap(order[size_t(k)], order[size_t(*rc::gen::inRange(k, f.E))]);
        f.ids.push_back(order[size_t(k)]);
      }
      for (int k = 0; k < f.K; ++k) f.g.push_back(unit());
    }
    // the reference on the fp32 values of the same inputs (x and wg are
    // not fp32-exact: the differences below allow for it)
    const std::vector<double> s = f.scores_of(x, wg);
    const std::vector<float> sf(s.begin(), s.end()), gf(f.g.begin(), f.g.end()), xf(x.begin(), x.end()),
        wf(wg.begin(), wg.end());
    ref::RouterSpec spec;
    spec.E = f.E;
    spec.K = f.K;
    spec.score = f.sigmoid ? ref::Score::sigmoid : ref::Score::softmax;
    spec.route_norm = f.norm;
    spec.route_scale = float(f.scale);
    const ref::RouterGrad r = ref::router_backward(spec, ref::GateDtype::fp32, ref::Act::fp32, sf, f.ids, gf, xf, wf,
                                                   f.T, f.D, 0.0, false);
    const double h = 1e-6;
    const auto diff = [&](std::vector<double>& v, size_t i) {
      const double keep = v[i];
      v[i] = keep + h;
      const double up = f(x, wg);
      v[i] = keep - h;
      const double down = f(x, wg);
      v[i] = keep;
      return (up - down) / (2 * h);
    };
    for (size_t i = 0; i < wg.size(); ++i) {
      const double want = diff(wg, i);
      RC_ASSERT(std::fabs(r.grad_wg[i] - want) <= 1e-4 * (1 + std::fabs(want)));
    }
    for (size_t i = 0; i < x.size(); ++i) {
      const double want = diff(x, i);
      RC_ASSERT(std::fabs(r.grad_x[i] - want) <= 1e-4 * (1 + std::fabs(want)));
    }
  });
}

namespace {

/// PyTorch autograd's router backward on held (act) tensors, as torchtitan
/// runs it on the CPU: every op's result rounded to act, sums and the
/// elementwise backward formulas in fp32. The norm as torchtitan writes it,
/// top / den (the gradient for den: -g * ((top / den) / den), summed over
/// the K), or as top * (1 / den) (`reciprocal`: for r = 1 / den, the sum of
/// g * top, then -that * (r * r)).
struct AutogradHeld {
  ref::Act act;
  bool reciprocal = false;
  float h(double v) const { return ref::round_act(act, float(v)); }
  void scores_grad(const float* s, const int32_t* ids, const float* g, int E, int K, bool norm, float scale,
                   float* gs) const {
    std::fill(gs, gs + E, 0.f);
    std::vector<float> gp(size_t(K), 0.f);
    for (int k = 0; k < K; ++k) gp[size_t(k)] = h(float(g[k] * scale));
    if (!norm) {
      for (int k = 0; k < K; ++k) gs[ids[k]] = gp[size_t(k)];
      return;
    }
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += s[ids[k]];
    const float den = h(h(sum) + 1e-20f);
    if (reciprocal) {
      const float r = h(1.f / den);
      float grad_r = 0.f;
      for (int k = 0; k < K; ++k) grad_r += gp[size_t(k)] * s[ids[k]];
      const float grad_den = h(-h(grad_r) * h(r * r));
      for (int k = 0; k < K; ++k) gs[ids[k]] = h(h(gp[size_t(k)] * r) + grad_den);
      return;
    }
    float through = 0.f;
    for (int k = 0; k < K; ++k) through += h(-gp[size_t(k)] * h(h(s[ids[k]] / den) / den));
    through = h(through);
    for (int k = 0; k < K; ++k) gs[ids[k]] = h(h(gp[size_t(k)] / den) + through);
  }
};

}  // namespace

TEST_CASE("router backward of held scores: autograd's chain of act roundings lies within the half-widths",
          "[cpu][backward][property]") {
  // No false alarm on torchtitan's CPU router backward (router.score_dtype
  // act): its bf16/fp16 roundings after every op, against the reference's
  // half-widths, on random routers including tiny (subnormal in fp16)
  // gradients and route_scale past fp16's range.
  rc::prop("|autograd - ref| <= half-width for grad_scores, grad_logits, grad_wg, grad_x_router", [] {
    const ref::Act act = *rc::gen::element(ref::Act::bf16, ref::Act::fp16);
    const AutogradHeld ag{act, *rc::gen::arbitrary<bool>()};
    ref::RouterSpec spec;
    spec.E = *rc::gen::inRange(2, 12);
    spec.K = *rc::gen::inRange(1, std::min(spec.E, 6) + 1);
    spec.score = *rc::gen::arbitrary<bool>() ? ref::Score::sigmoid : ref::Score::softmax;
    spec.route_norm = *rc::gen::arbitrary<bool>();
    spec.route_scale = *rc::gen::element(0.001f, 1.f, 2.5f, 76.8f, 1e6f);
    spec.held = act;
    const bool act_gate = *rc::gen::arbitrary<bool>();
    // fp32 logits: autograd's sigmoid or softmax backward may read the fp32
    // scores it saved before the cast to act (held ones: s)
    const bool saved32 = !act_gate && *rc::gen::arbitrary<bool>();
    const int64_t T = *rc::gen::inRange(1, 6), D = *rc::gen::inRange(1, 9);
    const int E = spec.E, K = spec.K;
    const auto unit = [&](double span) { return ag.h(span * (*rc::gen::inRange(-1000, 1001)) / 1000.0); };
    std::vector<float> x(size_t(T * D)), wg(size_t(E * D)), s(size_t(T * E)), s32(s.size()), g(size_t(T * K));
    std::vector<int32_t> ids;
    for (float& v : x) v = unit(2);
    for (float& v : wg) v = unit(2);
    const double g_span = *rc::gen::element(4.0, 4e-3, 4e-5);  // down to fp16's subnormals
    for (float& v : g) v = unit(g_span);
    for (int64_t t = 0; t < T; ++t) {
      double sum = 0;
      std::vector<double> l(static_cast<size_t>(E));
      for (double& v : l) v = 16.0 * (*rc::gen::inRange(-1000, 1001)) / 1000.0;
      const double m = *std::max_element(l.begin(), l.end());
      for (int e = 0; e < E; ++e) sum += std::exp(l[size_t(e)] - m);
      for (int e = 0; e < E; ++e) {
        s32[size_t(t * E + e)] = float(spec.score == ref::Score::sigmoid ? 1 / (1 + std::exp(-l[size_t(e)]))
                                                                          : std::exp(l[size_t(e)] - m) / sum);
        s[size_t(t * E + e)] = ag.h(s32[size_t(t * E + e)]);
      }
      std::vector<int32_t> order(static_cast<size_t>(E));  // K distinct experts, any of them (force_load_balance too)
      for (int i = 0; i < E; ++i) order[size_t(i)] = i;
      for (int k = 0; k < K; ++k) {
        std::swap(order[size_t(k)], order[size_t(*rc::gen::inRange(k, E))]);
        ids.push_back(order[size_t(k)]);
      }
    }
    const ref::RouterGrad r = ref::router_backward(spec, act_gate ? ref::GateDtype::act : ref::GateDtype::fp32, act,
                                                   s, ids, g, x, wg, T, D, 0.0, true);
    // autograd: the score steps, then sigmoid's or softmax's backward in
    // fp32 (rounded to act where the logits are an act tensor), then the
    // gate's GEMMs with fp32 accumulation, each result rounded once
    std::vector<float> gs(size_t(T * E)), gl(size_t(T * E)), gw(size_t(E * D)), gx(size_t(T * D));
    for (int64_t t = 0; t < T; ++t) {
      float* gst = &gs[size_t(t * E)];
      ag.scores_grad(&s[size_t(t * E)], &ids[size_t(t * K)], &g[size_t(t * K)], E, K, spec.route_norm,
                     spec.route_scale, gst);
      const float* st = &(saved32 ? s32 : s)[size_t(t * E)];
      float P = 0.f;
      for (int e = 0; e < E; ++e) P += gst[e] * st[e];
      for (int e = 0; e < E; ++e) {
        const float v = spec.score == ref::Score::sigmoid ? gst[e] * (1.f - st[e]) * st[e] : st[e] * (gst[e] - P);
        gl[size_t(t * E + e)] = act_gate ? ag.h(v) : v;
      }
    }
    for (int e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t t = 0; t < T; ++t) acc += gl[size_t(t * E + e)] * x[size_t(t * D + d)];
        gw[size_t(e * D + d)] = ag.h(acc);
      }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int e = 0; e < E; ++e) acc += gl[size_t(t * E + e)] * wg[size_t(e * D + d)];
        gx[size_t(t * D + d)] = ag.h(acc);
      }
    int judged = 0;
    const auto within = [&](const std::vector<float>& got, const ref::Vec& want, const ref::Vec& half,
                            const char* what) {
      for (size_t i = 0; i < got.size(); ++i) {
        if (std::isinf(half[i])) continue;  // not judged (an overflow within reach)
        ++judged;
        const bool ok = got[i] == want[i] || std::fabs(double(got[i]) - double(want[i])) <= double(half[i]);
        if (!ok) {
          char msg[200];
          std::snprintf(msg, sizeof msg, "%s[%zu] (%s): autograd %a vs ref %a, half-width %a", what, i,
                        act == ref::Act::bf16 ? "bf16" : "fp16", double(got[i]), double(want[i]), double(half[i]));
          RC_FAIL(msg);
        }
      }
    };
    within(gs, r.grad_scores, r.half_scores, "grad_scores");
    // fp32 logits (the fp32 gate): autograd's are not rounded to act
    within(gl, r.grad_logits, r.half_logits, "grad_logits");
    within(gw, r.grad_wg, r.half_wg, "grad_wg");
    within(gx, r.grad_x, r.half_x, "grad_x_router");
    RC_TAG(judged > 0 ? "judged" : "nothing judged (overflow)");
  });
}
