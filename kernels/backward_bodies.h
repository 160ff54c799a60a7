// Single-source kernel bodies of the backward token path (docs/contract.md §13,
// docs/frameworks.md §13), in the style of kernels/bodies.h: functors over an index
// space (item, lane, lanes), no allocation, no atomics, each output element
// written by exactly one (item, lane). The data movement of the backward (the
// inverse permutes, padding, all-to-all with swapped splits) and the ordered
// scatter-add need no body of their own: they are k::RowMapBody and
// k::CombineBody run on the saved forward metadata.
#pragma once

#include <cstdint>

#include "bodies.h"

namespace moev::k {

/// Whether the score gradient sums products rounded to the activation dtype
/// (the planted fault bwd_score_grad_rounded, TransformerEngine #1336 class)
/// or exact fp32 products (the contract).
enum class ProductRounding : uint8_t { fp32, act /* planted fault */ };

/// What the score gradient gives an assignment capacity dropped (row_of -1,
/// docs/contract.md §11, §13): 0, since it added nothing to its token, or the
/// dot product with dispatch row 0, an index clamped instead of masked (the
/// planted fault bwd_dropped_grad: the drop not replayed in the backward).
enum class DroppedGrad : uint8_t { zero, clamped_row0 /* planted fault */ };

/// Combine backward for dispatch row i (docs/contract.md §13, docs/frameworks.md §13 "score
/// multiply"): the gradient of routed_output row i is the upstream gradient
/// of its token, times the row's score under after_experts:
///   grad_rows[i] = round(float(G[token_sorted[i]]) * s_i)
/// with s_i the fp32 score, or the score rounded to T under ScoreMultiply::act
/// (the forward multiplied by that value). Under before_experts the score
/// multiply sits at dispatch, and the row is G[token] unchanged. A filler row
/// of pad_to_capacity (token -1, docs/contract.md §11) added nothing to any
/// token: its gradient row is zero.
template <class T>
struct CombineGradRowsBody {
  const T* grad_out;           // (T, D)
  const int32_t* token_sorted; // (N)
  const float* score_sorted;   // (N)
  T* grad_rows;                // (N, D)
  int64_t D;
  ScoreApply apply;
  ScoreMultiply smul;

  MOEV_HD void operator()(int64_t i, int lane, int lanes) const {
    T* dst = grad_rows + i * D;
    if (token_sorted[i] < 0) {
      for (int64_t c = lane; c < D; c += lanes) dst[c] = from_float<T>(0.f);
      return;
    }
    const T* g = grad_out + int64_t(token_sorted[i]) * D;
    if (apply == ScoreApply::before_experts) {
      copy_row(dst, g, D, lane, lanes);
      return;
    }
    const float s = smul == ScoreMultiply::act ? round_to<T>(score_sorted[i]) : score_sorted[i];
    for (int64_t c = lane; c < D; c += lanes) dst[c] = from_float<T>(to_float(g[c]) * s);
  }
};

/// Score gradient of assignment a = t*K + k (docs/frameworks.md §13): the dot product
/// of the token-indexed row t of `token_rows` with dispatch row row_of[a] of
/// `dispatch_rows`, summed in fp32 in ascending column order, each product an
/// exact fp32 product of the two activation values; rounded to T at the end
/// under ScoreMultiply::act (the forward multiplied by the score in T, whose
/// gradient autograd reduces in T and widens back). Under after_experts the
/// token rows are grad_out and the dispatch rows routed_output; under
/// before_experts x and the gradient of routed_input. One thread per
/// assignment: a reduction, and D is small next to the row traffic. An
/// assignment capacity dropped (row_of -1) gets 0.
template <class T>
struct ScoreGradBody {
  const T* token_rows;     // (T, D)
  const T* dispatch_rows;  // (N, D)
  const int32_t* row_of;   // (T*K)
  float* grad_scores;      // (T*K)
  int64_t D;
  int K;
  ScoreMultiply smul;
  ProductRounding products = ProductRounding::fp32;
  DroppedGrad dropped = DroppedGrad::zero;

