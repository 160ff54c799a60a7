// Stage variants of sequence parallelism (docs/contract.md §10, docs/frameworks.md §10.2-§10.3).
//
// Model: SP ranks are a separate axis from the EP ranks (docs/frameworks.md §10: the
// MoE region is sequence-parallel over the TP axis). Each EP rank's board
// holds its T = B*L tokens; the slot sp_shard replaces x by the S SP ranks'
// local tokens stacked SP rank after SP rank (kernels/sp_host.h, "SP layout"),
// so that routing, dispatch, experts and combine run on exactly the rows the
// SP ranks hold, each token once. A token's combined row depends only on its
// own routing and expert rows (docs/contract.md §2, §3), so this equals S separate
// dispatches. sp_pad_route gives tail pad rows expert 0 with score 0, and
// sp_gather writes the combine output to the global nlt*S rows and keeps the
// first T (docs/contract.md §10). Every slot applies only when sp > 1; with sp = 1 the
// pipeline is untouched, which is what the SP invariance check compares with.
#include <algorithm>
#include <cstring>

#include "../kernels/ep_host.h"
#include "../kernels/sp_host.h"
#include "../reference/reference.h"
#include "stages.h"

namespace moev {

ref::SpPadding ref_padding(const Case& c) {
  return c.sp_padding == SpPadding::tail ? ref::SpPadding::tail : ref::SpPadding::virtual_;
}

namespace {

Decision sp_on(const Case& c) {
  if (c.sp > 1) return {};
  return {false, "sp = 1"};
}

Decision sp_tail(const Case& c) {
  if (c.sp > 1 && c.sp_padding == SpPadding::tail) return {};
  return {false, c.sp > 1 ? "virtual padding routes no pad rows" : "sp = 1"};
}

/// The EP rank's own token count, from the untouched input x of sp_shard or
/// the sp_tokens the shard records for the later slots.
int64_t tokens_of(const RankBoard& b) {
  auto it = b.find("sp_tokens");
  return it != b.end() ? to_ints(it->second).at(0) : b.at("x").shape[0];
}

/// Rows of `name` (T, D) -> the SP layout by the shard map (a tail pad row is
/// zero): sp_shard's x and, backwards, sp_gather_bwd's grad_out.
void fast_to_sp_layout(FastCtx& ctx, const std::string& name, int64_t T) {
  const Case& c = ctx.c;
  const Tensor& t = ctx.input(name);
  const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
  const std::vector<int64_t> map = sp_shard_map(l);
  Tensor& out = ctx.output(name, t.type, {int64_t(map.size()), c.hidden});
  apply_row_map(ctx.exec, c.dtype, t.data(), map.data(), int64_t(map.size()), c.hidden, out.data());
}
Tensor ref_to_sp_layout(const Case& c, const Tensor& t, int64_t T) {
  const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
  return from_floats(ref::sp_shard_rows(sh, to_floats(t), T, c.hidden), t.type, {int64_t(sh.position.size()), c.hidden});
}

}  // namespace

namespace {

// One descriptor per stage variant (docs/architecture.md idea 4);
// register_sp_stages lists them in slot order.

/// sp_shard: each SP rank's slice of the tokens.
Stage sp_shard_stage() {
  Stage s;
  s.slot = "sp_shard";
  s.variant = "sp_slices";
  s.summary = "x -> the SP ranks' local tokens, stacked; virtual or tail padding (docs/contract.md §10)";
  s.applies = sp_on;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x"});
  s.outputs = {{"x", CompareClass::exact, Coords::token_col, promise_always},
               {"sp_rows", CompareClass::exact, Coords::flat, nullptr},
               {"sp_tokens", CompareClass::exact, Coords::flat, nullptr}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const int64_t T = ctx.input("x").shape[0];
    const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
    fast_to_sp_layout(ctx, "x", T);
    Tensor& rows = ctx.output("sp_rows", ElemType::i64, {int64_t(c.sp)});
    for (int64_t q = 0; q < c.sp; ++q) rows.as<int64_t>()[q] = l.rows(q);
    ctx.output("sp_tokens", ElemType::i64, {1}).as<int64_t>()[0] = T;
  };
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const Tensor& x = r.in.at("x", int(q));
      const int64_t T = x.shape[0];
      const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
      RankBoard& out = r.out.ranks[q];
      out["x"] = ref_to_sp_layout(c, x, T);
      out["sp_rows"] = from_ints(sh.rows_per_rank, ElemType::i64, {int64_t(c.sp)});
      out["sp_tokens"] = from_ints({T}, ElemType::i64, {1});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

/// sp_pad_route: tail pad rows to expert 0 with score 0.
Stage sp_pad_route_stage() {
  Stage s;
  s.slot = "sp_pad_route";
  s.variant = "tail_pad_rows";
  s.summary = "tail pad rows routed to expert 0 with score 0, counts recomputed (docs/frameworks.md §10.2)";
  s.applies = sp_tail;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"ids", "topk_scores", "counts", "sp_tokens"});
  s.outputs = {{"ids", CompareClass::exact, Coords::token_k, nullptr},
               {"topk_scores", CompareClass::exact, Coords::token_k, nullptr},
               {"counts", CompareClass::exact, Coords::expert, nullptr}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& ids = ctx.input("ids");
    const SpLayout l = sp_layout(tokens_of(ctx.in), c.batch, c.sp, c.sp_padding, ctx.exec.faults);
    Tensor& oi = ctx.output("ids", ElemType::i32, ids.shape);
    Tensor& os = ctx.output("topk_scores", ElemType::f32, ids.shape);
    if (ids.bytes()) {  // a rank with no tokens has no storage
      copy_bytes(ctx.exec, oi.data(), ids.data(), ids.bytes());
      copy_bytes(ctx.exec, os.data(), ctx.input("topk_scores").data(), os.bytes());
    }
    Tensor& counts = ctx.output("counts", ElemType::i64, {int64_t(c.num_experts)});
    sp_route_pad_rows(ctx.exec, l, c.top_k, c.num_experts, oi.as<int32_t>(), os.as<float>(), counts.as<int64_t>());
  };
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const RankBoard& in = r.in.ranks[q];
      const int64_t T = tokens_of(in);
      const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
      const Tensor& ids_in = in.at("ids");
      ref::Ids ids = ref_ids(ids_in);
      ref::Vec sc = to_floats(in.at("topk_scores"));
      ref::Counts counts;
      ref::sp_route_pad_rows(sh, T, c.top_k, c.num_experts, ids, sc, counts);
      RankBoard& out = r.out.ranks[q];
      out["ids"] = ids_tensor(ids, ElemType::i32, ids_in.shape);
      out["topk_scores"] = from_floats(sc, ElemType::f32, ids_in.shape);
      out["counts"] = from_ints(counts, ElemType::i64, {int64_t(c.num_experts)});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

/// sp_gather: the global nlt*S rows, the first T kept.
Stage sp_gather_stage() {
  Stage s;
  s.slot = "sp_gather";
  s.variant = "global_rows";
  s.summary = "combine output of the SP ranks -> global nlt*S rows -> first B*L kept (docs/contract.md §10)";
  s.applies = sp_on;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"out", "sp_tokens"});
  s.outputs = {{"sp_out_global", CompareClass::exact, Coords::token_col, promise_combined},
               {"sp_out", CompareClass::exact, Coords::token_col, promise_combined}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& out = ctx.input("out");
    const int64_t T = tokens_of(ctx.in);
    const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
    const std::vector<int64_t> map = sp_gather_map(l);
    Tensor& g = ctx.output("sp_out_global", out.type, {l.global_rows(), c.hidden});
    apply_row_map(ctx.exec, c.dtype, out.data(), map.data(), l.global_rows(), c.hidden, g.data());
    Tensor& kept = ctx.output("sp_out", out.type, {T, c.hidden});
    copy_bytes(ctx.exec, kept.data(), g.data(), kept.bytes());  // no tokens: no storage, no copy
  };
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const RankBoard& in = r.in.ranks[q];
      const int64_t T = tokens_of(in);
      const Tensor& out = in.at("out");
      const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
      ref::Vec g = ref::sp_global_rows(sh, to_floats(out), c.sp, c.hidden);
      RankBoard& o = r.out.ranks[q];
      o["sp_out_global"] = from_floats(g, out.type, {sh.nlt * c.sp, c.hidden});
      g.resize(size_t(T * c.hidden));
      o["sp_out"] = from_floats(g, out.type, {T, c.hidden});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

// ---- backward (docs/contract.md §10, §13) --------------------------------------
// Both SP steps move rows, so their adjoints are the inverse row maps: the
// gather's adjoint takes grad_out (T, D) into the SP layout by the shard map
// (a tail pad row, which no token feeds, gets a zero row); the shard's adjoint
// takes grad_x from the SP layout back to (T, D) by the gather map's first T
// rows (pad rows' gradients dropped). Every other backward slot runs on the
// SP layout unchanged, as the forward does.

Decision sp_backward_on(const Case& c) {
  if (c.sp <= 1) return {false, "sp = 1"};
  if (c.backward != Switch::on) return {false, "backward: off"};
  if (const std::string why = backward_unsupported(c); !why.empty()) return {false, why};
  return {};
}

/// An SP backward slot: one tensor moved between the token order and the SP
/// layout (its fast and reference functions set by the caller).
Stage sp_backward_stage(const char* slot, const char* variant, const char* summary, const char* tensor,
                        Promise promised) {
  Stage s;
  s.slot = slot;
  s.variant = variant;
  s.summary = summary;
  s.applies = sp_backward_on;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({tensor, "sp_tokens"});
  s.outputs = {{tensor, CompareClass::exact, Coords::token_col, std::move(promised)}};
  s.backends = kHostAndDevice;
  return s;
}

/// sp_gather_bwd: grad_out (T, D) -> the SP layout.
Stage sp_gather_bwd_stage() {
  Stage s = sp_backward_stage("sp_gather_bwd", "shard_rows",
                              "grad_out (T, D) -> the SP layout by the shard map, tail pad rows zero (the gather's adjoint)",
                              "grad_out", promise_always);
  s.fast = [](FastCtx& ctx) { fast_to_sp_layout(ctx, "grad_out", tokens_of(ctx.in)); };
  s.ref = [](RefCtx& r) {
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const RankBoard& in = r.in.ranks[q];
      r.out.ranks[q]["grad_out"] = ref_to_sp_layout(r.c, in.at("grad_out"), tokens_of(in));
    }
  };
  return s;
}

