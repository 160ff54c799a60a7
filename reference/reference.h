// The CPU reference (docs/architecture.md idea 1). It uses Eigen and the standard library
// only, never includes kernels/, and loops over experts and tokens in the order
// docs/contract.md states. Activation tensors are std::vector<float> holding
// values already representable in the activation type (bf16/fp16 values are
// exact in fp32), so an exact comparison is a comparison of floats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace ref {

enum class Act { fp32, bf16, fp16 };

namespace detail {
/// 2^k as a double, for -1022 <= k <= 1023 (built from its exponent field:
/// std::ldexp was most of the reference combine's time at D = 7168).
inline double pow2(int k) {
  const uint64_t u = uint64_t(1023 + k) << 52;
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
}  // namespace detail

/// One IEEE round-to-nearest-even of an fp32 value to `act`, computed as
/// arithmetic on the value (independent of the bit-twiddling of the result in
/// kernels/dtype.h): v lies in [2^(e-1), 2^e) with e clamped to act's normal
/// range, so its quantum in act is u = 2^(e-p). C = 1.5 * 2^(e-p+52) is a
/// double whose unit in the last place is u, and |v| < 2^e < C / 2, so the
/// double sum v + C rounds v to a multiple of u, ties to even (the default
/// rounding mode; the build never sets -ffast-math), and subtracting C again
/// is exact. copysign keeps the sign of a result that rounds to zero; past
/// act's largest finite value the result is infinity. Zero, infinities and
/// NaNs come through (a signalling NaN comes back quiet, as from any
/// arithmetic). No branch on the value, so loops over rows vectorise: the
/// reference combine calls it twice per element (round_act_to<act> is the
/// same with act known at compile time). Checked against the
/// kernels' conversion around every 16-bit value in tests/test_numeric.cpp.
template <Act A>
inline float round_act_to(float v) {
  if constexpr (A == Act::fp32) {
    return v;
  } else {
    // significand bits p; the exponent range (frexp convention) of act's normal numbers
    constexpr int p = A == Act::bf16 ? 8 : 11;
    constexpr int emin = A == Act::bf16 ? -125 : -13, emax = A == Act::bf16 ? 128 : 16;
    const double max_finite = A == Act::bf16 ? 255.0 * detail::pow2(120) : 65504.0;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const int e = std::min(std::max(int((bits >> 23) & 0xff) - 126, emin), emax);
    const uint64_t cbits = (uint64_t(int64_t(1023 + 52 - p) + e) << 52) | (uint64_t(1) << 51);
    double C;
    std::memcpy(&C, &cbits, 8);
    const double x = static_cast<double>(v);
    const double r = std::copysign((x + C) - C, x);
    return static_cast<float>(std::fabs(r) > max_finite ? std::copysign(std::numeric_limits<double>::infinity(), x) : r);
  }
}

/// f(std::integral_constant<Act, act>{}): a loop inside f that rounds with
/// round_act_to<decltype(tag)::value> has no branch on act, so it vectorises
/// (a runtime act in the loop body kept the compiler from vectorising it).
template <class F>
decltype(auto) with_act(Act act, F&& f) {
  switch (act) {
    case Act::bf16: return f(std::integral_constant<Act, Act::bf16>{});
    case Act::fp16: return f(std::integral_constant<Act, Act::fp16>{});
    default: return f(std::integral_constant<Act, Act::fp32>{});
  }
}

inline float round_act(Act act, float v) {
  switch (act) {
    case Act::bf16: return round_act_to<Act::bf16>(v);
    case Act::fp16: return round_act_to<Act::fp16>(v);
    default: return v;
  }
}

/// An fp32 operation emulated in fp64 then rounded once to fp32: exact for
/// + - * / because fp64 has more than 2*24+2 significand bits.
inline float f32(double v) { return static_cast<float>(v); }

/// max |round(v') - round(v)| over v' in [v - room, v + room]: how far a
/// value known within `room` of v may land once rounded to act (through fp32).
inline float rounding_halfwidth(Act act, double v, double room) {
  const float mid = round_act(act, f32(v));
  const float lo = round_act(act, f32(v - room)), hi = round_act(act, f32(v + room));
  return std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
}

using Vec = std::vector<float>;
using Ids = std::vector<int32_t>;
using Counts = std::vector<int64_t>;

/// Rows of activations kept as the bytes of their type (4 per element for
/// fp32, 2 for bf16 and fp16). Data movement (dispatch, all-to-all, permute,
/// padding) copies rows without converting them, so the reference of a bf16
/// path holds bf16 bytes, not floats: half the memory, and the copy is the
/// whole cost. Values are decoded only where the contract computes.
using Bytes = std::vector<uint8_t>;
struct RowsRef {
  const uint8_t* data = nullptr;
  int64_t rows = 0;
  size_t row_bytes = 0;
  const uint8_t* row(int64_t i) const { return data + size_t(i) * row_bytes; }
};
inline size_t act_bytes(Act act) { return act == Act::fp32 ? 4 : 2; }
/// The value of one element of type `act` stored at p (IEEE layouts, host
/// byte order; bf16 is the upper half of an fp32). Inline: the reference
/// combine decodes every routed element.
inline float decode_act(Act act, const uint8_t* p) {
  if (act == Act::fp32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (act == Act::bf16) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // fp16: sign, 5 exponent bits (bias 15), 10 fraction bits
  const int ex = (h >> 10) & 31, fr = h & 1023;
  const double m = ex == 0    ? std::ldexp(double(fr), -24)
                   : ex == 31 ? (fr ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity())
                              : std::ldexp(double(1024 + fr), ex - 25);
  return float(h >> 15 ? -m : m);
}
/// Stores v, which must be representable in `act` (round_act first), at p.
void encode_act(Act act, float v, uint8_t* p);

/// Expert weights where they are stored: element i is of type `type` at
/// data + i * act_bytes(type) (the bf16/fp16/fp32 bytes of a weight tensor,
/// or the floats of a Vec, which convert implicitly). The SwiGLU references
/// decode one expert at a time from it, so no fp32 copy of every expert's
/// weights is ever made.
struct WeightView {
  const uint8_t* data = nullptr;
  Act type = Act::fp32;
  WeightView() = default;
  WeightView(const Vec& v) : data(reinterpret_cast<const uint8_t*>(v.data())) {}  // NOLINT: implicit on purpose
  WeightView(const void* p, Act t) : data(static_cast<const uint8_t*>(p)), type(t) {}
  float operator[](size_t i) const { return decode_act(type, data + i * act_bytes(type)); }
  /// Elements [at, at + n) into out, the type switch outside the loop (which vectorises).
  void decode(size_t at, int64_t n, float* out) const {
    with_act(type, [&](auto t) {
      for (int64_t i = 0; i < n; ++i) out[i] = decode_act(t.value, data + (at + size_t(i)) * act_bytes(t.value));
    });
  }
};

enum class Score { softmax, sigmoid };
enum class Selection { topk, force_load_balance };

struct RouterSpec {
  int E = 0, K = 0, groups = 1, limited_groups = 1;
  Score score = Score::softmax;
  Selection selection = Selection::topk;
  bool route_norm = false;
  float route_scale = 1.f;
  /// docs/contract.md §14 `router.score_dtype`: the type the scores and what
  /// is made of them are held in. Act::fp32 is the default contract; bf16 or
  /// fp16 round the scores, the normalisation's sum and quotient and the
  /// scaled values to it, and (without a bias, when the choice values are
  /// the scores themselves) each group's score.
  Act held = Act::fp32;
  bool bias = false;  // the case has a selection bias (router.bias: on)
};

/// docs/contract.md §14 `router.gate_dtype`: logits kept in fp32, or rounded to act.
enum class GateDtype { fp32, act };
/// docs/contract.md §14 `score_multiply`: the fp32 score, or the score rounded to act.
enum class ScoreMultiply { fp32, act };
/// docs/contract.md §14 `experts.rounding`: H = round(silu(h1) h3) (`fused`), or
/// a = round(silu(h1)), H = round(a h3) (`torchtitan`).
enum class SiluRounding { fused, torchtitan };
/// docs/contract.md §14 `experts.compute_dtype`: GEMMs in act, or X, weights, h13,
/// H and the GEMM result in bf16 and Y rounded to act.
enum class Compute { act, bf16 };

/// logits (T, E) = x (T, D) * wg (E, D)^T accumulated in fp64, rounded to
/// fp32 (and then to `act` under GateDtype::act).
Vec router_logits(const Vec& x, const Vec& wg, int64_t T, int64_t D, int E, GateDtype gate = GateDtype::fp32,
                  Act act = Act::fp32);
/// Error scale of X W^T (docs/contract.md §15): sum_k |x_ik| |w_jk|, (rows, n),
/// as an fp32 GEMM of absolute values made an upper bound of the exact sum
/// (reference/blocked.h), over row blocks on `threads` threads.
Vec gemm_magnitude(const Vec& X, const Vec& W, int64_t rows, int64_t D, int64_t n, int threads = 1);
/// Under GateDtype::act: how far a correct logit round_act(fp32-accumulated
/// x wg^T) may land from router_logits' value, per element: any act rounding
/// of a value within the fp32 accumulation bound (D + 2) 2^-24 sum |x w| of
/// the exact one. Mostly 0, so a missing or extra rounding of the logits fails.
Vec router_logits_halfwidth(const Vec& x, const Vec& wg, int64_t T, int64_t D, int E, Act act);

struct RouterOut {
  Vec scores;        // (T, E) fp32
  Vec choice;        // (T, E) scores + bias, after group masking (-inf)
  Ids ids;           // (T, K) descending choice, ties to the lower id
  Vec topk_scores;   // (T, K)
  Counts counts;     // (E)
};

/// docs/contract.md §1 on given logits; bias has E entries. The composition of the
/// three steps below.
RouterOut route(const RouterSpec& spec, const Vec& logits, const Vec& bias, int64_t T);
/// Step 1: softmax (max subtracted, fp64) or sigmoid, rounded to fp32. (T, E).
Vec router_scores(const RouterSpec& spec, const Vec& logits, int64_t T);
/// Steps 2-4 and 6 on given scores: choice = scores + bias in fp32, group
/// masking (-inf), ids (T, K) by descending choice, ties to the lower id.
void select_experts(const RouterSpec& spec, const Vec& scores, const Vec& bias, int64_t T, Vec& choice, Ids& ids);
/// Steps 5, 7, 8 for given ids: the unbiased scores at ids, normalised and
/// scaled. An id outside [0, E) gives NaN (it can match nothing).
Vec topk_scores_for(const RouterSpec& spec, const Vec& scores, const Ids& ids, int64_t T);

/// Under a held type other than fp32 (docs/contract.md §14 `router.score_dtype`),
/// the per-element half-widths of the class `rounding` (docs/contract.md,
/// comparison classes). router_scores_halfwidth: how far a held score may land
/// from router_scores' value when the fp32 score it rounds is known within
/// rtol |s| + atol (the scores tolerance) of the exact one.
/// topk_scores_halfwidth: how far topk_scores_for's value may land when the
/// fp32 sum of the K held scores and the fp32 quotient are each a few ulps
/// off (another summation order), the held denominator included. Both
/// mostly 0, so a missing or extra rounding fails.
Vec router_scores_halfwidth(const RouterSpec& spec, const Vec& logits, int64_t T, double rtol, double atol);
/// With `score_half` (T, E), each score is known only within it (the
/// reference's scores standing for ones the implementation did not write):
/// that spread is carried through the chain too.
Vec topk_scores_halfwidth(const RouterSpec& spec, const Vec& scores, const Ids& ids, int64_t T,
                          const Vec* score_half = nullptr);
/// fp32 scores (router.score_dtype fp32): how far topk_scores_for's value
/// may land when each score is known only within rtol |s| + atol (the
/// scores tolerance), carried through steps 7 and 8 by interval bounds
/// (a numerator up with the other terms down, and the reverse) plus K + 4
/// fp32 ulps of the result (the chain's own roundings). Without route_norm it is route_scale times
/// the scores' own bound; under route_norm a token whose K scores sum to
/// about atol has an interval as wide as route_scale: its normalised
/// values say nothing the scores did not (softmax and sigmoid scores are
/// never negative: an interval's low end is clamped at 0).
Vec topk_scores_tolerance_halfwidth(const RouterSpec& spec, const Vec& scores, const Ids& ids, int64_t T, double rtol,
                                    double atol);

enum class ScoreApply { after_experts, before_experts };

struct LocalDispatch {
  Bytes routed;        // (N, D) in act: expert-major, ascending token inside an expert
  Ids token_sorted;    // (N)
  Vec score_sorted;    // (N)
  Ids row_of;          // (T*K): dispatch row of assignment a = t*K + k
  Counts counts;       // (E)
};

/// docs/contract.md §2 dispatch: for each expert e ascending, each token t ascending,
/// each k with ids[t,k] == e, emit one row.
LocalDispatch local_dispatch(Act act, ScoreApply apply, RowsRef x, const Ids& ids,
                             const Vec& topk_scores, int64_t T, int64_t D, int K, int E,
                             ScoreMultiply smul = ScoreMultiply::fp32);

/// docs/contract.md §8 SwiGLU over expert-major rows (expert j owns counts[j] rows).
/// W1, W3: (E_l, F, D); W2: (E_l, D, F). GEMMs in fp64, rounded to act.
Vec swiglu_experts(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F,
                   WeightView W1, WeightView W3, WeightView W2);

/// swiglu_experts with its intermediates at the contract's rounding points:
/// h13 (rows, 2F) = [h1 | h3] rounded to act, H (rows, F), Y (rows, D); with
/// bounds, also what swiglu_h13_halfwidth and swiglu_magnitude return, from
/// the same GEMMs.
struct SwigluTrace {
  Vec h13, H, Y;
  Vec h13_halfwidth, magnitude;
};
/// Under Compute::bf16, h13 and H hold bf16 values and Y is the bf16 result
/// rounded to act. Row blocks of each expert run on `threads` threads; the
/// result does not depend on their number (reference/blocked.h). With
/// `row_scale` (one fp32 score per row of X; docs/contract.md §14
/// score_on_hidden) H is H' = round(float(H) * s) of its row, the operand of
/// the W2 GEMM, and the error scale carries the |s|.
SwigluTrace swiglu_experts_traced(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F,
                                  WeightView W1, WeightView W3, WeightView W2,
                                  SiluRounding rounding = SiluRounding::fused, Compute compute = Compute::act,
                                  int threads = 1, bool bounds = false, const float* row_scale = nullptr);

/// The activation H = round_act(silu(h1) * h3) (docs/contract.md §8) of given
/// [h1 | h3] rows, computed in fp64: what H must be given those GEMM outputs.
/// halfwidth[i] is how far a correct fp32 computation may land from H[i]
/// (one act rounding of a value within 2^-20 relative of the exact one; under
/// SiluRounding::torchtitan, either rounding of silu(h1) such a value allows).
/// With `row_scale`, H' = round_act(float(H) * s) of each row (score_on_hidden)
/// and the half-width of what the accepted H give.
Vec swiglu_hidden(Act act, const Vec& h13, int64_t rows, int64_t F, Vec& halfwidth,
                  SiluRounding rounding = SiluRounding::fused, const float* row_scale = nullptr);

/// How far a correct h13 = [round(X W1^T) | round(X W3^T)] (fp32 or better
/// accumulation, docs/contract.md §8) may land from swiglu_experts_traced's h13, per
/// element: any `act` rounding of a value within (D + 2) 2^-24 sum |x w| of
/// the exact product of X and the weights rounded to `act`. Mostly 0 for
/// bf16/fp16, so a wrong rounding of X, the weights or the result fails where
/// the GEMM tolerance would hide it (experts.compute_dtype, docs/contract.md §14).
/// The sum of |x w| is an upper bound from an fp32 GEMM of absolute values
/// (reference/blocked.h), never below the exact one.
Vec swiglu_h13_halfwidth(Act act, const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1,
                         WeightView W3, int threads = 1);

/// What Y must be given the W2 GEMM's operand H (rows, F), expert j owning
/// counts[j] rows (docs/contract.md §8): round_act(round_ca(H W2^T)), the
/// product in fp64 and W2 rounded to `ca` (the compute dtype; `act` but
/// under experts.compute_dtype bf16). halfwidth[i]: how far a correct fp32
/// accumulation may land from Y[i], the images through both roundings of a
/// value within (F + 2) 2^-24 sum |h w| of the exact product, as
/// swiglu_h13_halfwidth for h13. Mostly 0 in bf16 and fp16, so an H left
/// unrounded before the GEMM, or a rounding to ca skipped or added, fails
/// where the GEMM tolerance against the reference would hide it.
Vec swiglu_output_on_hidden(Act act, Act ca, const Vec& H, const Counts& counts, int64_t D, int64_t F, WeightView W2,
                            Vec& halfwidth);


/// Error scale of swiglu_experts (docs/contract.md §15): element (i, j) of expert
/// output is bounded by a multiple of the unit roundoff times
///   M_ij = sum_f Heff_if |W2_jf|,  Heff = |H| + |silu'(h1) h3| m1 + |silu(h1)| m3,
/// with m1 = |X| |W1|^T, m3 = |X| |W3|^T: the sum of the absolute values of
/// every term, with a first-order propagation of the errors of h1 and h3. It
/// is >= |Y| and does not shrink under cancellation. Same layout as the output.
/// h1, h3 are fp64 GEMMs; m1, m3 and the last product are fp32 GEMMs of
/// absolute values made upper bounds (reference/blocked.h).
Vec swiglu_magnitude(const Vec& X, const Counts& counts, int64_t D, int64_t F, WeightView W1, WeightView W3,
                     WeightView W2, int threads = 1, const float* row_scale = nullptr);

/// Gradients of swiglu_experts (reference/swiglu_bwd.cpp): dX (rows, D) in
/// act values; dW1, dW3 (E_l, F, D) and dW2 (E_l, D, F), the weights'
/// layouts, in fp32.
struct SwigluGrads {
  Vec dX;
  Vec dW1, dW3;
  Vec dW2;
  /// With bounds: the half-widths of class rounding of the four
  /// (swiglu_backward_autograd).
  Vec mdX, mdW1, mdW3, mdW2;
  /// With a HiddenScale: each row's score gradient (rows), and with bounds
  /// its half-width.
  Vec dS, mdS;
};
/// The score on the hidden in the backward (docs/contract.md §13, §14
/// score_on_hidden): one score s per row of X, the forward having used
/// H' = round(float(H) s) as the W2 GEMM's operand. Then, per row,
///   dH' = round(dY W2_j)                  (the W2 GEMM's input gradient)
///   dH  = round(float(dH') s)             (the multiply's backward, in H's type)
///   dW2_j = dY_j^T H'_j                   (the operand the forward used)
///   ds  = sum_f float(dH'_f) float(H_f)   (fp32, no rounding per product;
///                                          rounded to act when round_grad)
/// and dh1, dh3, dX from dH as without a score.
struct HiddenScale {
  const float* s = nullptr;  // one per row of X; null: no score on the hidden
  bool round_grad = false;   // the score gradient rounded to act (a held score)
};
/// Backward of swiglu_experts for the loss <Y, dY> (docs/contract.md §13 with §8).
/// Rounding points (the contract of the fast path), per expert j:
///   h1, h3 = round_act(X W1_j^T), round_act(X W3_j^T)   (as the forward)
///   H      = round_act(silu(h1) h3)                     (as the forward)
///   dH     = round_act(dY W2_j)                         (fp32 or better accumulation)
///   dh3    = round_act(dH silu(h1))
///   dh1    = round_act(dH h3 silu'(h1)),  silu'(a) = sig(a) (1 + a (1 - sig(a)))
///   dX     = round_act(dh1 W1_j + dh3 W3_j)             (one accumulation over 2F, one rounding)
///   dW1_j  = dh1^T X_j,  dW3_j = dh3^T X_j,  dW2_j = dY_j^T H_j   (fp32 results, no act rounding)
/// Computed in fp64 from the act-rounded inputs. Under SiluRounding::torchtitan
/// or Compute::bf16 the rules are autograd's. Every convention runs through
/// swiglu_backward_autograd, whose enumeration of the rounding points gives
/// the middle values and, with bounds, the half-widths of class rounding in
/// the m* fields. Experts run on `threads` threads (each expert on one: the
/// result does not depend on their number).
/// `w13_fused`: W1 and W3 are one GEMM (docs/contract.md §14 experts.w13_fused), so
/// dX is one GEMM over 2F under the torchtitan rounding too.
SwigluGrads swiglu_experts_backward(Act act, const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                    WeightView W1, WeightView W3, WeightView W2,
                                    SiluRounding rounding = SiluRounding::fused, Compute compute = Compute::act,
                                    int threads = 1, bool bounds = false, bool w13_fused = false,
                                    HiddenScale hs = {});
/// Backward of swiglu_experts under experts.rounding torchtitan and/or
/// experts.compute_dtype bf16 (docs/contract.md §13, autograd's rounding points), per
/// expert j, with ca the compute dtype (bf16 under Compute::bf16, else act)
/// and round = round_ca:
///   X, dY, W rounded to ca;  h1, h3, H as the forward (§8, §14);
///   dH  = round(dY W2_j)
///   torchtitan: s = round(silu(h1)), ga = round(dH h3), dh3 = round(dH s),
///               dh1 = round(ga silu'(h1));
///   fused:      dh3 = round(dH silu(h1)), dh1 = round(dH h3 silu'(h1));
///   dX  = round_act(round_act(round(dh1 W1_j)) + round_act(round(dh3 W3_j)))
///         (torchtitan: x feeds two GEMMs; the sum in fp32), or
///         round_act(round(dh1 W1_j + dh3 W3_j)) (fused, or w13_fused: one GEMM);
///   dW1 = round_act(round(dh1^T X_j)), dW3 likewise, dW2 = round_act(round(dY_j^T H_j)),
///   but fp32 results under fused with Compute::act (swiglu_experts_backward's rules).
/// In fp64 from the rounded operands. With bounds, the m* fields hold the
/// half-widths of class `rounding` (reference/swiglu_bwd_autograd.cpp): how far
/// an fp32 implementation of these rules may land (in bf16 0 or about one
/// unit in the last place for most elements).
SwigluGrads swiglu_backward_autograd(Act act, const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                     WeightView W1, WeightView W3, WeightView W2, SiluRounding rounding,
                                     Compute compute, int threads = 1, bool bounds = false, bool w13_fused = false,
                                     HiddenScale hs = {});
/// Error scales of swiglu_experts_backward (docs/contract.md §15), same layouts: the
/// sums of |terms| with a first-order propagation of the errors of every
/// rounded intermediate (h1, h3 from |X||W|^T, dH from |dY||W2|, dh1, dh3
/// from those). >= |value|, and it does not shrink under cancellation.
/// fp64 values, fp32 GEMMs of absolute values made upper bounds (reference/blocked.h).
/// With `row_scale` (score_on_hidden) the scales of HiddenScale's dX and
/// weight gradients (|s| carried where dH and H' carry s).
SwigluGrads swiglu_backward_magnitude(const Vec& X, const Vec& dY, const Counts& counts, int64_t D, int64_t F,
                                      WeightView W1, WeightView W3, WeightView W2, int threads = 1,
                                      const float* row_scale = nullptr);

enum class Accumulate { per_add, fp32_accumulate };
enum class SharedAdd { none, add_after };

struct CombineSpec {
  Act act = Act::fp32;
  ScoreApply apply = ScoreApply::after_experts;
  Accumulate acc = Accumulate::per_add;
  SharedAdd shared_add = SharedAdd::none;
  ScoreMultiply smul = ScoreMultiply::fp32;
};

/// docs/contract.md §2 combine: out = init; for i = 0..N-1 ascending,
/// out[token_sorted[i]] (+)= round(routed_out[i] * score_sorted[i]); then
/// out += shared (one rounding) when shared_add == add_after. Computed token
/// by token: each output row gathers its own routed rows in ascending i, the
/// same order of terms per element as the scatter above. `threads` threads
/// take blocks of tokens, so the result does not depend on `threads`.
Vec combine(const CombineSpec& spec, RowsRef routed_out, const Ids& token_sorted,
            const Vec& score_sorted, const Vec& init, const Vec& shared, int64_t T, int64_t D, int threads = 1);

/// Error scale of combine's output given the error scales of its inputs:
/// init + sum over the token's rows of |score| * row scale (no |score| under
/// before_experts, where the score is already inside the row) + the shared
/// expert's scale under add_after, summed in fp64. A row's scale is the
/// |value| of each element of rows_magnitude (type rows_act): the routed rows
/// themselves where the experts are exact, an fp32 scale otherwise. Layout
/// (T, D); `threads` as for combine.
Vec combine_magnitude(const CombineSpec& spec, RowsRef rows_magnitude, Act rows_act, const Ids& token_sorted,
                      const Vec& score_sorted, const Vec& init_magnitude, const Vec& shared_magnitude, int64_t T,
                      int64_t D, int threads = 1);

/// A scatter-add whose additions may come in any order (docs/contract.md §2,
/// combine.order: any): element e of token t sums its initial value, the
/// terms of t's rows in some order (each row times its score, rounded to act,
/// where `multiply`; the row itself otherwise) and, after them, the shared
/// value, as `acc` says.
struct AnyOrderSum {
  Act act = Act::fp32;
  Accumulate acc = Accumulate::per_add;
  bool multiply = true;
  ScoreMultiply smul = ScoreMultiply::fp32;
};

/// How far such a sum in another order can land from `ascending`, the
/// contract's sum in ascending row order (combine's or scatter_add_grad's
/// output), per element: the half-width w of the `rounding` class.
/// - w = 0 where every order adds alike: one term, or two onto a zero start.
/// - per_add: any order lies within e of the exact sum X, e = (g - 1) S +
///   (the shared addition) u (g S + |sh|), g = (1 + u)^n over the n inexact
///   additions (one fewer onto a zero start), u the relative error of an
///   fp32 sum rounded to act, S = |init| + Σ|term|; so w = e + |X + sh -
///   ascending| (the ascending sum is one of them).
/// - fp32_accumulate: the fp32 sum lies in [X - E, X + E], E = ((1 + u32)^n -
///   1) S; rounding to act and adding the shared value are monotone, so the
///   output lies between the images of the ends, and w is the larger distance
///   from `ascending` to them (0 where both ends round to it).
/// - w = ∞ where a partial sum can reach act's overflow (any value but NaN
///   then passes: inf in one order, finite in another).
/// Each rounding may add half an act subnormal spacing. Layout (T, D);
/// `init` and `shared` empty: zeros, none. Throws as combine does on
/// inconsistent inputs.
Vec any_order_halfwidth(const AnyOrderSum& spec, RowsRef rows, const Ids& token_sorted, const Vec& score_sorted,
                        const Vec& init, const Vec& shared, const Vec& ascending, int64_t T, int64_t D);

}  // namespace ref

namespace ref {

/// Global-view EP dispatch (docs/contract.md §3) of each rank's expert-major rows
/// (routed[p]: expert e owns counts[p][e] consecutive rows): rank q receives,
/// for each source p ascending, each local expert j ascending, source p's rows
/// of expert q*E_l + j in their order. Returns per rank q the rank-major rows;
/// recv_counts[q] is (R, E_l): recv_counts[q][p*E_l + j]. only >= 0: the rows
/// of rank `only` alone (every rank's counts still).
struct EpDispatch {
  std::vector<Bytes> recv;  // per rank q: (rows, D) in act, rank-major
  std::vector<Counts> recv_counts;
};
EpDispatch ep_dispatch(const std::vector<RowsRef>& routed, const std::vector<Counts>& counts, int R, int E_l,
                       int only = -1);

/// Rank-major (p, j) rows -> expert-major (j, p) rows of one rank.
Bytes permute_to_expert_major(RowsRef recv, const Counts& recv_counts, int R, int E_l);
/// The inverse: expert-major (j, p) -> rank-major (p, j).
Bytes permute_to_rank_major(RowsRef rows, const Counts& recv_counts, int R, int E_l);

/// Alignment padding (docs/contract.md §4) of expert-major rows with group sizes
/// `counts`: each group's rows, then zero rows up to round_up(count, A) (an
/// empty group gets A rows when empty_align); under empty_align the buffer is
/// round_up(M + E_l*A, A) rows with a zero tail. Returns the rows and writes
/// the padded group sizes. (Zero bytes are +0 in every activation type.)
Bytes pad_groups(RowsRef rows, const Counts& counts, int64_t A, bool empty_align, Counts& padded_sizes);
/// Keeps the first counts[j] rows of each padded group.
Bytes unpad_groups(RowsRef rows, const Counts& counts, const Counts& padded_sizes);

/// Reverse all-to-all (docs/contract.md §3.5): rank p gets back, for each q ascending,
/// the rows q received from p, in the order p sent them. only >= 0: rank
/// `only`'s rows alone.
std::vector<Bytes> ep_return(const std::vector<RowsRef>& recv_out, const std::vector<Counts>& recv_counts, int R,
                             int E_l, int only = -1);

// ---- sequence parallel (docs/contract.md §10; reference/sp.cpp) ----------------------

enum class SpPadding { virtual_, tail };

/// Which token each SP rank holds, found by walking the sequences (not by a
/// local -> global formula). `position[i]` is the place of SP-layout row i
/// (SP rank after SP rank, each rank's local tokens in order) in the padded
/// global sequence of nlt*S rows; position >= T marks a tail pad row.
/// rows_per_rank[s] is SP rank s's row count.
struct SpShard {
  int64_t nlt = 0;
  Counts rows_per_rank;
  Counts position;
};
/// T = B*L tokens (flattened b*L + l) over S SP ranks. virtual: B = 1 ranks
/// take consecutive chunks of nlt = ceil(T/S) tokens of the sequence (the last
/// ones may be short or empty); B > 1 (requires L % S == 0) each rank takes
/// positions [s*L/S, (s+1)*L/S) of every sequence b in turn. tail: the
/// flattened tokens plus (-T) mod S pad rows, cut in S chunks of nlt.
SpShard sp_shard(int64_t T, int64_t B, int64_t S, SpPadding padding);
/// x rows (T, D) -> the SP layout: row i is x[position[i]], zeros for pad rows.
Vec sp_shard_rows(const SpShard& sh, const Vec& x, int64_t T, int64_t D);
/// Combine output in the SP layout -> the global buffer of nlt*S rows
/// (rows nobody holds stay zero); the caller keeps the first T rows.
Vec sp_global_rows(const SpShard& sh, const Vec& out, int64_t S, int64_t D);
/// Tail pad rows (position >= T) routed to expert 0 with score 0 for all K;
/// counts (E) recomputed from the ids.
void sp_route_pad_rows(const SpShard& sh, int64_t T, int K, int E, Ids& ids, Vec& topk_scores, Counts& counts);

/// The overload factor of MoE layer entries (docs/contract.md §12) from the rows
/// each rank received (actual[entry][rank]) and its balanced share
/// (balanced[entry][rank] = T_r * K): per entry max_r actual / (mean balanced
/// + 1e-8), their mean and max, and max_cum, the largest over ranks of the
/// peak prefix sum of actual over that of balanced (+1e-8) along forward
/// entries 1..N then, with `backward`, backward entries N..1 subtracting.
struct OverloadRef {
  std::vector<double> entries;
  double avg = 0, max = 0, max_cum = 0;
};
OverloadRef overload_factors(const std::vector<std::vector<int64_t>>& actual,
                             const std::vector<std::vector<int64_t>>& balanced, bool backward);

/// Capacity dropping (docs/contract.md §11) of one rank's expert-major dispatch
/// (expert e owns counts[e] consecutive rows, ascending token inside it):
/// each expert keeps at most cap rows, in their order: by_probs, the rows of
/// highest score (ties to the lower token index), else the first cap. Kept
/// scores are not renormalised. pad: every expert gets exactly cap rows, the
/// kept ones then zero filler rows with score 0 and token -1. row_of maps
/// each assignment to its new row, -1 where dropped. With `keep` (one flag
/// per input row) the kept rows are those flagged instead: how an outside
/// implementation's choice among rows tied at the boundary is laid out.
///
/// Capacity groups: rows compete for slots only within a group. group[t]
/// is the group of token t (a row of the rank's x, or of the SP layout), -1
/// for a row that takes no slot and is never kept (a tail SP pad row); cap[g]
/// is group g's capacity. Without SP there is one group holding every token.
/// With pad, every expert holds exactly sum(cap) rows.
struct CapacityGroups {
  Ids group;
  Counts cap;
};
struct CapacityDispatch {
  Bytes rows;
  Ids token_sorted;
  Vec score_sorted;
  Ids row_of;
  Counts counts;
};
CapacityDispatch capacity_dispatch(RowsRef rows, const Ids& token_sorted, const Vec& score_sorted, const Ids& row_of,
                                   const Counts& counts, const CapacityGroups& groups, bool by_probs, bool pad,
                                   const std::vector<uint8_t>* keep = nullptr);
/// cap = ceil(n*K/E * factor) for a group of n real tokens (docs/contract.md §11).
int64_t capacity_for(int64_t n, int K, int E, double factor);
/// One group of T tokens: the rank's whole dispatch at sp = 1.
CapacityGroups capacity_groups_one(int64_t T, int K, int E, double factor);
/// The groups of the SP layout (docs/contract.md §11, "Capacity with sequence
/// parallelism"): SP rank s is group s, its cap from the real tokens the
/// shard gives it; a pad row (position >= T) is in no group.
CapacityGroups capacity_groups_sp(const SpShard& sh, int64_t T, int K, int E, double factor);

}  // namespace ref