  MOEV_HD void operator()(int64_t a, int lane, int) const {
    if (lane != 0) return;
    int64_t row = row_of[a];
    if (row < 0 && dropped == DroppedGrad::zero) {
      grad_scores[a] = 0.f;
      return;
    }
    if (row < 0) row = 0;
    const T* u = token_rows + (a / K) * D;
    const T* v = dispatch_rows + row * D;
    float sum = 0.f;
    for (int64_t c = 0; c < D; ++c) {
      float p = to_float(u[c]) * to_float(v[c]);
      if (products == ProductRounding::act) p = round_to<T>(p);
      sum += p;
    }
    grad_scores[a] = smul == ScoreMultiply::act ? round_to<T>(sum) : sum;
  }
};

/// Which derivative of silu the SwiGLU backward takes: the contract's
/// silu'(a) = sig(a) (1 + a (1 - sig(a))), or sig(a) alone (the planted
/// fault swiglu_bwd_silu_grad, docs/frameworks.md §13).
enum class SiluGrad : uint8_t { exact, sigmoid_only /* planted fault */ };

/// The elementwise SwiGLU backward of one (row, f) (docs/contract.md §8, §13) on the
/// values the contract rounds to T: a = h1, b = h3, g = dH. Gives the forward
/// activation H (the dW2 operand), dh3 and dh1, each rounded to T once and
/// widened back. silu(a) = a / (1 + exp(-a)) is the forward's formulation
/// (SwigluBody). Under SiluRounding::fused (the fused activation):
///   H = round(silu(a) b), dh3 = round(g silu(a)), dh1 = round(g b silu'(a)).
/// Under SiluRounding::rounded_to_act (autograd of silu, then the product,
/// each an op of its own on T tensors; docs/contract.md §13, autograd's points):
///   s = round(silu(a)), H = round(s b), ga = round(g b), dh3 = round(g s),
///   dh1 = round(ga silu'(a)).
/// `fused_grad` (the planted fault swiglu_bwd_fused_rounding) takes the fused
/// formulas for dh1 and dh3 whatever the forward rounded.
/// The host backward and SwigluBwdBody both call it.
struct SwigluGradElem {
  float H, dh3, dh1;
};
template <class T>
MOEV_HD inline SwigluGradElem swiglu_grad_elem(float a, float b, float g, SiluGrad sg,
                                               SiluRounding rounding = SiluRounding::fused, bool fused_grad = false) {
  const float e = k_exp(-a);
  const float sig = 1.f / (1.f + e);
  const float silu = a / (1.f + e);
  const float dsilu = sg == SiluGrad::sigmoid_only ? sig : sig * (1.f + a * (1.f - sig));
  if (rounding == SiluRounding::fused) return {round_to<T>(silu * b), round_to<T>(g * silu), round_to<T>(g * b * dsilu)};
  const float s = round_to<T>(silu);
  const float H = round_to<T>(s * b);
  if (fused_grad) return {H, round_to<T>(g * silu), round_to<T>(g * b * dsilu)};
  const float ga = round_to<T>(g * b);
  return {H, round_to<T>(g * s), round_to<T>(ga * dsilu)};
}

/// The gradient of the unscaled hidden H under score_on_hidden (docs/contract.md
/// §13): the multiply H' = round(float(H) s) sends dH = round(float(dH') s)
/// back, in H's type T.
template <class T>
MOEV_HD inline float hidden_grad(float dHp, float s) {
  return round_to<T>(dHp * s);
}

/// score_on_hidden's row step after SwigluBwdBody (one thread per row, f
/// ascending): the row's score gradient dS[r] = sum_f float(dH'[r, f]) *
/// float(H[r, f]) in fp32 from the unscaled H, then H scaled in place to the
/// forward's operand H' = round(float(H) s), which the dW2 GEMM reads.
/// Planted fault score_grad_scaled_hidden: dS from H' instead of H.
template <class T>
struct HiddenScoreGradBody {
  static constexpr bool kThreadPerItem = true;
  const T* dHp;  // (rows, F): the W2 GEMM's gradient dH'
  T* H;          // (rows, F): H in, H' out
  const float* row_scale;
  float* dS;     // (rows)
  int64_t F;
  bool from_scaled = false;  // the planted fault

