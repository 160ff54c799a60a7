// A case as JSON and back (see case_json.h).
#include "case_json.h"

#include <algorithm>

#include "error.h"

namespace moev {

nlohmann::ordered_json case_to_json(const Case& c) {
  nlohmann::ordered_json j;
  j["name"] = c.name;
  // batch > 1 has no per-rank token list (every EP rank holds batch * seq_len)
  if ((c.ep == 1 || c.batch > 1) && c.tokens_per_rank.empty() && c.tokens_uniform_lo < 0) {
    j["shape.tokens"] = c.tokens;
  } else {
    std::vector<int64_t> t;
    for (int r = 0; r < c.ep; ++r) t.push_back(c.tokens_on(r));
    j["shape.tokens"] = c.tokens;
    j["shape.tokens_per_rank"] = t;
  }
  j["shape.hidden"] = c.hidden;
  j["shape.ffn"] = c.ffn;
  j["shape.experts"] = c.num_experts;
  j["shape.top_k"] = c.top_k;
  j["dtype"] = enum_name(dtype_table(), c.dtype);
  j["seed"] = c.seed;
  j["data"] = enum_name(data_mode_table(), c.data);
  j["router.score"] = enum_name(score_table(), c.router.score);
  j["router.bias"] = enum_name(switch_table(), c.router.bias);
  j["router.groups"] = c.router.groups;
  j["router.limited_groups"] = c.router.limited_groups;
  j["router.force_load_balance"] = enum_name(switch_table(), c.router.force_load_balance);
  j["router.route_norm"] = enum_name(switch_table(), c.router.route_norm);
  j["router.route_scale"] = double(c.router.route_scale);  // a float is exact as a double
  j["router.hot_expert"] = c.router.hot_expert;
  j["router.gate_dtype"] = enum_name(gate_dtype_table(), c.router.gate_dtype);
  j["router.score_dtype"] = enum_name(gate_dtype_table(), c.router.score_dtype);
  j["score_multiply"] = enum_name(score_multiply_table(), c.score_multiply);
  j["experts.rounding"] = enum_name(experts_rounding_table(), c.experts.rounding);
  j["experts.compute_dtype"] = enum_name(compute_dtype_table(), c.experts.compute_dtype);
  j["experts.w13_fused"] = enum_name(switch_table(), c.experts.w13_fused);
  j["experts.weights"] = enum_name(weight_storage_table(), c.experts.weights);
  j["experts.kind"] = enum_name(expert_kind_table(), c.experts.kind);
  j["experts.impl"] = enum_name(experts_impl_table(), c.experts.impl);
  j["shared_experts.kind"] = enum_name(shared_kind_table(), c.shared.kind);
  j["shared_experts.order"] = enum_name(shared_order_table(), c.shared.order);
  j["score_before_experts"] = enum_name(switch_table(), c.score_before_experts);
  j["score_on_hidden"] = enum_name(switch_table(), c.score_on_hidden);
  j["combine.accumulate"] = enum_name(accumulate_table(), c.combine.accumulate);
  j["combine.placement"] = enum_name(placement_table(), c.combine.placement);
  j["combine.order"] = enum_name(combine_order_table(), c.combine.order);
  j["combine.buffer"] = enum_name(out_buffer_table(), c.combine.buffer);
  j["combine.alias_offset"] = c.combine.alias_offset;
  j["ep"] = c.ep;
  j["align"] = c.align;
  j["empty_groups"] = enum_name(empty_groups_table(), c.empty_groups);
  j["permute"] = enum_name(permute_table(), c.permute);
  j["equal_split.policy"] = enum_name(equal_split_table(), c.equal_split.policy);
  j["equal_split.threshold"] = c.equal_split.threshold;
  j["sp"] = c.sp;
  j["shape.batch"] = c.batch;
  j["shape.seq_len"] = c.tokens / c.batch;
  j["sp_padding"] = enum_name(sp_padding_table(), c.sp_padding);
  j["backward"] = enum_name(switch_table(), c.backward);
  if (c.grad_accumulate != GradAccumulate::as_combine)  // docs/contract.md §14; the default's manifest is as before
    j["grad_accumulate"] = enum_name(grad_accumulate_table(), c.grad_accumulate);
  j["backend"] = enum_name(backend_table(), c.backend);
  j["layers"] = c.layers;  // the golden tensors are entry 1's
  j["capacity.factor"] = c.capacity.factor;
  j["capacity.policy"] = enum_name(capacity_policy_table(), c.capacity.policy);
  j["capacity.pad_to_capacity"] = enum_name(switch_table(), c.capacity.pad_to_capacity);
  if (c.fp8()) {  // docs/contract.md §16 (an act case's manifest is as before)
    j["dispatch.dtype"] = enum_name(dispatch_dtype_table(), c.dispatch.dtype);
    j["dispatch.scale"] = enum_name(fp8_scale_table(), c.dispatch.scale);
    j["dispatch.block"] = c.dispatch.block;
    j["dispatch.quotient"] = enum_name(fp8_quotient_table(), c.dispatch.quotient);
    j["dispatch.amax_clamp"] = c.dispatch.amax_clamp;
  }
  for (const auto& [cls, o] : c.tolerance_override) {
    const std::string base = std::string("tolerance.") + enum_name(compare_class_table(), cls);
    if (o.rtol) j[base + ".rtol"] = *o.rtol;
    if (o.atol) j[base + ".atol"] = *o.atol;
  }
  return j;
}

nlohmann::ordered_json keys_left_out(const Case& c) {
  const nlohmann::ordered_json j = case_to_json(c);
  nlohmann::ordered_json o;
  if (!j.contains("grad_accumulate")) o["grad_accumulate"] = enum_name(grad_accumulate_table(), c.grad_accumulate);
  if (!j.contains("dispatch.dtype")) o["dispatch.dtype"] = "act";
  if (!j.contains("shape.tokens_per_rank")) {
    std::vector<int64_t> t;
    for (int r = 0; r < c.ep; ++r) t.push_back(c.tokens_on(r));
    o["shape.tokens_per_rank"] = t;
  }
  return o;
}

Case case_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) bad_input(where + ": \"case\" is not an object; valid: the resolved case as `moeverify export` writes it");
  // JSON is YAML: the case loader validates it like any case file entry.
  // case_to_json writes the tokens every way for readers of the manifest
  // (shape.tokens and seq_len beside the per-rank list at ep > 1): one way
  // is read back, the count where every rank holds it, else the list.
  nlohmann::json k = j;
  if (k.contains("shape.tokens_per_rank")) {
    const nlohmann::json& l = k["shape.tokens_per_rank"];
    const bool even = k.contains("shape.tokens") && l.is_array() &&
                      std::all_of(l.begin(), l.end(), [&](const nlohmann::json& t) { return t == k["shape.tokens"]; });
    if (even) {
      k.erase("shape.tokens_per_rank");
    } else {
      k.erase("shape.tokens");
      k.erase("shape.seq_len");
    }
  }
  const std::string text = "cases:\n  - " + k.dump(-1, ' ', true) + "\n";
  std::vector<Case> cs = load_cases_text(text, where, {});
  if (cs.size() != 1) bad_input(where + ": \"case\" must describe exactly one case (no sweep)");
  return cs[0];
}

}  // namespace moev
