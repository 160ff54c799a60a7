#include "random_case.h"

#include <algorithm>
#include <random>
#include <sstream>
#include <vector>

namespace moev {
namespace {

struct Draw {
  std::mt19937_64 g;
  int64_t in(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(g) < p; }
  template <class T>
  T pick(const std::vector<T>& v) { return v[size_t(in(0, int64_t(v.size()) - 1))]; }
};

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

/// The router keys (score, bias, groups, force-LB, norm, scale, hot
/// expert); whether force-load-balance routing was drawn.
bool draw_router(Draw& d, std::ostream& y, int E, int K, int sp) {
  y << ", router: {score: " << d.pick<const char*>({"softmax", "sigmoid"})
    << ", bias: " << d.pick<const char*>({"off", "on"});
  std::vector<int> groups;
  for (int g : divisors(E))
    if (g > 1 && E / g >= 2 && g <= 64) groups.push_back(g);
  if (!groups.empty() && d.chance(0.3)) {
    const int G = d.pick(groups);
    const int min_kept = (K + E / G - 1) / (E / G);
    y << ", groups: " << G << ", limited_groups: " << d.in(min_kept, G);
  }
  const bool force_lb = d.chance(0.2) && sp == 1;  // SP refuses force-LB routing (src/config/case_validate.cpp)
  y << ", force_load_balance: " << (force_lb ? "on" : "off")
    << ", route_norm: " << d.pick<const char*>({"off", "on"});
  if (d.chance(0.5)) y << ", route_scale: " << d.pick<const char*>({"0.5", "2.5", "16", "76.8", "1000", "1e6", "0.001"});
  if (d.chance(0.2)) y << ", hot_expert: " << d.in(0, E - 1);
  y << "}";
  return force_lb;
}

/// Experts, shared experts and the combine; the combine.buffer drawn (an
/// aliasing buffer only where every rank has tokens).
std::string draw_experts_combine(Draw& d, std::ostream& y, const std::vector<int64_t>& per_rank, int64_t D, int sp,
                                 bool& score_before) {
  y << ", experts: {kind: " << d.pick<const char*>({"identity", "swiglu"})
    << ", impl: " << d.pick<const char*>({"loop", "grouped", "batched"}) << "}";
  const char* shared = d.pick<const char*>({"none", "none", "identity", "swiglu"});
  const bool init_with_shared = std::string(shared) != "none" && d.chance(0.5);
  y << ", shared_experts: {kind: " << shared << ", order: " << (init_with_shared ? "init_with_shared" : "add_after") << "}";
  score_before = d.chance(0.3);
  y << ", score_before_experts: " << (score_before ? "on" : "off");
  int64_t min_T = *std::min_element(per_rank.begin(), per_rank.end());
  std::string buffer = "fresh";
  if (std::string(shared) == "identity" && init_with_shared && min_T > 0 && d.chance(0.6) && sp == 1)
    buffer = min_T * D > 1 && d.chance(0.5) ? "alias_x_offset" : "alias_x";
  y << ", combine: {accumulate: " << d.pick<const char*>({"per_add", "fp32_accumulate"})
    << ", placement: " << d.pick<const char*>({"out_of_place", "in_place"}) << ", buffer: " << buffer;
  if (buffer == "alias_x_offset") y << ", alias_offset: " << d.in(1, min_T * D - 1);
  y << "}";
  return buffer;
}

/// EP-only keys (valid, and exercised, at ep = 1 too), tolerance overrides
/// and the framework conventions (each with a backward contract, docs/contract.md §13).
void draw_ep_tolerance_conventions(Draw& d, std::ostream& y) {
  y << ", align: " << d.pick<int64_t>({1, 1, 2, 4, 8, 16, 128}) << ", empty_groups: " << d.pick<const char*>({"zero", "pad"})
    << ", permute: " << d.pick<const char*>({"auto", "generic", "equal_count"});
  y << ", equal_split: {policy: " << d.pick<const char*>({"off", "force", "adaptive"})
    << ", threshold: " << d.pick<const char*>({"0", "0.1", "0.5", "3"}) << "}";
  // Tolerance overrides only loosen: a user who widens a tolerance must not
  // get a false alarm from it.
  if (d.chance(0.1)) y << ", tolerance: {gemm: {rtol: 0.05, atol: 0.05}, end_to_end: {rtol: 0.05}, scores: {atol: 1e-6}, logits: {rtol: 1e-4}}";
  // Framework conventions (docs/contract.md §14).
  y << ", router.gate_dtype: " << d.pick<const char*>({"fp32", "fp32", "act"});
  y << ", score_multiply: " << d.pick<const char*>({"fp32", "fp32", "act"});
  y << ", experts.rounding: " << d.pick<const char*>({"fused", "fused", "torchtitan"});
  y << ", experts.compute_dtype: " << d.pick<const char*>({"act", "act", "bf16"});
  y << ", router.score_dtype: " << d.pick<const char*>({"fp32", "fp32", "act"});
  y << ", experts.w13_fused: " << d.pick<const char*>({"off", "off", "on"});
}

/// Backward, layer entries and capacity from a stream of their own (seeded
/// by seed and index), so the other keys draw as before they existed.
/// Returns whether backward was drawn; `capacity` says whether capacity was.
bool draw_backward_layers_capacity(uint64_t seed, uint64_t index, std::ostream& y, int sp, const std::string& buffer,
                                   bool force_lb, bool& capacity) {
  // backward (docs/contract.md §13) from a stream of its own, so the other keys draw
  // as before: on in about 30% of the cases it supports (a fresh buffer;
  // every expert convention has a backward contract).
  Draw db{std::mt19937_64((seed ^ 0x425744ull) * 0x9E3779B97F4A7C15ull + index)};
  const bool backward = db.chance(0.3) && buffer == "fresh";
  if (backward) y << ", backward: on";
  // MoE layer entries (docs/contract.md §12): each multiplies the run time, so 2 or 3
  // in about 10% of the cases.
  if (db.chance(0.1)) y << ", layers: " << db.in(2, 3);
  // capacity (docs/contract.md §11) in about 20% of the cases it supports,
  // 35% with sp > 1 (per-SP-rank caps, tail pad rows taking no slot).
  capacity = db.chance(sp > 1 ? 0.35 : 0.2) && !force_lb;
  if (capacity)
    y << ", capacity: {factor: " << db.pick<const char*>({"0.25", "0.5", "1", "1.25", "4"})
      << ", policy: " << db.pick<const char*>({"probs", "position"})
      << ", pad_to_capacity: " << db.pick<const char*>({"off", "on"}) << "}";
  // The backward's own accumulate mode in about a third of those cases
  // (docs/contract.md §14), drawn last so the keys above draw as before.
  if (backward && db.chance(0.35)) y << ", grad_accumulate: " << db.pick<const char*>({"per_add", "fp32_accumulate"});
  return backward;
}

/// FP8 dispatch (docs/contract.md §16) from a stream of its own, so the other
/// keys draw as before it existed: in about 25% of the cases it supports
/// (no score before the experts, no backward; sp > 1 included, docs/contract.md
/// §16 "With sequence parallelism"), and in half of those with capacity
/// (§16 "With capacity"), with a
/// block that divides D, either scale and any quotient (amax_ratio with
/// fp32 scales only).
bool draw_fp8(uint64_t seed, uint64_t index, std::ostream& y, int64_t D, bool supported, bool capacity) {
  Draw df{std::mt19937_64((seed ^ 0x465038ull) * 0x9E3779B97F4A7C15ull + index)};
  if (!df.chance(capacity ? 0.5 : 0.25) || !supported) return false;
  std::vector<int> blocks;
  for (int b : divisors(int(D)))
    if (b <= 128) blocks.push_back(b);
  const bool ue8m0 = df.chance(0.5);
  const int block = df.pick(blocks);
  const char* quotient = !ue8m0 && df.chance(0.5) ? "amax_ratio" : "reciprocal";
  // divide in about a quarter, drawn last so that the keys above draw as before it existed.
  if (df.chance(0.25)) quotient = "divide";
  y << ", dispatch: {dtype: fp8_e4m3, scale: " << (ue8m0 ? "ue8m0" : "fp32") << ", block: " << block
    << ", quotient: " << quotient << "}";
  return true;
}

}  // namespace

Case load_one_case(const std::string& yaml, const std::string& origin) {
  return load_cases_text("cases:\n  - " + yaml + "\n", origin, {}).at(0);
}

std::string random_case_yaml(uint64_t seed, uint64_t index) {
  Draw d{std::mt19937_64(seed * 0x9E3779B97F4A7C15ull + index)};
  // Sequence parallel (docs/contract.md §10) from a stream of its own, so the other
  // keys draw as before: sp > 1 in about 30% of cases (often more SP ranks
  // than tokens), virtual or tail padding, B in {2, 3} sequences for a third
  // of those with equal tokens per EP rank (virtual: L a multiple of sp).
  Draw ds{std::mt19937_64((seed ^ 0x5350ull) * 0x9E3779B97F4A7C15ull + index)};
  const int sp = ds.chance(0.3) ? int(ds.pick<int64_t>({2, 3, 4, 8})) : 1;
  const bool sp_tail = ds.chance(0.5);
  const int64_t sp_batch = sp > 1 && ds.chance(0.33) ? ds.pick<int64_t>({2, 3}) : 1;
  std::ostringstream y;
  y.precision(17);
  // Experts and EP ranks: E a multiple of ep; E_l = 1 and K = E happen often.
  const int ep = int(d.pick<int64_t>({1, 1, 1, 2, 2, 3, 4, 4, 7, 8}));
  const int E_l = int(d.pick<int64_t>({1, 1, 2, 2, 3, 4, 8}));
  const int E = ep * E_l * (ep == 1 ? int(d.pick<int64_t>({1, 2, 3, 4, 8, 16})) : 1);
  const int K = d.chance(0.15) ? std::min(E, 32) : int(d.in(1, std::min(E, 8)));
  const bool big = d.chance(0.03);  // T*K past the counting sort's chunk size
  const int64_t T = big ? d.in(600, 1200) : d.pick<int64_t>({0, 1, 2, 3, 5, 8, 13, 16, 31, 48});
  // Now and then a wide D with few tokens: router logits past exp's fp32 range.
  const bool wide = !big && d.chance(0.03);
  const int64_t D = big ? d.in(1, 8) : wide ? d.in(1024, 2048) : d.pick<int64_t>({1, 2, 3, 7, 8, 16, 33});
  const int64_t F = d.pick<int64_t>({1, 3, 8, 16, 24});
  const char* dtype = d.pick<const char*>({"fp32", "bf16", "fp16"});
  y << "{name: r" << index << ", seed: " << d.in(0, 1000000) << ", dtype: " << dtype
    << ", data: " << d.pick<const char*>({"exact", "realistic"}) << ", ep: " << ep;
  y << ", shape: {experts: " << E << ", top_k: " << K << ", hidden: " << D << ", ffn: " << F;
  // Tokens per rank: equal, a list with zeros, or a seeded uniform draw.
  std::vector<int64_t> per_rank(size_t(ep), T);
  const int tmode = ep > 1 ? int(d.in(0, 2)) : 0;
  if (tmode == 1) {
    y << ", tokens_per_rank: [";
    for (int r = 0; r < ep; ++r) {
      per_rank[size_t(r)] = d.chance(0.25) ? 0 : d.in(0, 24);
      y << (r ? ", " : "") << per_rank[size_t(r)];
    }
    y << "]";
  } else if (tmode == 2) {
    const int64_t lo = d.in(0, 8), hi = lo + d.in(0, 16);
    y << ", tokens_per_rank: {uniform: [" << lo << ", " << hi << "]}";
    std::fill(per_rank.begin(), per_rank.end(), lo);  // the smallest a rank can draw
  } else if (sp_batch > 1) {
    int64_t L = T / sp_batch;
    if (!sp_tail) L = L / sp * sp;
    y << ", batch: " << sp_batch << ", seq_len: " << L;
    std::fill(per_rank.begin(), per_rank.end(), sp_batch * L);
  } else {
    y << ", tokens: " << T;
  }
  y << "}";
  if (sp > 1) y << ", sp: " << sp << ", sp_padding: " << (sp_tail ? "tail" : "virtual");
  const bool force_lb = draw_router(d, y, E, K, sp);
  bool score_before = false;
  const std::string buffer = draw_experts_combine(d, y, per_rank, D, sp, score_before);
  draw_ep_tolerance_conventions(d, y);
  bool capacity = false;
  const bool backward = draw_backward_layers_capacity(seed, index, y, sp, buffer, force_lb, capacity);
  const bool fp8 = draw_fp8(seed, index, y, D, !score_before && !backward, capacity);
  // Streamed routed weights (docs/architecture.md "Scale and backends") in
  // about 15% of the cases that allow them (no backward, no FP8), from a
  // stream of their own: the experts' chunks then split every shape drawn.
  Draw dw{std::mt19937_64((seed ^ 0x5354524dull) * 0x9E3779B97F4A7C15ull + index)};
  if (dw.chance(0.15) && !backward && !fp8) y << ", experts.weights: streamed";
  y << "}";
  return y.str();
}

}  // namespace moev