  MOEV_HD void operator()(int64_t r, int, int) const {
    const float s = row_scale[r];
    float sum = 0.f;
    for (int64_t f = 0; f < F; ++f) {
      const float h = to_float(H[r * F + f]), hs = round_to<T>(h * s);
      sum += to_float(dHp[r * F + f]) * (from_scaled ? hs : h);
      H[r * F + f] = from_float<T>(hs);
    }
    dS[r] = sum;
  }
};

/// The SwiGLU backward's elementwise step (item = row, lanes over f): from
/// h13 = [h1 | h3] (rows, 2F) and dH (rows, F), all in T, writes H (rows, F)
/// and dh13 = [dh1 | dh3] (rows, 2F) in T: the layout whose one GEMM with
/// [W1; W3] (2F, D) gives dX in a single fp32 accumulation.
/// With a row scale (score_on_hidden, docs/contract.md §13) dH holds the W2
/// GEMM's gradient dH' and the step starts from hidden_grad(dH', s); H is
/// written unscaled (HiddenScoreGradBody scales it after).
template <class T>
struct SwigluBwdBody {
  const T* h13;  // (rows, 2F)
  const T* dH;   // (rows, F)
  T* H;          // (rows, F)
  T* dh13;       // (rows, 2F)
  int64_t F;
  SiluGrad silu_grad = SiluGrad::exact;
  SiluRounding rounding = SiluRounding::fused;
  bool fused_grad = false;  // the planted fault swiglu_bwd_fused_rounding
  const float* row_scale = nullptr;  // (rows) or null
  bool scale_grad_kept = true;       // false: the planted fault hidden_grad_unscaled

  MOEV_HD void operator()(int64_t r, int lane, int lanes) const {
    const T* h1 = h13 + r * 2 * F;
    T* d1 = dh13 + r * 2 * F;
    for (int64_t f = lane; f < F; f += lanes) {
      float g = to_float(dH[r * F + f]);
      if (row_scale && scale_grad_kept) g = hidden_grad<T>(g, row_scale[r]);
      const SwigluGradElem v = swiglu_grad_elem<T>(to_float(h1[f]), to_float(h1[F + f]), g,
                                                   silu_grad, rounding, fused_grad);
      H[r * F + f] = from_float<T>(v.H);
      d1[f] = from_float<T>(v.dh1);
      d1[F + f] = from_float<T>(v.dh3);
    }
  }
};

/// The input gradient of the unfused SwiGLU backward (docs/contract.md §13): x
/// feeds two GEMMs, whose gradients a and b (each already rounded, in T) are
/// added in fp32 and rounded to T once: out[i] = round(float(a[i]) +
/// float(b[i])), elements in chunks of kChunk (as RoundBody). With In =
/// float, the fused backward's dX on a device: a and b the fp32 partial sums
/// of the two halves of its 2F-long accumulation, one rounding at the end.
template <class T, class In = T>
struct GradSumBody {
  const In* a;
  const In* b;
  T* out;
  int64_t n;
  static constexpr int64_t kChunk = 4096;  // device.h's kChunk: callers run chunks(n) items
  MOEV_HD void operator()(int64_t c, int lane, int lanes) const {
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    for (int64_t i = c * kChunk + lane; i < end; i += lanes) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
  }
};

/// Planted faults of the router backward (docs/frameworks.md §13 router): the
/// route_norm denominator taken as a constant (its gradient detached), or the
/// softmax Jacobian taken as its diagonal s (1 - s) alone.
enum class RouterGradFault : uint8_t { none, norm_detached, softmax_diagonal };

/// The router backward's score steps for token t (docs/contract.md §13,
/// router), in fp32, one thread per token: E is small and every step is a
/// reduction over the token's K or E values. From the gradient g of the top-K
/// scores: gp_k = g_k * route_scale; under route_norm, with the selected
/// scores s_k, den = (sum_k s_k) + 1e-20 (the forward's sum) and
/// q = (sum_k gp_k s_k) / (den * den), gs_k = gp_k / den - q; else gs_k = gp_k.
/// grad_scores[t, ids_k] = gs_k (sums in ascending k), 0 elsewhere. Then
/// grad_logits = gs * (s * (1 - s)) (sigmoid), or s * (gs - P) with
/// P = sum_e gs_e s_e in ascending e (softmax).
/// Held scores (router.score_dtype act, docs/contract.md §14): the scores'
/// gradients are those of act tensors, so gp_k = hold(g_k * route_scale),
/// den = hold(hold(sum_k s_k) + 1e-20) (the forward's held denominator) and
/// gs_k = hold(gp_k / den - q); grad_logits is rounded to act too where the
/// logits are an act tensor (`hold_logits`: the act gate).
struct RouterGradBody {
  static constexpr bool kThreadPerItem = true;
  const float* scores;     // (T, E)
  const int32_t* ids;      // (T, K)
  const float* grad_topk;  // (T, K)
  float* grad_scores;      // (T, E)
  float* grad_logits;      // (T, E)
  int E, K;
  float route_scale;
  ScoreFunc score;
  RouteNorm norm;
  RouterGradFault fault = RouterGradFault::none;
  ScoreHeld held = ScoreHeld::fp32;
  bool hold_logits = false;

