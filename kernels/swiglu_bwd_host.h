// Fast host backward of the SwiGLU experts (docs/contract.md §8, §13): the input and
// weight gradients of experts_swiglu for the loss <Y, dY>.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "host_exec.h"
#include "moe_host.h"

namespace moev {

/// Expert j owns counts[j] consecutive rows of X and dY (rows, D), in dt.
/// W1, W3: (E_l, F, D); W2: (E_l, D, F), in dt. Writes dX (rows, D) in dt and
/// the weight gradients dW1, dW3 (E_l, F, D), dW2 (E_l, D, F) as fp32 values.
/// Default conventions (ref::swiglu_experts_backward states the contract):
/// h1, h3, H as the forward; dH = round(dY W2_j); dh3 = round(dH silu(h1));
/// dh1 = round(dH h3 silu'(h1)); dX = round(dh1 W1_j + dh3 W3_j) with one
/// fp32 accumulation; dW1_j = dh1^T X_j, dW3_j = dh3^T X_j, dW2_j = dY_j^T H_j
/// in fp32. Under experts.rounding torchtitan or experts.compute_dtype bf16
/// (conv), autograd's rounding points (ref::swiglu_backward_autograd): the
/// operands rounded to the compute dtype, silu(h1) and dH h3 rounded, dX
/// from two GEMMs each rounded then summed in fp32, weight gradients rounded
/// to the compute dtype and then dt. Each output element is one fp32 sum in
/// a fixed order: the work is split over row tiles and weight-gradient row
/// tiles of a fixed size, so the results do not depend on ctx.threads. An
/// expert with no rows gets weight gradients of exactly 0.
/// With conv.row_scale (score_on_hidden, one fp32 score per row, the
/// forward's H' = round(float(H) s)): dH' = round(dY W2_j), the elementwise
/// step from dH = round(float(dH') s), dW2_j = dY_j^T H'_j, and dS (rows)
/// gets each row's score gradient sum_f float(dH') float(H) in fp32, f
/// ascending, unrounded (ref::HiddenScale states the contract).
/// Planted faults: swiglu_bwd_silu_grad takes silu'(h1) as sigmoid(h1);
/// swiglu_bwd_fused_rounding takes the fused formulas for dh1, dh3 under
/// torchtitan; swiglu_bwd_wgrad_fp32 leaves the weight gradients unrounded;
/// hidden_grad_unscaled and score_grad_scaled_hidden (row scales).
void experts_swiglu_backward(const ExecCtx& ctx, DType dt, const void* X, const void* dY, const int64_t* counts,
                             int E_l, int64_t D, int64_t F, const void* W1, const void* W3, const void* W2, void* dX,
                             float* dW1, float* dW3, float* dW2, SwigluConventions conv = {}, float* dS = nullptr);

/// C (m, n) fp32 = A^T B with A (rows, m; row stride lda) and B (rows, n; row
/// stride ldb) in dt: exact fp32 products summed in fp32 (the weight
/// gradients). rows == 0 gives C = 0. On the mirror's device when ctx has
/// one (cuBLAS there); on the host, fixed tiles of C's rows, so the sums do
/// not depend on ctx.threads.
void gemm_tn_f32(const ExecCtx& ctx, DType dt, const void* A, int64_t rows, int64_t m, int64_t lda, const void* B,
                 int64_t n, int64_t ldb, float* C);

}  // namespace moev
