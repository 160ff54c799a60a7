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
// (docs/contract.md §11, "Capacity with sequence parallelism").
#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/capacity_host.h"
#include "../reference/reference.h"
#include "stages.h"

namespace moev {

namespace {

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
  const Tensor& rows = in.at("routed_input");
  const ref::CapacityGroups groups = capacity_groups_of(c, in);
  ref::CapacityDispatch d = ref::capacity_dispatch(
      rows_of(rows), ref_ids(in.at("token_sorted")), to_floats(in.at("score_sorted")), ref_ids(row_of),
      ref_counts(in.at("counts")), groups, c.capacity.policy == CapacityPolicy::probs,
      c.capacity.pad_to_capacity == Switch::on, keep);
  const int64_t M = int64_t(d.token_sorted.size());
  out["counts"] = from_ints(d.counts, ElemType::i64, {c.num_experts});
  out["routed_input"] = rows_tensor(std::move(d.rows), rows.type, c.hidden);
  out["token_sorted"] = ids_tensor(d.token_sorted, ElemType::i32, {M});
  out["score_sorted"] = from_floats(d.score_sorted, ElemType::f32, {M});
  out["row_of"] = ids_tensor(d.row_of, ElemType::i32, row_of.shape);
}

void register_capacity_stages(std::vector<Stage>& reg) {
  Stage s;
  s.slot = "capacity";
  s.variant = "drop_per_expert";
  s.summary = "each expert keeps at most cap = ceil(T*K/E * factor) rows, per SP rank with sp > 1 (probs: highest "
              "scores, ties to the lower token; position: the first), no renormalisation; pad_to_capacity fills to "
              "cap (docs/contract.md §11)";
  s.applies = [](const Case& c) { return Decision{c.capacity.factor > 0, "capacity.factor: none (dropless)"}; };
  s.primary = [](const Case&) { return true; };
  s.inputs = [](const Case& c) {
    std::vector<std::string> in = {"routed_input", "token_sorted", "score_sorted", "row_of", "counts"};
    if (c.sp > 1) in.push_back("sp_tokens");  // the SP ranks' groups (docs/contract.md §11)
    return in;
  };
  s.outputs = {{"counts", CompareClass::exact, Coords::expert, nullptr},
               {"routed_input", CompareClass::exact, Coords::dispatch_row, nullptr},
               {"token_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"score_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"row_of", CompareClass::exact, Coords::token_k, nullptr}};
  s.fast = [](FastCtx& ctx) {
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
    const Tensor& rows = ctx.input("routed_input");
    const int64_t N = tok.numel();
    std::vector<uint8_t> keep(static_cast<size_t>(N));
    std::vector<int64_t> kept(static_cast<size_t>(E));
    capacity_select(ctx.exec, c.capacity.policy, counts.as<int64_t>(), E, groups, tok.as<int32_t>(), sc.as<float>(),
                    keep.data(), kept.data());
    const int64_t pad_rows = groups.total_cap();
    int64_t M = 0;
    for (int e = 0; e < E; ++e) M += pad ? pad_rows : kept[size_t(e)];
    Tensor& out_counts = ctx.output("counts", ElemType::i64, {E});
    Tensor& out_rows = ctx.output("routed_input", rows.type, {M, c.hidden});
    Tensor& out_tok = ctx.output("token_sorted", ElemType::i32, {M});
    Tensor& out_sc = ctx.output("score_sorted", ElemType::f32, {M});
    Tensor& out_row_of = ctx.output("row_of", ElemType::i32, row_of.shape);
    capacity_apply(ctx.exec, counts.as<int64_t>(), E, pad_rows, pad, keep.data(), kept.data(),
                   c.dtype, rows.data(), c.hidden, tok.as<int32_t>(), sc.as<float>(),
                   row_of.as<int32_t>(), row_of.numel(), c.top_k, out_rows.data(), out_tok.as<int32_t>(),
                   out_sc.as<float>(), out_row_of.as<int32_t>(), out_counts.as<int64_t>());
    int64_t dropped = 0;
    for (int e = 0; e < E; ++e) dropped += counts.as<int64_t>()[e] - kept[size_t(e)];
    std::string caps;
    for (int64_t v : groups.caps) caps += (caps.empty() ? "" : ", ") + std::to_string(v);
    ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": cap " + (c.sp > 1 ? "per SP rank [" + caps + "]" : caps) +
                        ", " + std::to_string(dropped) + " of " + std::to_string(N) + " assignments dropped" +
                        (pad ? ", every expert padded to " + std::to_string(pad_rows) + " rows" : ""));
  };
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
  reg.push_back(s);
}

}  // namespace moev