  MOEV_HD float hold(float v) const { return hold_as(held, v); }

  MOEV_HD void operator()(int64_t t, int, int) const {
    const float* s = scores + t * E;
    const int32_t* id = ids + t * K;
    const float* g = grad_topk + t * K;
    float* gs = grad_scores + t * E;
    float* gl = grad_logits + t * E;
    for (int e = 0; e < E; ++e) gs[e] = 0.f;
    float den = 0.f, dot = 0.f;
    if (norm == RouteNorm::on) {
      for (int k = 0; k < K; ++k) den += id[k] >= 0 && id[k] < E ? s[id[k]] : 0.f;
      den = hold(hold(den) + 1e-20f);
      for (int k = 0; k < K; ++k) dot += id[k] >= 0 && id[k] < E ? hold(g[k] * route_scale) * s[id[k]] : 0.f;
    }
    const float q = fault == RouterGradFault::norm_detached ? 0.f : dot / (den * den);
    for (int k = 0; k < K; ++k) {
      if (id[k] < 0 || id[k] >= E) continue;
      const float gp = hold(g[k] * route_scale);
      gs[id[k]] = hold(gs[id[k]] + (norm == RouteNorm::on ? gp / den - q : gp));
    }
    const bool diagonal = score == ScoreFunc::sigmoid || fault == RouterGradFault::softmax_diagonal;
    float P = 0.f;
    if (!diagonal)
      for (int e = 0; e < E; ++e) P += gs[e] * s[e];
    for (int e = 0; e < E; ++e) {
      const float v = diagonal ? gs[e] * (s[e] * (1.f - s[e])) : s[e] * (gs[e] - P);
      gl[e] = hold_logits ? hold(v) : v;
    }
  }
};

/// The gate weight's gradient, row e (docs/contract.md §13, router):
/// grad_wg[e, d] = round_T(sum_t a[t, e] x[t, d]), the sum in fp32 into
/// `acc` (t ascending), a the grad_logits (rounded to T first under the act
/// gate), the result rounded once to T: the gradient of the act weight. A
/// token with a == 0 adds nothing (most of them under sigmoid: only the K
/// chosen experts have a gradient) and is skipped. Lanes over d.
template <class T>
struct GateGradBody {
  const float* grad_logits;  // (tokens, E)
  const T* x;                // (tokens, D)
  float* acc;                // (E, D) fp32 scratch
  T* grad_wg;                // (E, D)
  int64_t tokens, D;
  int E;
  bool act_gate;

  MOEV_HD void operator()(int64_t e, int lane, int lanes) const {
    float* o = acc + e * D;
    for (int64_t d = lane; d < D; d += lanes) o[d] = 0.f;
    for (int64_t t = 0; t < tokens; ++t) {
      float a = grad_logits[t * E + e];
      if (act_gate) a = round_to<T>(a);
      if (a == 0.f) continue;
      const T* xr = x + t * D;
      for (int64_t d = lane; d < D; d += lanes) o[d] += a * to_float(xr[d]);
    }
    for (int64_t d = lane; d < D; d += lanes) grad_wg[e * D + d] = from_float<T>(o[d]);
  }
};

/// The router's share of x's gradient, row t (docs/contract.md §13, router):
/// grad_x[t, d] = round_T(sum_e a[t, e] wg[e, d]) in fp32, e ascending, a as
/// in GateGradBody (zero terms skipped). Lanes over d.
template <class T>
struct GateInputGradBody {
  const float* grad_logits;  // (tokens, E)
  const T* wg;               // (E, D)
  T* grad_x;                 // (tokens, D)
  int64_t D;
  int E;
  bool act_gate;

  MOEV_HD void operator()(int64_t t, int lane, int lanes) const {
    const float* gl = grad_logits + t * E;
    for (int64_t d = lane; d < D; d += lanes) {
      float acc = 0.f;
      for (int e = 0; e < E; ++e) {
        const float a = act_gate ? round_to<T>(gl[e]) : gl[e];
        if (a != 0.f) acc += a * to_float(wg[int64_t(e) * D + d]);
      }
      grad_x[t * D + d] = from_float<T>(acc);
    }
  }
};

}  // namespace moev::k
