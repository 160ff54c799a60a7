// Capacity and token dropping (docs/contract.md §11, docs/frameworks.md §11). The slot
// `capacity` follows `dispatch` on each rank and replaces the dispatch's
// outputs by their capacity-limited versions under the same names
// (routed_input, token_sorted, score_sorted, row_of, counts), so the EP
// all-to-all, permutes, padding, experts and combine run unchanged on the
// kept rows: a dropped assignment has row_of -1 and adds nothing to its
// token; pad_to_capacity gives every expert exactly cap rows, its fillers
// zero rows with score 0 and token -1 (skipped by the combine). cap is
// computed per rank over its own T_r tokens (Megatron-LM's router-level
// dropping runs on each rank before the dispatch).
#include <algorithm>
#include <cmath>
#include <vector>

#include "../kernels/capacity_host.h"
#include "../reference/reference.h"
#include "stages.h"

namespace moev {

void capacity_reference(const Case& c, const RankBoard& in, RankBoard& out, const std::vector<uint8_t>* keep) {
  const Tensor& row_of = in.at("row_of");
  const Tensor& rows = in.at("routed_input");
  const int64_t cap = int64_t(std::ceil(double(row_of.shape[0]) * c.top_k / c.num_experts * c.capacity.factor));
  ref::CapacityDispatch d = ref::capacity_dispatch(
      rows_of(rows), ref_ids(in.at("token_sorted")), to_floats(in.at("score_sorted")), ref_ids(row_of),
      ref_counts(in.at("counts")), cap, c.capacity.policy == CapacityPolicy::probs,
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
  s.summary = "each expert keeps at most cap = ceil(T*K/E * factor) rows (probs: highest scores, ties to the lower "
              "token; position: the first), no renormalisation; pad_to_capacity fills to cap (docs/contract.md §11)";
  s.applies = [](const Case& c) { return Decision{c.capacity.factor > 0, "capacity.factor: none (dropless)"}; };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"routed_input", "token_sorted", "score_sorted", "row_of", "counts"});
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
    const int64_t cap = capacity_of(T, c.top_k, E, c.capacity.factor);
    const bool pad = c.capacity.pad_to_capacity == Switch::on;
    const Tensor& counts = ctx.input("counts");
    const Tensor& tok = ctx.input("token_sorted");
    const Tensor& sc = ctx.input("score_sorted");
    const Tensor& rows = ctx.input("routed_input");
    const int64_t N = tok.numel();
    std::vector<uint8_t> keep(static_cast<size_t>(N));
    std::vector<int64_t> kept(static_cast<size_t>(E));
    capacity_select(ctx.exec, c.capacity.policy, counts.as<int64_t>(), E, cap, tok.as<int32_t>(), sc.as<float>(),
                    keep.data(), kept.data());
    int64_t M = 0;
    for (int e = 0; e < E; ++e) M += pad ? cap : kept[size_t(e)];
    Tensor& out_counts = ctx.output("counts", ElemType::i64, {E});
    Tensor& out_rows = ctx.output("routed_input", rows.type, {M, c.hidden});
    Tensor& out_tok = ctx.output("token_sorted", ElemType::i32, {M});
    Tensor& out_sc = ctx.output("score_sorted", ElemType::f32, {M});
    Tensor& out_row_of = ctx.output("row_of", ElemType::i32, row_of.shape);
    capacity_apply(ctx.exec, counts.as<int64_t>(), E, cap, pad, keep.data(), kept.data(),
                   c.dtype, rows.data(), c.hidden, tok.as<int32_t>(), sc.as<float>(),
                   row_of.as<int32_t>(), row_of.numel(), c.top_k, out_rows.data(), out_tok.as<int32_t>(),
                   out_sc.as<float>(), out_row_of.as<int32_t>(), out_counts.as<int64_t>());
    int64_t dropped = 0;
    for (int e = 0; e < E; ++e) dropped += counts.as<int64_t>()[e] - kept[size_t(e)];
    ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": cap " + std::to_string(cap) + ", " +
                        std::to_string(dropped) + " of " + std::to_string(N) + " assignments dropped" +
                        (pad ? ", every expert padded to cap" : ""));
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
