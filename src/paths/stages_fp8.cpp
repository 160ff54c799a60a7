// Stage variants of FP8 dispatch (docs/contract.md §16): the per-token block
// quantisation of x before the dispatch (slot fp8_quant), the gather of the
// e4m3 rows and their scales (slot dispatch), and the dequantisation of the
// rows the experts take (slot fp8_dequant). The EP moves of the e4m3 rows and
// scales are the FP8 twins in stages_ep.cpp. Every variant here is listed
// only for FP8 cases (Stage::listed).
#include <cstring>

#include "../kernels/fp8_host.h"
#include "../kernels/moe_host.h"
#include "../reference/fp8.h"
#include "stages.h"

namespace moev {
namespace {

Decision fp8_only(const Case& c) { return {c.fp8(), "dispatch.dtype: act"}; }
bool listed_fp8(const Case& c) { return c.fp8(); }

Fp8Params fp8_params(const Case& c) {
  return {c.dispatch.block, c.dispatch.scale, c.dispatch.quotient, float(c.dispatch.amax_clamp)};
}

ref::Fp8Spec ref_fp8_spec(const Case& c) {
  ref::Fp8Spec s;
  s.block = c.dispatch.block;
  s.ue8m0 = c.dispatch.scale == k::Fp8Scale::ue8m0;
  s.amax_ratio = c.dispatch.quotient == k::Fp8Quotient::amax_ratio;
  s.divide = c.dispatch.quotient == k::Fp8Quotient::divide;
  s.clamp = float(c.dispatch.amax_clamp);
  return s;
}

Stage fp8_quant() {
  Stage s;
  s.slot = "fp8_quant";
  s.variant = "block_scales";
  s.summary = "per token, per block: amax, clamp, scale (UE8M0: up to a power of two), e4m3 RNE (docs/contract.md §16)";
  s.applies = fp8_only;
  s.listed = listed_fp8;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x"});
  s.outputs = {{"x_q", CompareClass::exact, Coords::token_col, promise_always},
               {"x_scale", CompareClass::exact, Coords::token_col, promise_always}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& x = ctx.input("x");
    const int64_t T = x.shape[0], D = c.hidden;
    Tensor& q = ctx.output("x_q", ElemType::e4m3, {T, D});
    Tensor& sc = ctx.output("x_scale", ElemType::f32, {T, D / c.dispatch.block});
    fp8_quantise(ctx.exec, c.dtype, x.data(), T, D, fp8_params(c), q.data(), sc.as<float>());
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const Tensor& x = r.in.at("x", int(q));
      const int64_t T = x.shape[0], D = c.hidden;
      ref::Fp8Rows f = ref::fp8_quantise(ref_fp8_spec(c), to_floats(x), T, D);
      r.out.ranks[q]["x_q"] = rows_tensor(std::move(f.q), ElemType::e4m3, D);
      r.out.ranks[q]["x_scale"] = from_floats(f.scale, ElemType::f32, {T, D / c.dispatch.block});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

Stage fp8_gather_stage() {
  Stage s;
  s.slot = "dispatch";
  s.variant = "local_sort_gather_fp8";
  s.summary = "stable counting sort by (expert, assignment), gather the e4m3 rows and their scale rows (docs/contract.md §2, §16)";
  s.applies = fp8_only;
  s.listed = listed_fp8;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x_q", "x_scale", "ids", "topk_scores", "counts"});
  s.outputs = {{"routed_input_q", CompareClass::exact, Coords::dispatch_row, promise_always},
               {"routed_input_scale", CompareClass::exact, Coords::dispatch_row, promise_always},
               {"token_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"score_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"row_of", CompareClass::exact, Coords::token_k, nullptr}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& q = ctx.input("x_q");
    const Tensor& sc = ctx.input("x_scale");
    const int64_t T = q.shape[0], N = T * c.top_k, nb = sc.shape[1];
    Tensor perm = Tensor::alloc(ElemType::i32, {N});
    expert_sort(ctx.exec, ctx.input("ids").as<int32_t>(), N, c.num_experts, perm.as<int32_t>());
    Tensor& rq = ctx.output("routed_input_q", ElemType::e4m3, {N, c.hidden});
    Tensor& rs = ctx.output("routed_input_scale", ElemType::f32, {N, nb});
    Tensor& tok = ctx.output("token_sorted", ElemType::i32, {N});
    Tensor& ss = ctx.output("score_sorted", ElemType::f32, {N});
    Tensor& row_of = ctx.output("row_of", ElemType::i32, {T, c.top_k});
    fp8_gather(ctx.exec, perm.as<int32_t>(), N, c.top_k, ctx.input("topk_scores").as<float>(), q.data(),
               sc.as<float>(), c.hidden, nb, rq.data(), rs.as<float>(), tok.as<int32_t>(), ss.as<float>(),
               row_of.as<int32_t>());
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const RankBoard& in = r.in.ranks[q];
      const Tensor& xq = in.at("x_q");
      const Tensor& xs = in.at("x_scale");
      const int64_t T = xq.shape[0], N = T * c.top_k;
      const ref::Ids ids = ref_ids(in.at("ids"));
      const ref::Vec scores = to_floats(in.at("topk_scores"));
      // The rows as bytes, moved as they are (no score applied: docs/contract.md §16).
      ref::LocalDispatch dq = ref::local_dispatch(ref::Act::fp32, ref::ScoreApply::after_experts, rows_of(xq), ids,
                                                  scores, T, c.hidden, c.top_k, c.num_experts);
      ref::LocalDispatch ds = ref::local_dispatch(ref::Act::fp32, ref::ScoreApply::after_experts, rows_of(xs), ids,
                                                  scores, T, xs.shape[1], c.top_k, c.num_experts);
      RankBoard& out = r.out.ranks[q];
      out["routed_input_q"] = rows_tensor(std::move(dq.routed), ElemType::e4m3, c.hidden);
      out["routed_input_scale"] = rows_tensor(std::move(ds.routed), ElemType::f32, xs.shape[1]);
      out["token_sorted"] = ids_tensor(dq.token_sorted, ElemType::i32, {N});
      out["score_sorted"] = from_floats(dq.score_sorted, ElemType::f32, {N});
      out["row_of"] = ids_tensor(dq.row_of, ElemType::i32, {T, c.top_k});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

Stage fp8_dequant() {
  Stage s;
  s.slot = "fp8_dequant";
  s.variant = "block_scales";
  s.summary = "expert_input = round_act(float(q) * s) over the padded groups (docs/contract.md §16)";
  s.applies = fp8_only;
  s.listed = listed_fp8;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"expert_input_q", "expert_input_scale"});
  s.outputs = {{"expert_input", CompareClass::exact, Coords::padded_row, nullptr}};  // a rank may hold only padding
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& q = ctx.input("expert_input_q");
    Tensor& out = ctx.output("expert_input", act_elem(c.dtype), {q.shape[0], c.hidden});
    fp8_dequantise(ctx.exec, c.dtype, q.data(), ctx.input("expert_input_scale").as<float>(), q.shape[0], c.hidden,
                   c.dispatch.block, out.data());
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const Tensor& xq = r.in.at("expert_input_q", int(q));
      r.out.ranks[q]["expert_input"] =
          from_floats(ref::fp8_dequantise(ref_act(c.dtype), rows_of(xq), rows_of(r.in.at("expert_input_scale", int(q))),
                                          c.hidden, c.dispatch.block),
                      act_elem(c.dtype), {xq.shape[0], c.hidden});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

}  // namespace

Tensor fp8_rows_dequantised(const Case& c, const RankBoard& b, const std::string& rows) {
  const Tensor& q = b.at(rows + "_q");
  return from_floats(ref::fp8_dequantise(ref_act(c.dtype), rows_of(q), rows_of(b.at(rows + "_scale")), c.hidden,
                                         c.dispatch.block),
                     act_elem(c.dtype), {q.shape[0], c.hidden});
}

Tensor fp8_error_bound(const Case& c, const RankBoard& b) {
  const Tensor& x = b.at("x");
  const int64_t T = x.shape[0], D = c.hidden;
  const ref::Vec ex = ref::fp8_input_error(ref_fp8_spec(c), to_floats(x), T, D);
  const ref::Ids tok = ref_ids(b.at("token_sorted"));
  ref::Vec er(tok.size() * size_t(D));
  // A capacity filler row (token -1, docs/contract.md §11) is a zero row in
  // both chains: no error (er starts at zero).
  for (size_t i = 0; i < tok.size(); ++i)
    if (tok[i] >= 0)
      std::memcpy(er.data() + i * size_t(D), ex.data() + size_t(tok[i]) * size_t(D), size_t(D) * sizeof(float));
  const bool swiglu = c.experts.kind == ExpertKind::swiglu;
  const ref::Vec dy = ref::fp8_expert_error(swiglu, to_floats(b.at("routed_input")), er, ref_counts(b.at("counts")), D,
                                            c.ffn, swiglu ? to_floats(b.at("w1")) : ref::Vec{},
                                            swiglu ? to_floats(b.at("w3")) : ref::Vec{},
                                            swiglu ? to_floats(b.at("w2")) : ref::Vec{});
  return from_floats(ref::fp8_combine_error(dy, tok, to_floats(b.at("score_sorted")), T, D), ElemType::f32, {T, D});
}

void register_fp8_stages(std::vector<Stage>& reg) {
  reg.push_back(fp8_quant());
  reg.push_back(fp8_gather_stage());
  reg.push_back(fp8_dequant());
}

}  // namespace moev
