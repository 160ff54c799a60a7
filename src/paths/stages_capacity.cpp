// Capacity and token dropping (docs/contract.md §11, docs/frameworks.md §11). The slot
// `capacity` follows `dispatch` on each rank and replaces the dispatch's
// outputs by their capacity-limited versions under the same names
// (routed_input, token_sorted, score_sorted, row_of, counts), so the EP
// all-to-all, permutes, padding, experts and combine run unchanged on the
// kept rows: a dropped assignment has row_of -1 and adds nothing to its
// token; pad_to_capacity gives every expert exactly cap rows, its fillers
// zero rows with score 0 and token -1 (skipped by the combine). cap is
// computed per rank over its own T_r tokens (Megatron-LM's router-level
// dropping runs on each rank before the dispatch); with sp > 1 per SP rank
// over the real tokens of its shard, tail pad rows taking no slot
// (docs/contract.md §11, "Capacity with sequence parallelism"). Under FP8
// dispatch the twin drop_per_expert_fp8 moves routed_input_q and
// routed_input_scale by the same decision instead of routed_input
// (docs/contract.md §16 "With capacity"): fillers are e4m3 zero rows with
// scale 0.
#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "../kernels/capacity_host.h"
#include "../reference/reference.h"
#include "stages.h"

namespace moev {

namespace {

/// The row tensors the capacity stage moves: the activation rows, or under
/// FP8 dispatch (docs/contract.md §16 "With capacity") the e4m3 rows and
/// their block-scale rows, each by the same keep decision.
std::vector<std::string> capacity_rows(const Case& c) {
  if (c.fp8()) return {"routed_input_q", "routed_input_scale"};
  return {"routed_input"};
}

/// The EP rank's own token count, recorded by sp_shard (sp > 1 only).
int64_t ep_tokens(const RankBoard& in) { return to_ints(in.at("sp_tokens")).at(0); }

}  // namespace

ref::CapacityGroups capacity_groups_of(const Case& c, const RankBoard& in) {
  // docs/contract.md §11: one group per SP rank with sp > 1, from the reference shard
  if (c.sp > 1)
    return ref::capacity_groups_sp(ref::sp_shard(ep_tokens(in), c.batch, c.sp, ref_padding(c)), ep_tokens(in),
                                   c.top_k, c.num_experts, c.capacity.factor);
  return ref::capacity_groups_one(in.at("row_of").shape[0], c.top_k, c.num_experts, c.capacity.factor);
}

void capacity_reference(const Case& c, const RankBoard& in, RankBoard& out, const std::vector<uint8_t>* keep) {
  const Tensor& row_of = in.at("row_of");
  const ref::CapacityGroups groups = capacity_groups_of(c, in);
  bool first = true;
  for (const std::string& name : capacity_rows(c)) {
    const Tensor& rows = in.at(name);
    // Each row tensor is laid out by the same decision (a filler row is zero
    // bytes: an e4m3 zero row, scale 0); the metadata come from the first.
    ref::CapacityDispatch d = ref::capacity_dispatch(
        rows_of(rows), ref_ids(in.at("token_sorted")), to_floats(in.at("score_sorted")), ref_ids(row_of),
        ref_counts(in.at("counts")), groups, c.capacity.policy == CapacityPolicy::probs,
        c.capacity.pad_to_capacity == Switch::on, keep);
    out[name] = rows_tensor(std::move(d.rows), rows.type, rows.shape[1]);
    if (!first) continue;
    first = false;
    const int64_t M = int64_t(d.token_sorted.size());
    out["counts"] = from_ints(d.counts, ElemType::i64, {c.num_experts});
    out["token_sorted"] = ids_tensor(d.token_sorted, ElemType::i32, {M});
    out["score_sorted"] = from_floats(d.score_sorted, ElemType::f32, {M});
    out["row_of"] = ids_tensor(d.row_of, ElemType::i32, row_of.shape);
  }
}

void capacity_with_kept(const Case& c, const RankBoard& in, const RankBoard& kept, RankBoard& out) {
  const std::vector<int64_t> counts = to_ints(in.at("counts")), tok = to_ints(in.at("token_sorted"));
  const std::vector<int64_t> kcounts = to_ints(kept.at("counts")), ktok = to_ints(kept.at("token_sorted"));
  std::vector<uint8_t> keep(tok.size(), 0);
  // An expert holds each token at most once (top-K picks distinct experts),
  // so its kept rows are the ones whose token its kept group lists.
  int64_t s = 0, ks = 0;
  for (size_t e = 0; e < counts.size() && e < kcounts.size(); ++e) {
    std::set<int64_t> mine;
    for (int64_t i = ks; i < ks + kcounts[e] && i < int64_t(ktok.size()); ++i)
      if (ktok[size_t(i)] >= 0) mine.insert(ktok[size_t(i)]);
    for (int64_t i = s; i < s + counts[e]; ++i) keep[size_t(i)] = mine.count(tok[size_t(i)]) > 0;
    s += counts[e];
    ks += kcounts[e];
  }
  capacity_reference(c, in, out, &keep);
}

namespace {

/// The fast capacity stage on one rank: selects the kept rows, writes the
/// metadata, and moves the row tensors of capacity_rows(c) (activation rows,
/// or the e4m3 rows and their scales) by the same row map.
void capacity_fast(FastCtx& ctx) {
  const Case& c = ctx.c;
  const int E = c.num_experts;
  const Tensor& row_of = ctx.input("row_of");
  const int64_t T = row_of.shape[0];
  CapacityGroups groups;
  if (c.sp > 1)  // per SP rank, tail pad rows in no group (docs/contract.md §11)
    groups = sp_capacity_groups(sp_layout(ep_tokens(ctx.in), c.batch, c.sp, c.sp_padding, ctx.exec.faults), c.top_k,
                                E, c.capacity.factor, ctx.exec.faults);
  else
    groups.caps = {capacity_of(T, c.top_k, E, c.capacity.factor)};
  const bool pad = c.capacity.pad_to_capacity == Switch::on;
  const Tensor& counts = ctx.input("counts");
  const Tensor& tok = ctx.input("token_sorted");
  const Tensor& sc = ctx.input("score_sorted");
  const int64_t N = tok.numel();
  std::vector<uint8_t> keep(static_cast<size_t>(N));
  std::vector<int64_t> kept(static_cast<size_t>(E));
  capacity_select(ctx.exec, c.capacity.policy, counts.as<int64_t>(), E, groups, tok.as<int32_t>(), sc.as<float>(),
                  keep.data(), kept.data());
  const int64_t pad_rows = groups.total_cap();
  int64_t M = 0;
  for (int e = 0; e < E; ++e) M += pad ? pad_rows : kept[size_t(e)];
  Tensor& out_counts = ctx.output("counts", ElemType::i64, {E});
  Tensor& out_tok = ctx.output("token_sorted", ElemType::i32, {M});
  Tensor& out_sc = ctx.output("score_sorted", ElemType::f32, {M});
  Tensor& out_row_of = ctx.output("row_of", ElemType::i32, row_of.shape);
  const std::vector<int64_t> src =
      capacity_plan(ctx.exec, counts.as<int64_t>(), E, pad_rows, pad, keep.data(), kept.data(), tok.as<int32_t>(),
                    sc.as<float>(), row_of.as<int32_t>(), row_of.numel(), c.top_k, out_tok.as<int32_t>(),
                    out_sc.as<float>(), out_row_of.as<int32_t>(), out_counts.as<int64_t>());
  if (c.fp8()) {
    const Tensor& q = ctx.input("routed_input_q");
    const Tensor& s = ctx.input("routed_input_scale");
    Tensor& out_q = ctx.output("routed_input_q", ElemType::e4m3, {M, c.hidden});
    Tensor& out_s = ctx.output("routed_input_scale", ElemType::f32, {M, s.shape[1]});
    capacity_apply_fp8(ctx.exec, src, N, q.data(), s.as<float>(), c.hidden, s.shape[1], out_q.data(), out_s.as<float>());
  } else {
    const Tensor& rows = ctx.input("routed_input");
    Tensor& out_rows = ctx.output("routed_input", rows.type, {M, c.hidden});
    move_rows(ctx.exec, rows, src.data(), M, out_rows);
  }
  int64_t dropped = 0;
  for (int e = 0; e < E; ++e) dropped += counts.as<int64_t>()[e] - kept[size_t(e)];
  std::string caps;
  for (int64_t v : groups.caps) caps += (caps.empty() ? "" : ", ") + std::to_string(v);
  ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": cap " + (c.sp > 1 ? "per SP rank [" + caps + "]" : caps) +
                      ", " + std::to_string(dropped) + " of " + std::to_string(N) + " assignments dropped" +
                      (pad ? ", every expert padded to " + std::to_string(pad_rows) + " rows" : ""));
}

/// The stage for the activation rows (fp8 false) or for the e4m3 rows and
/// their block scales (docs/contract.md §16 "With capacity").
Stage capacity_stage(bool fp8) {
  Stage s;
  s.slot = "capacity";
  s.variant = fp8 ? "drop_per_expert_fp8" : "drop_per_expert";
  s.summary = "each expert keeps at most cap = ceil(T*K/E * factor) rows, per SP rank with sp > 1 (probs: highest "
              "scores, ties to the lower token; position: the first), no renormalisation; pad_to_capacity fills to "
              "cap (docs/contract.md §11)";
  if (fp8) s.summary += "; FP8: the e4m3 rows and their block scales together, fillers e4m3 zero with scale 0 (§16)";
  s.applies = [fp8](const Case& c) {
    if (!(c.capacity.factor > 0)) return Decision{false, "capacity.factor: none (dropless)"};
    if (c.fp8() != fp8)
      return Decision{false, fp8 ? "dispatch.dtype: act"
                                 : "dispatch.dtype: fp8_e4m3 (drop_per_expert_fp8 moves the e4m3 rows and scales)"};
    return Decision{};
  };
  if (fp8) s.listed = [](const Case& c) { return c.fp8(); };
  s.primary = [](const Case&) { return true; };
  const std::vector<std::string> rows =
      fp8 ? std::vector<std::string>{"routed_input_q", "routed_input_scale"} : std::vector<std::string>{"routed_input"};
  std::vector<std::string> ins = rows;
  for (const char* n : {"token_sorted", "score_sorted", "row_of", "counts"}) ins.push_back(n);
  s.inputs = [ins](const Case& c) {
    std::vector<std::string> in = ins;
    if (c.sp > 1) in.push_back("sp_tokens");  // the SP ranks' groups (docs/contract.md §11)
    return in;
  };
  s.outputs = {{"counts", CompareClass::exact, Coords::expert, nullptr}};
  for (const std::string& n : rows) s.outputs.push_back({n, CompareClass::exact, Coords::dispatch_row, nullptr});
  s.outputs.push_back({"token_sorted", CompareClass::exact, Coords::flat, nullptr});
  s.outputs.push_back({"score_sorted", CompareClass::exact, Coords::flat, nullptr});
  s.outputs.push_back({"row_of", CompareClass::exact, Coords::token_k, nullptr});
  s.fast = capacity_fast;
  // On a device the kept rows move there (apply_row_map); which rows are
  // kept, and the metadata, are decided on the host.
  s.backends = kHostAndDevice;
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    for (int q = 0; q < int(r.in.ranks.size()); ++q)
      if (r.wants(q)) capacity_reference(r.c, r.in.ranks[size_t(q)], r.out.ranks[size_t(q)]);
  };
  // The reference chain's routing scores may differ from the fast ones in
  // the last bits (class scores, docs/contract.md §1): under policy probs a near-tie
  // at an expert's cap boundary can then keep another token in the chain.
  // The stage check above compared the kept rows bitwise on the same inputs;
  // the chain continues from the fast kept rows when the kept tokens differ
  // (the analogue of the routing near-tie rule).
  s.chain_adopt = [](const Case& c, const RankBoard& chain, const RankBoard& fast) -> std::string {
    if (c.capacity.policy != CapacityPolicy::probs) return "";
    const auto a = chain.find("token_sorted"), b = fast.find("token_sorted");
    if (a == chain.end() || b == fast.end() || to_ints(a->second) == to_ints(b->second)) return "";
    return "the reference chain keeps the fast path's kept rows: its routing scores (within the scores tolerance) "
           "put a near-tie on the other side of an expert's capacity";
  };
  return s;
}

}  // namespace

void register_capacity_stages(std::vector<Stage>& reg) {
  reg.push_back(capacity_stage(false));
  reg.push_back(capacity_stage(true));
}

}  // namespace moev
