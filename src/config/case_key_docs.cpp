#include "case_key_docs.h"

#include <map>
#include <sstream>

#include "case.h"
#include "case_json.h"

namespace moev {

std::string case_key_meaning(const std::string& key) {
  static const std::map<std::string, std::string> m = {
      {"name", "the case's name; a sweep appends [key=value,...]"},
      {"shape.tokens", "T, tokens on each EP rank (after flattening batch x sequence)"},
      {"shape.hidden", "D, the hidden size"},
      {"shape.ffn", "F, the expert FFN size (SwiGLU experts)"},
      {"shape.experts", "E, routed experts in all (E % ep == 0)"},
      {"shape.top_k", "K, experts per token (K <= E)"},
      {"dtype", "the activation dtype; router logits and scores are fp32 unless router.gate_dtype / router.score_dtype say act"},
      {"seed", "the data seed: every input is a hash of (seed, stream, rank, row, column)"},
      {"data", "exact: small integers, bitwise checkable end to end; realistic: normal data, real weights"},
      {"backend", "where the fast path runs (the flag --backend sets it for every case)"},
      {"router.score", "softmax over experts or sigmoid per expert (docs/contract.md §1)"},
      {"router.bias", "an fp32 selection bias added before top-k, not to the scores"},
      {"router.groups", "G contiguous expert groups for group-limited routing (1: none)"},
      {"router.limited_groups", "groups kept per token under group-limited routing"},
      {"router.force_load_balance", "ids = (t*K + k) mod E regardless of scores (docs/contract.md §6)"},
      {"router.route_norm", "top-k scores divided by their sum (+1e-20)"},
      {"router.route_scale", "top-k scores multiplied by this"},
      {"router.hot_expert", "an expert given +1 selection bias: in every token's top-k (-1: none); the exported `bias` input already holds the +1, so an implementation adds it to nothing else"},
      {"router.gate_dtype", "fp32: logits from x and the gate promoted to fp32; act: rounded to act first (docs/contract.md §14)"},
      {"router.score_dtype", "fp32: scores and top-k scores in fp32; act: the scores, the route_norm sum and quotient, the scaled scores and (without bias) the group scores rounded to act, and the score gradient too (docs/contract.md §14)"},
      {"score_multiply", "fp32: y = round(v * s); act: the score rounded to act first (docs/contract.md §14)"},
      {"experts.rounding", "fused: H = round(silu(h1) * h3); torchtitan: silu(h1) rounded first (docs/contract.md §14)"},
      {"experts.w13_fused", "on: W1 and W3 are one GEMM [W1; W3] (Megatron's linear_fc1), so under autograd's rounding "
                            "(experts.rounding torchtitan) dX is one GEMM over 2F rounded once, not two rounded GEMMs "
                            "added; the forward is the same (docs/contract.md §14)"},
      {"experts.compute_dtype", "act, or bf16: X and the weights rounded to bf16 for the GEMMs (docs/contract.md §14)"},
      {"experts.weights", "held: w1/w3/w2 as whole tensors; streamed: generated a few experts at a time by each stage that "
                          "reads them; auto: streamed past 4 GiB (docs/architecture.md \"Scale and backends\"); export writes "
                          "streamed weights whole up to 256 MiB and refuses larger ones"},
      {"experts.kind", "identity experts (Y = X) or SwiGLU experts"},
      {"experts.impl", "the primary SwiGLU implementation: a loop per expert, grouped GEMM, or batched (equal counts)"},
      {"shared_experts.kind", "a shared expert beside the routed ones"},
      {"shared_experts.order", "add_after: out = combine + shared(x); init_with_shared: the combine starts from shared(x)"},
      {"score_before_experts", "on: rows scaled by their score before the experts, not after"},
      {"score_on_hidden", "on: the score multiplies the SwiGLU hidden H before the down projection (Megatron-Core's per_token_scale), "
                          "and the combine adds the expert outputs unscaled; ep 1, align 1, no SP or FP8, "
                          "with its backward too (docs/contract.md §14)"},
      {"combine.accumulate", "per_add: a rounding after every addition; fp32_accumulate: one at the end (docs/contract.md §2)"},
      {"grad_accumulate", "the dispatch backward's sum of a token's K row gradients: as_combine (combine.accumulate's mode), "
                          "per_add (autograd's index_put_ with accumulate: a rounding after every addition) or "
                          "fp32_accumulate (one rounding) (docs/contract.md §14)"},
      {"combine.order", "the order of a token's additions in the combine and the dispatch backward: ascending expert id "
                        "(bitwise), or any (GPU atomics: judged within the half-width any order can reach, "
                        "docs/contract.md §2)"},
      {"combine.placement", "the primary combine: out of place, or in place into the caller's buffer"},
      {"combine.buffer", "the in-place combine's buffer: fresh, x itself, or a view into x (docs/contract.md §9)"},
      {"combine.alias_offset", "elements into x where an alias_x_offset buffer starts"},
      {"ep", "R, expert-parallel ranks; experts are sharded in contiguous blocks of E/R"},
      {"shape.tokens_per_rank", "tokens of each EP rank, in place of shape.tokens (zeros allowed)"},
      {"align", "A, expert groups padded to a multiple of A rows for grouped GEMM (docs/contract.md §4)"},
      {"empty_groups", "zero: an empty group keeps 0 rows; pad: it gets A rows"},
      {"permute", "the EP permute: generic table, equal-count transpose, or auto"},
      {"equal_split.policy", "the equal-split all-to-all: off, always, or when its padding overhead is under the threshold (docs/contract.md §5)"},
      {"equal_split.threshold", "the largest padding overhead (a fraction) that adaptive accepts"},
      {"sp", "S sequence-parallel ranks per EP rank (docs/contract.md §10)"},
      {"shape.batch", "B sequences per rank: T = B * seq_len"},
      {"shape.seq_len", "L tokens per sequence, with shape.batch"},
      {"sp_padding", "how T is padded to a multiple of S: virtual (index formula) or tail rows routed to expert 0"},
      {"backward", "on: the adjoint of the token path, gradients checked (docs/contract.md §13)"},
      {"layers", "MoE layer entries, each with its own router; the overload factor over them (docs/contract.md §12)"},
      {"capacity.factor",
       "per-expert capacity cap = ceil(T*K/E * factor), with sp > 1 per SP rank over its real tokens; 0: dropless "
       "(docs/contract.md §11)"},
      {"capacity.policy", "which rows an expert keeps: highest scores (probs) or first tokens (position)"},
      {"capacity.pad_to_capacity", "on: every expert gets exactly cap rows, zero filler rows with score 0"},
      {"dispatch.dtype", "act: token rows dispatched as they are; fp8_e4m3: quantised per token and block before the all-to-all, "
                         "block scales moved with their rows, dequantised for the experts (docs/contract.md §16)"},
      {"dispatch.scale", "fp32: s = amax / 448; ue8m0: s rounded up to a power of two (DeepGEMM on newer GPUs)"},
      {"dispatch.block", "channels per scale block of a token row (1 x block tiles); a divisor of shape.hidden"},
      {"dispatch.quotient", "the value rounded to e4m3: x * (1 / s) (reciprocal, DeepGEMM), x * (448 / amax) (amax_ratio, DeepEP's tests; fp32 scales) or x / s (divide, DeepSeek-V3's act_quant)"},
      {"dispatch.amax_clamp", "each block's amax is clamped below at this value before the scale is taken (1e-4 as DeepEP and DeepGEMM)"},
  };
  if (auto it = m.find(key); it != m.end()) return it->second;
  if (key.rfind("tolerance.", 0) == 0)
    return std::string("overrides the tolerance table's ") + (key.find(".rtol") != std::string::npos ? "rtol" : "atol") +
           " for this comparison class";
  return "";
}

std::string case_keys_markdown() {
  nlohmann::ordered_json defaults = case_to_json(Case{});
  // An act case's JSON leaves out the FP8 dispatch keys: their defaults are
  // those of an FP8 case, dtype's act.
  Case fp8;
  fp8.dispatch.dtype = DispatchDtype::fp8_e4m3;
  const nlohmann::ordered_json fp8_json = case_to_json(fp8);
  for (auto it = fp8_json.begin(); it != fp8_json.end(); ++it)
    if (!defaults.contains(it.key()))
      defaults[it.key()] = it.key() == "dispatch.dtype" ? nlohmann::ordered_json("act") : it.value();
  // Likewise grad_accumulate, written only when it is not its default.
  defaults["grad_accumulate"] = enum_name(grad_accumulate_table(), Case{}.grad_accumulate);
  std::ostringstream o;
  o << "# Case keys\n\n"
       "Generated by `moeverify validate --keys --markdown` from the case schema (a test keeps this file current).\n"
       "Keys may be nested (`shape: {top_k: 2}`) or dotted (`shape.top_k: 2`); `defaults:` sets them for every case\n"
       "of a file and `sweep:` takes a list per key (the cartesian product of cases); `--set` of a swept key\n"
       "replaces its sweep. Integers are decimal (`010` is 10). The tokens come one way: `shape.tokens`,\n"
       "`shape.seq_len` (with `shape.batch`) or `shape.tokens_per_rank`; a case's way replaces the defaults'.\n\n"
       "| key | valid values | default | meaning |\n|---|---|---|---|\n";
  for (const auto& [key, valid] : case_keys()) {
    std::string def = "-";
    if (key == "name") def = "(required)";  // every case names itself: no default
    else if (defaults.contains(key)) def = defaults[key].dump();
    std::string v = valid;
    for (size_t p = 0; (p = v.find('|', p)) != std::string::npos; p += 2) v.replace(p, 1, "\\|");
    o << "| `" << key << "` | " << v << " | " << def << " | " << case_key_meaning(key) << " |\n";
  }
  return o.str();
}

}  // namespace moev
