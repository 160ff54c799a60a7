// A Case from its flattened keys, and the rules that hold between keys
// (docs/architecture.md "Configuration"): what one key's range cannot say,
// refused with the key's FILE:LINE:COLUMN and what would be valid.
#include <algorithm>
#include <cstdio>
#include <string>

#include "case_schema.h"
#include "error.h"

namespace moev {
namespace case_detail {
namespace {

/// Where a key of the case was set, or the case's source and "(default KEY)"
/// where it was not.
std::string loc(const Flat& flat, const std::string& path, const Case& c) {
  auto it = flat.find(path);
  return it == flat.end() ? c.source + " (default " + path + ")" : where(it->second);
}

/// FP8 dispatch (docs/contract.md §16): the block divides the hidden size,
/// the quotient 448/amax belongs to an fp32 scale, and what the FP8 path does
/// not model is refused.
template <class Fail>
void validate_fp8(const Case& c, const Fail& fail) {
  if (!c.fp8()) return;
  const int64_t D = c.hidden, b = c.dispatch.block;
  if (D % b != 0) {
    std::string divisors;
    int listed = 0;
    for (int64_t d = 1; d <= D && listed < 16; ++d)
      if (D % d == 0) divisors += (listed++ ? ", " : "") + std::to_string(d);
    fail("dispatch.block", "block " + std::to_string(b) + " does not divide shape.hidden " + std::to_string(D) +
                               " (a scale block must not straddle two tokens)",
         "valid: a divisor of shape.hidden: " + divisors + (listed == 16 ? ", ..." : ""));
  }
  if (c.dispatch.quotient == k::Fp8Quotient::amax_ratio && c.dispatch.scale == k::Fp8Scale::ue8m0)
    fail("dispatch.quotient", "amax_ratio divides by amax / 448, which is not the stored UE8M0 scale",
         "valid: quotient reciprocal with scale ue8m0, or scale fp32 with amax_ratio");
  if (c.score_before_experts == Switch::on)
    fail("score_before_experts", "FP8 dispatch quantises x per token before the dispatch, so no score is applied there",
         "valid: score_before_experts off with dispatch.dtype fp8_e4m3");
  if (c.backward == Switch::on)
    fail("backward",
         "FP8 dispatch has a forward contract only (docs/contract.md section 16 defines no gradient of the quantiser), so its "
         "gradients could not be checked",
         "valid: backward off with dispatch.dtype fp8_e4m3");
}

/// score_on_hidden (docs/contract.md §14): the expert rows must be the
/// dispatch rows, one to one, so that each takes its score_sorted entry.
template <class Fail>
void validate_score_on_hidden(const Case& c, const Fail& fail) {
  if (c.score_on_hidden != Switch::on) return;
  auto need = [&](bool ok, const char* key, const std::string& why, const char* valid) {
    if (!ok) fail(key, "score_on_hidden: on " + why, std::string("valid: ") + valid + ", or score_on_hidden: off");
  };
  const std::string moved = "takes each expert row's score from its dispatch row, which ";
  need(c.experts.kind == ExpertKind::swiglu, "experts.kind", "scales the SwiGLU hidden H", "experts.kind: swiglu");
  need(c.score_before_experts == Switch::off, "score_before_experts", "places the score inside the experts, not before them",
       "score_before_experts: off");
  need(c.ep == 1, "ep", moved + "the EP exchange does not carry", "ep: 1");
  need(c.align == 1, "align", moved + "alignment padding moves", "align: 1");
  need(c.equal_split.policy == EqualSplitPolicy::off, "equal_split.policy", moved + "equal-split padding moves",
       "equal_split.policy: off");
  need(c.sp == 1, "sp", "is modelled without sequence parallelism", "sp: 1");
  need(!c.fp8(), "dispatch.dtype", "is modelled on act dispatch", "dispatch.dtype: act");
  need(c.combine.placement == CombinePlacement::out_of_place && c.combine.buffer == OutBuffer::fresh, "combine.placement",
       "is modelled with the out-of-place combine", "combine {placement: out_of_place, buffer: fresh}");
}

/// Streamed routed weights (experts.weights; docs/architecture.md "Scale and
/// backends"): the paths that would need every expert's weights at once are
/// refused, with the size that made `auto` stream them.
template <class Fail>
void validate_streamed(const Case& c, const Fail& fail) {
  if (!c.streams_weights()) return;
  auto gib = [](double bytes, const char* format) {
    char b[32];
    std::snprintf(b, sizeof b, format, bytes / double(int64_t(1) << 30));
    return std::string(b);
  };
  const std::string why = c.experts.weights == WeightStorage::streamed
                              ? std::string("experts.weights: streamed")
                              : "the routed weights (" + gib(c.routed_weight_bytes(), "%.1f") +
                                    " GiB) are streamed (experts.weights auto streams past " +
                                    gib(kStreamWeightBytes, "%g") + " GiB)";
  if (c.backward == Switch::on)
    fail("backward", why + ", and the backward's weight gradients are whole (E, F, D) tensors",
         "valid: backward off, or experts.weights: held with weights that fit in memory");
  if (c.fp8())
    fail("dispatch.dtype", why + ", and the FP8 error bound reads every expert's weights at once",
         "valid: dispatch.dtype act, or experts.weights: held with weights that fit in memory");
}

/// The rules between keys (divisibility, ranges that depend on another key,
/// combinations a path does not model), each refused with where the key was
/// set and what would be valid.
void validate(const Case& c, const Flat& flat) {
  auto fail = [&](const std::string& path, const std::string& what, const std::string& valid) {
    bad_input(loc(flat, path, c) + ": " + path + ": " + what + "; " + valid);
  };
  const int E = c.num_experts, K = c.top_k;
  if (K > E)
    fail("shape.top_k", "top_k " + std::to_string(K) + " exceeds experts " + std::to_string(E),
         "valid: 1 <= top_k <= experts (" + std::to_string(E) + ")");
  const int G = c.router.groups, L = c.router.limited_groups;
  if (E % G != 0)
    fail("router.groups", "experts " + std::to_string(E) + " are not divisible by groups " + std::to_string(G),
         "valid: a divisor of experts");
  if (G > 1 && E / G < 2)
    fail("router.groups", "each group needs at least 2 experts (group score = sum of its two largest)",
         "valid: groups <= experts / 2 = " + std::to_string(E / 2));
  if (L > G)
    fail("router.limited_groups", "limited_groups " + std::to_string(L) + " exceeds groups " + std::to_string(G),
         "valid: 1 <= limited_groups <= groups");
  if (G > 1 && int64_t(L) * (E / G) < K)
    fail("router.limited_groups", "the kept groups hold " + std::to_string(L * (E / G)) + " experts, fewer than top_k",
         "valid: limited_groups * experts / groups >= top_k");
  if (c.router.hot_expert >= E)
    fail("router.hot_expert", "expert " + std::to_string(c.router.hot_expert) + " does not exist",
         "valid: -1 (none) or 0 <= hot_expert < experts (" + std::to_string(E) + ")");
  if (E % c.ep != 0)
    fail("ep", "experts " + std::to_string(E) + " are not divisible by ep " + std::to_string(c.ep),
         "valid: ep a divisor of experts (experts are split in contiguous blocks of experts/ep)");
  if (!c.tokens_per_rank.empty() && int(c.tokens_per_rank.size()) != c.ep)
    fail("shape.tokens_per_rank", "has " + std::to_string(c.tokens_per_rank.size()) + " entries for ep " + std::to_string(c.ep),
         "valid: exactly ep entries, one per rank");
  if (c.combine.buffer != OutBuffer::fresh) {
    if (c.shared.kind != SharedKind::identity || c.shared.order != SharedOrder::init_with_shared)
      fail("combine.buffer", "an output buffer aliasing x models an identity shared expert that returns x",
           "valid: shared_experts {kind: identity, order: init_with_shared} with this buffer, or buffer: fresh");
    for (int r = 0; r < c.ep; ++r)
      if (c.tokens_on(r) == 0)
        fail("combine.buffer", "an aliasing buffer needs tokens > 0 on every rank", "valid: buffer: fresh when a rank has no tokens");
  }
  int64_t min_tokens = c.tokens_on(0);
  for (int r = 1; r < c.ep; ++r) min_tokens = std::min(min_tokens, c.tokens_on(r));
  if (c.combine.buffer == OutBuffer::alias_x_offset && c.combine.alias_offset >= min_tokens * c.hidden)
    fail("combine.alias_offset", "offset " + std::to_string(c.combine.alias_offset) + " leaves no overlap with x",
         "valid: 1 <= alias_offset < tokens*hidden = " + std::to_string(min_tokens * c.hidden));
  if (c.shared.kind == SharedKind::none && c.shared.order == SharedOrder::init_with_shared)
    fail("shared_experts.order", "init_with_shared needs a shared expert",
         "valid: shared_experts.kind identity | swiglu, or order add_after");
  // sequence parallel (docs/contract.md §10, docs/frameworks.md §10.3)
  const int64_t B = c.batch;
  if (B > 1 && (!c.tokens_per_rank.empty() || c.tokens_uniform_lo >= 0))
    fail("shape.batch", "batch " + std::to_string(B) + " with per-rank token counts",
         "valid: batch 1 with shape.tokens_per_rank, or shape.batch with shape.seq_len (every EP rank holds batch*seq_len tokens)");
  if (B > 1 && c.tokens % B != 0)
    fail("shape.batch", "tokens " + std::to_string(c.tokens) + " are not batch " + std::to_string(B) + " sequences",
         "valid: tokens a multiple of batch, or shape.seq_len instead of shape.tokens");
  const int64_t seq = c.tokens / B;
  if (c.sp > 1 && B > 1 && c.sp_padding == SpPadding::virtual_ && seq % c.sp != 0)
    fail(flat.count("shape.seq_len") ? "shape.seq_len" : flat.count("shape.batch") ? "shape.batch" : "sp",
         "virtual SP padding with batch " + std::to_string(B) + " needs seq_len % sp == 0, but seq_len " +
             std::to_string(seq) + " % sp " + std::to_string(c.sp) + " = " + std::to_string(seq % c.sp) +
             " (the per-sequence shard index would keep the wrong rows, torchtitan #3604)",
         "valid: seq_len a multiple of " + std::to_string(c.sp) + ", batch 1, or sp_padding: tail");
  if (c.sp > 1 && c.router.force_load_balance == Switch::on)
    fail("sp", "force-load-balance routing depends on a token's row on its rank (docs/contract.md §1 step 6), which sequence "
               "parallelism changes, so the SP run cannot equal the sp = 1 run",
         "valid: sp 1, or router.force_load_balance off");
  if (c.sp > 1 && c.combine.buffer != OutBuffer::fresh)
    fail("combine.buffer", "an output buffer aliasing x with sp > 1: each SP rank's x is its own shard",
         "valid: buffer: fresh with sp > 1");
  // backward (docs/contract.md §13): what src/paths/stages_backward.cpp does not model is refused here.
  // capacity (docs/contract.md §11): what src/paths/stages_capacity.cpp does not model.
  // (with sp > 1 capacity is per SP rank, tail pad rows taking no slot: §11, "Capacity with sequence parallelism")
  if (c.capacity.factor > 0 && c.router.force_load_balance == Switch::on)
    fail("capacity.factor", "the force-load-balance fast path derives its splits from T, K and E, not from the kept counts",
         "valid: router.force_load_balance: off with capacity");
  if (c.backward == Switch::on && c.combine.buffer != OutBuffer::fresh)
    fail("backward", "an output buffer aliasing x adds x itself to the output, a gradient path the backward does not model",
         "valid: combine.buffer: fresh with backward: on");
  validate_fp8(c, fail);
  validate_streamed(c, fail);
  validate_score_on_hidden(c, fail);
}

}  // namespace

Case build_case(const Flat& flat, const std::string& source) {
  Case c;
  c.source = source;
  for (const auto& f : schema()) {
    auto it = flat.find(f.path);
    if (it != flat.end()) f.set(c, it->second, f.path);
  }
  // shape.tokens_per_rank gives every rank's tokens: a token count beside it
  // would be read by nothing.
  if (flat.count("shape.tokens_per_rank"))
    for (const char* k : {"shape.tokens", "shape.seq_len"})
      if (flat.count(k))
        bad_input(where(flat.at(k)) + ": " + k + ": set beside shape.tokens_per_rank (" +
                  where(flat.at("shape.tokens_per_rank")) +
                  "), which gives each rank's tokens; valid: one way of giving the tokens");
  // shape.seq_len gives the tokens: T = batch * seq_len (docs/contract.md §10).
  if (flat.count("shape.seq_len")) {
    if (flat.count("shape.tokens") && c.tokens != c.batch * c.seq_len)
      bad_input(where(flat.at("shape.tokens")) + ": shape.tokens: " + std::to_string(c.tokens) +
                " disagrees with batch * seq_len = " + std::to_string(c.batch * c.seq_len) +
                "; valid: either shape.tokens or shape.seq_len (with shape.batch)");
    // Each is held to its range alone; their product is the token count,
    // held to shape.tokens' range (batch and seq_len up to 2^24 each would
    // give 2^48 tokens).
    if (c.batch * c.seq_len > int64_t(1) << 24)
      bad_input(where(flat.at("shape.seq_len")) + ": shape.seq_len: batch " + std::to_string(c.batch) +
                " x seq_len " + std::to_string(c.seq_len) + " = " + std::to_string(c.batch * c.seq_len) +
                " tokens, past the token range; valid: batch * seq_len from 0 to 16777216 (2^24), as shape.tokens");
    c.tokens = c.batch * c.seq_len;
  }
  validate(c, flat);
  c.seq_len = c.tokens / c.batch;  // one value for a case however it was written
  return c;
}

}  // namespace case_detail

std::string key_without_effect(const std::string& key, const Case& c) {
  const auto is = [](const std::string& k, const char* value) { return k + " is " + value; };
  const bool swiglu = c.experts.kind == ExpertKind::swiglu, shared_swiglu = c.shared.kind == SharedKind::swiglu;
  if (key == "combine.alias_offset" && c.combine.buffer != OutBuffer::alias_x_offset)
    return is("combine.buffer", enum_name(out_buffer_table(), c.combine.buffer)) +
           "; it places the combine's output with combine.buffer: alias_x_offset";
  if (key == "equal_split.threshold" && c.equal_split.policy != EqualSplitPolicy::adaptive)
    return is("equal_split.policy", enum_name(equal_split_table(), c.equal_split.policy)) +
           "; it chooses under equal_split.policy: adaptive";
  if ((key == "capacity.policy" || key == "capacity.pad_to_capacity") && !(c.capacity.factor > 0))
    return is("capacity.factor", "0 (dropless): nothing is dropped");
  if (key.rfind("dispatch.", 0) == 0 && key != "dispatch.dtype" && !c.fp8())
    return is("dispatch.dtype", "act; it sets the FP8 dispatch (dispatch.dtype: fp8_e4m3)");
  if (key == "sp_padding" && c.sp == 1) return is("sp", "1: no sequence-parallel padding");
  if (key == "grad_accumulate" && c.backward != Switch::on) return is("backward", "off");
  // experts.rounding and w13_fused apply to a shared SwiGLU expert too.
  if ((key == "experts.impl" || key == "experts.compute_dtype" || key == "experts.weights") && !swiglu)
    return is("experts.kind", "identity");
  if ((key == "experts.rounding" || key == "experts.w13_fused") && !swiglu && !shared_swiglu)
    return is("experts.kind", "identity") + " and no shared SwiGLU expert";
  return "";
}

}  // namespace moev