/// sp_shard_bwd: grad_x in the SP layout -> (T, D).
Stage sp_shard_bwd_stage() {
  Stage s = sp_backward_stage("sp_shard_bwd", "gather_rows",
                              "grad_x from the SP layout -> (T, D) by the gather map, pad rows' gradients dropped (the "
                              "shard's adjoint)",
                              "grad_x", nullptr);
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& g = ctx.input("grad_x");
    const int64_t T = tokens_of(ctx.in);
    const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
    std::vector<int64_t> map = sp_gather_map(l);  // its first T rows: token t's SP row
    if (ctx.exec.faults.has(Fault::sp_bwd_token_order))
      for (int64_t t = 0; t < T; ++t) map[size_t(t)] = t;
    Tensor& gx = ctx.output("grad_x", g.type, {T, c.hidden});
    apply_row_map(ctx.exec, c.dtype, g.data(), map.data(), T, c.hidden, gx.data());
  };
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const RankBoard& in = r.in.ranks[q];
      const int64_t T = tokens_of(in);
      const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
      RankBoard& out = r.out.ranks[q];
      // grad_x, and on the reference chain its end-to-end error scale, which
      // dispatch_bwd wrote in the SP layout
      for (const char* n : {"grad_x", "grad_x_scale"}) {
        const auto it = in.find(n);
        if (it == in.end()) continue;
        ref::Vec v = ref::sp_global_rows(sh, to_floats(it->second), c.sp, c.hidden);
        v.resize(size_t(T * c.hidden));
        out[n] = from_floats(v, it->second.type, {T, c.hidden});
      }
    }
  };
  return s;
}

}  // namespace

void register_sp_stages(std::vector<Stage>& reg) {
  reg.push_back(sp_shard_stage());
  reg.push_back(sp_pad_route_stage());
  reg.push_back(sp_gather_stage());
  reg.push_back(sp_gather_bwd_stage());
  reg.push_back(sp_shard_bwd_stage());
}

}  // namespace moev
