// Single-source kernel bodies of the backward token path (CONTRACT §13,
// FRAMEWORKS §13), in the style of kernels/bodies.h: functors over an index
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

/// Combine backward for dispatch row i (CONTRACT §13, FRAMEWORKS §13 "score
/// multiply"): the gradient of routed_output row i is the upstream gradient
/// of its token, times the row's score under after_experts:
///   grad_rows[i] = round(float(G[token_sorted[i]]) * s_i)
/// with s_i the fp32 score, or the score rounded to T under ScoreMultiply::act
/// (the forward multiplied by that value). Under before_experts the score
/// multiply sits at dispatch, and the row is G[token] unchanged.
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
    const T* g = grad_out + int64_t(token_sorted[i]) * D;
    T* dst = grad_rows + i * D;
    if (apply == ScoreApply::before_experts) {
      copy_row(dst, g, D, lane, lanes);
      return;
    }
    const float s = smul == ScoreMultiply::act ? round_to<T>(score_sorted[i]) : score_sorted[i];
    for (int64_t c = lane; c < D; c += lanes) dst[c] = from_float<T>(to_float(g[c]) * s);
  }
};

/// Score gradient of assignment a = t*K + k (FRAMEWORKS §13): the dot product
/// of the token-indexed row t of `token_rows` with dispatch row row_of[a] of
/// `dispatch_rows`, summed in fp32 in ascending column order, each product an
/// exact fp32 product of the two activation values; rounded to T at the end
/// under ScoreMultiply::act (the forward multiplied by the score in T, whose
/// gradient autograd reduces in T and widens back). Under after_experts the
/// token rows are grad_out and the dispatch rows routed_output; under
/// before_experts x and the gradient of routed_input. One thread per
/// assignment: a reduction, and D is small next to the row traffic.
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

  MOEV_HD void operator()(int64_t a, int lane, int) const {
    if (lane != 0) return;
    const T* u = token_rows + (a / K) * D;
    const T* v = dispatch_rows + int64_t(row_of[a]) * D;
    float sum = 0.f;
    for (int64_t c = 0; c < D; ++c) {
      float p = to_float(u[c]) * to_float(v[c]);
      if (products == ProductRounding::act) p = round_to<T>(p);
      sum += p;
    }
    grad_scores[a] = smul == ScoreMultiply::act ? round_to<T>(sum) : sum;
  }
};

}  // namespace moev::k
