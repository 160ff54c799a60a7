#include "registry.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "../kernels/device.h"
#include "comm.h"
#include "error.h"
#include "stages.h"

namespace moev {

// FastCtx::output and exchange_rows (declared in core/stage.h) are here:
// they reach the device mirror and the communicator.
Tensor& FastCtx::output(const std::string& name, ElemType t, std::vector<int64_t> shape) {
  Tensor& r = out[name];
  if (buffers == OutputBuffers::reuse && r.storage && r.type == t && r.shape == shape && r.offset_bytes == 0 &&
      r.storage.use_count() == 1)
    return r;
  r = Tensor::alloc(t, std::move(shape), 0xFF);
  if (exec.mirror) exec.mirror->hold_output(r.storage->data(), r.storage->size(), r.storage, 0xFF);  // poisoned there too
  return r;
}

void FastCtx::exchange_rows(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                            const std::vector<int64_t>& recv_rows, const char* what) {
  // The tensor's own row width: activation rows, e4m3 rows or block-scale rows (docs/contract.md §16).
  const size_t row_bytes = size_t(in.shape.size() > 1 ? in.shape[1] : c.hidden) * elem_bytes(in.type);
  if (!exec.mirror || !comm->device_buffers()) {
    comm->alltoallv(in.data(), in.shape[0], send_rows, out.data(), out.shape[0], recv_rows, row_bytes, what);
    return;
  }
  Mirror& m = *exec.mirror;
  Mirror::Scope scope{m};
  const void* src = m.in(in.data(), in.bytes());
  void* dst = m.out(out.data(), out.bytes());
  comm->alltoallv_device(src, in.shape[0], send_rows, dst, out.shape[0], recv_rows, row_bytes, what);
  m.wrote(out.data(), out.bytes());
}

// Tail SP padding (docs/contract.md §10) adds zero rows routed to expert 0, and
// pad_to_capacity (§11) zero filler rows: a rank may then move nothing but
// such rows, and all-zero data is legitimate there.
bool promise_always(const Case& c, const RankBoard&) {
  return !(c.sp > 1 && c.sp_padding == SpPadding::tail) &&
         !(c.capacity.factor > 0 && c.capacity.pad_to_capacity == Switch::on);
}
bool promise_realistic(const Case& c, const RankBoard&) { return c.data == DataMode::realistic; }
bool promise_combined(const Case& c, const RankBoard&) {
  return c.data == DataMode::realistic || c.experts.kind == ExpertKind::identity;
}
bool promise_expert_rows(const Case& c, const RankBoard& b) {
  auto it = b.find("expert_counts_real");
  int64_t rows = 0;
  if (it != b.end())
    for (int64_t v : to_ints(it->second)) rows += v;
  if (rows == 0 || !(c.data == DataMode::realistic || c.experts.kind == ExpertKind::identity)) return false;
  // Rows that are all zero (scores applied before the experts can underflow
  // in fp16) legitimately give zero outputs: no data is promised then.
  auto in = b.find("expert_input");
  return in == b.end() || any_nonzero(in->second);
}

bool has_device_form(const Stage& s) {
  return std::find(s.backends.begin(), s.backends.end(), Backend::cuda) != s.backends.end();
}

std::function<std::vector<std::string>(const Case&)> fixed_inputs(std::vector<std::string> names) {
  return [names](const Case&) { return names; };
}

Stage make_stage(const std::string& slot, const std::string& variant, const std::string& summary,
                 std::function<Decision(const Case&)> applies, std::vector<std::string> inputs,
                 std::vector<OutputSpec> outputs, std::function<void(FastCtx&)> fast, std::function<void(RefCtx&)> ref) {
  Stage s;
  s.slot = slot;
  s.variant = variant;
  s.summary = summary;
  s.applies = std::move(applies);
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs(std::move(inputs));
  s.outputs = std::move(outputs);
  s.fast = std::move(fast);
  s.ref = std::move(ref);
  return s;
}

const std::vector<std::string>& slot_order() {
  static const std::vector<std::string> s = {
      "sp_shard", "router_logits", "routing", "sp_pad_route", "fp8_quant", "dispatch", "capacity", "ep_dispatch", "ep_permute",
      "align_pad", "fp8_dequant", "experts",
      "align_unpad", "ep_unpermute", "ep_combine", "shared_experts", "combine", "sp_gather",
      // backward (docs/contract.md §13, src/paths/stages_backward.cpp): the adjoints in reverse order
      "sp_gather_bwd", "combine_bwd", "shared_experts_bwd", "ep_combine_bwd", "ep_unpermute_bwd", "align_unpad_bwd",
      "experts_bwd", "align_pad_bwd", "ep_permute_bwd", "ep_dispatch_bwd", "dispatch_bwd", "router_bwd", "sp_shard_bwd"};
  return s;
}

const std::string& magnitude_slot(const Case& c) {
  // routed_input, counts, token_sorted, score_sorted: after capacity drops rows
  static const std::string dispatch = "dispatch", capacity = "capacity";
  return c.capacity.factor > 0 ? capacity : dispatch;
}

const std::string& fp8_first_slot() {
  static const std::string s = "fp8_quant";
  return s;
}

const std::set<std::string>& pipeline_results() {
  static const std::set<std::string> s = {"out", "out_magnitude", "sp_out", "grad_x", "grad_x_scale",
                                          "grad_topk_scores", "grad_topk_scores_scale"};
  return s;
}

const std::vector<Stage>& registry() {
  static const std::vector<Stage> reg = [] {
    std::vector<Stage> r;
    register_local_stages(r);
    register_ep_stages(r);
    register_sp_stages(r);
    register_capacity_stages(r);
    register_backward_stages(r);
    register_fp8_stages(r);
    return r;
  }();
  return reg;
}

CoordFn coords_for(Coords kind, const Tensor& t, const RankBoard& b, int rank, int ranks) {
  const std::string rk = ranks > 1 ? "rank " + std::to_string(rank) + ", " : "";
  const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
  switch (kind) {
    case Coords::flat: return [rk](int64_t i) { return "(" + rk + "index " + std::to_string(i) + ")"; };
    case Coords::token_col:
      return [=](int64_t i) { return "(" + rk + "token " + std::to_string(i / cols) + ", col " + std::to_string(i % cols) + ")"; };
    case Coords::token_expert:
      return [=](int64_t i) { return "(" + rk + "token " + std::to_string(i / cols) + ", expert " + std::to_string(i % cols) + ")"; };
    case Coords::token_k:
      return [=](int64_t i) { return "(" + rk + "token " + std::to_string(i / cols) + ", k " + std::to_string(i % cols) + ")"; };
    case Coords::expert: return [rk](int64_t i) { return "(" + rk + "expert " + std::to_string(i) + ")"; };
    case Coords::expert_col:
      return [=](int64_t i) { return "(" + rk + "expert " + std::to_string(i / cols) + ", col " + std::to_string(i % cols) + ")"; };
    case Coords::dispatch_row:
    case Coords::rank_major_row:
    case Coords::expert_row:
    case Coords::padded_row: {
      const char* cname = kind == Coords::dispatch_row ? "counts"
                          : kind == Coords::rank_major_row ? "recv_counts"
                          : kind == Coords::expert_row ? "expert_counts_real" : "expert_counts";
      auto ci = b.find(cname);
      if (ci == b.end()) return coords_for(Coords::flat, t, b, rank, ranks);
      const std::vector<int64_t> counts = to_ints(ci->second);
      auto ti = b.find("token_sorted");
      const std::vector<int64_t> tok = kind == Coords::dispatch_row && ti != b.end() ? to_ints(ti->second)
                                                                                      : std::vector<int64_t>{};
      const int64_t G = int64_t(counts.size());
      const int64_t E_l = kind == Coords::dispatch_row ? 0 : kind == Coords::rank_major_row ? G / ranks : G;
      return [=](int64_t i) {
        const int64_t row = i / cols;
        int64_t g = 0, start = 0;
        while (g < G && start + counts[size_t(g)] <= row) start += counts[size_t(g++)];
        std::string s = "(" + rk;
        if (kind == Coords::rank_major_row)
          s += "from rank " + std::to_string(g / E_l) + ", expert " + std::to_string(rank * E_l + g % E_l);
        else if (kind == Coords::dispatch_row)
          s += "expert " + std::to_string(g);
        else
          s += "expert " + std::to_string(rank * E_l + g);
        s += g < G ? ", slot " + std::to_string(row - start) : ", tail row " + std::to_string(row - start);
        if (size_t(row) < tok.size()) s += ", token " + std::to_string(tok[size_t(row)]);
        return s + ", col " + std::to_string(i % cols) + ")";
      };
    }
  }
  return nullptr;
}

// Routing check (docs/contract.md §1, last paragraph). Scores come from exp, so the
// fast and reference scores may differ in the last bits, and a top-k choice
// between values that close may legitimately differ: a near-tie. Judging ids
// position by position (or against the reference's own selection) raises
// false alarms there, so the selection is judged on the fast path's own
// values instead:
//   scores       fast vs reference, scores tolerance;
//   ids          fast vs the reference selection (bias, group limit, top-k,
//                lower id on exact ties) applied to the fast scores: exact,
//                order included. Together with the scores check this accepts
//                exactly the selections of some scores within tolerance of
//                the reference's, and still catches a wrong tie rule (exact
//                data ties exactly on both sides) or a wrong group score;
//   topk_scores  fast vs the reference's scores gathered at the fast ids,
//                normalised and scaled, scores tolerance (relative, so it
//                scales with route_scale);
//   under router.score_dtype act (docs/contract.md §14) the scores and
//                topk_scores are act values: class rounding, scores against
//                the act rounding of the reference's fp32 ones (half-width:
//                the scores tolerance), topk_scores against the chain run on
//                the fast scores (half-width: other fp32 summation orders);
//   counts       fast vs the histogram of the fast ids: exact.
// Tokens whose fast ids differ from the reference's own selection are the
// near-ties: reported, and the end-to-end chain continues from the fast
// routing.
void check_routing(CheckCtx& ctx) {
  const Case& c = ctx.c;
  const ref::RouterSpec spec = ref_router_spec(c);
  const int ranks = int(ctx.fast.ranks.size());
  int64_t near_total = 0;
  for (int q = 0; q < ranks; ++q) {
    const RankBoard& fb = ctx.fast.ranks[size_t(q)];
    const Tensor& fids = ctx.fast.at("ids", q);
    const Tensor& rids = ctx.ref.at("ids", q);
    const int64_t T = fids.shape[0], K = c.top_k, E = c.num_experts;
    const ref::Vec fast_scores = to_floats(ctx.fast.at("scores", q));
    const ref::Vec ref_scores = to_floats(ctx.ref.at("scores", q));
    const ref::Ids fast_ids = ref_ids(fids);
    ref::Vec choice_on_fast;
    ref::Ids ids_on_fast;
    ref::select_experts(spec, fast_scores, to_floats(ctx.fast.at("bias", q)), T, choice_on_fast, ids_on_fast);
    const bool held = spec.held != ref::Act::fp32;
    // Held scores are act values: topk_scores follow from the fast ones
    // exactly but for the fp32 summation order (halfwidth below).
    const ref::Vec topk_expected = ref::topk_scores_for(spec, held ? fast_scores : ref_scores, fast_ids, T);
    Tensor scores_hw, topk_hw;
    if (held) {
      const Tolerance st = tolerance_for(c, CompareClass::scores);
      scores_hw = from_floats(ref::router_scores_halfwidth(spec, to_floats(ctx.fast.at("logits", q)), T, st.rtol, st.atol),
                              ElemType::f32, {T, E});
      topk_hw = from_floats(ref::topk_scores_halfwidth(spec, fast_scores, fast_ids, T), ElemType::f32, {T, K});
    }
    const CompareClass score_cls = held ? CompareClass::rounding : CompareClass::scores;
    std::vector<int64_t> hist(size_t(E), 0);
    for (int32_t e : fast_ids)
      if (e >= 0 && e < E) ++hist[size_t(e)];
    int64_t near = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (fids.as<int32_t>()[t * K + k] != rids.as<int32_t>()[t * K + k]) {
          ++near;
          break;
        }
    near_total += near;
    auto add = [&](const std::string& name, CompareClass cls, Coords co, const Tensor& f, const Tensor& r,
                   const std::string& against, const std::string& note, const Tensor* halfwidth = nullptr) {
      Check ch;
      ch.slot = "routing";
      ch.tensor = ranks > 1 ? name + "@" + std::to_string(q) : name;
      ch.cls = cls;
      ch.tol = tolerance_for(c, cls);
      ch.against = against;
      ch.diff = diff_tensors(f, r, cls, ch.tol, coords_for(co, f, fb, q, ranks), nullptr, halfwidth);
      ch.outcome = ch.diff.mismatches ? Outcome::INCORRECT : Outcome::PASSED;
      ch.note = ch.diff.structural.empty() ? note : ch.diff.structural;
      ctx.checks.push_back(ch);
    };
    const std::string near_note =
        near ? std::to_string(near) + " near-tie token(s): the fast ids differ from the reference's own selection "
                                      "where the scores agree within tolerance; reported, not failed"
             : "";
    add("scores", score_cls, Coords::token_expert, ctx.fast.at("scores", q), ctx.ref.at("scores", q), "reference", "",
        held ? &scores_hw : nullptr);
    add("ids", CompareClass::exact, Coords::token_k, fids, ids_tensor(ids_on_fast, ElemType::i32, {T, K}),
        "ref on fast scores", near_note);
    if (ctx.checks.back().outcome != Outcome::PASSED)  // then the differences are not near-ties
      ctx.checks.back().note = "the fast ids are not the selection the contract makes from the fast scores";
    add("topk_scores", score_cls, Coords::token_k, ctx.fast.at("topk_scores", q),
        from_floats(topk_expected, ElemType::f32, {T, K}), held ? "ref on fast scores" : "ref at fast ids", "",
        held ? &topk_hw : nullptr);
    add("counts", CompareClass::exact, Coords::expert, ctx.fast.at("counts", q), from_ints(hist, ElemType::i64, {E}),
        "histogram of ids", "");
  }
  if (near_total)
    ctx.adopt_fast_reason = std::to_string(near_total) + " routing near-tie token(s): the end-to-end reference "
                            "continues from the fast routing";
}

}  // namespace moev
