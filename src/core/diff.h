// Comparison of a fast-path tensor against the reference: exact
// for data movement and metadata, the per-dtype tolerance table for GEMM-like
// outputs; mismatch count, max abs / rel / ULP error, and the first and last
// mismatches named in MoE coordinates.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtype.h"
#include "tensor.h"

namespace moev {

struct Tolerance {
  double rtol = 0, atol = 0;
};

/// Comparison classes of the tolerance table. `rounding`: equal up
/// to the act rounding of a value known to a few fp32 ulps (the bound is the
/// per-element half-width the reference gives; not overridable). Their
/// names (case keys, reports): compare_class_table() in config/case.h.
enum class CompareClass { exact, logits, scores, gemm, end_to_end, rounding };

enum class Outcome { PASSED, NOT_SUPPORTED, NOT_VERIFIED, INCORRECT, ERROR };
const char* outcome_name(Outcome o);
Outcome worst(Outcome a, Outcome b);
int exit_status(Outcome o);

/// The tolerance table, one row per (class, activation dtype); a case may
/// override a class (tolerance_for, config/case.h). `exact` is always {0, 0}.
Tolerance default_tolerance(CompareClass cls, DType act);
/// The constant c of the GEMM error bound (docs/contract.md §15): GEMM and
/// end-to-end outputs pass when |fast - ref| <= atol + c * u_act * s with s
/// the sum of |terms| behind the element, so c = rtol / u_act, u_act the unit
/// roundoff of the activation dtype (2^-24 fp32, 2^-8 bf16, 2^-11 fp16).
double gemm_bound_constant(DType act);

struct Mismatch {
  int64_t index = 0;
  std::string coords;
  double fast = 0, ref = 0;
};

/// A value of a tensor of type `t` as a report shows it: floats with every
/// significant digit and their bit pattern ("-3 (0xc040)"), integers plain.
std::string value_text(double v, ElemType t);
/// The distance in units in the last place of type `t` between two finite
/// values of that type (0 for integers); -1 when either is NaN or infinite.
int64_t ulp_distance(double a, double b, ElemType t);

/// Names element i of a tensor in MoE coordinates.
using CoordFn = std::function<std::string(int64_t)>;

struct DiffResult {
  ElemType type = ElemType::f32;  // of the tensors compared: how a mismatch's values are shown
  int64_t total = 0, mismatches = 0;
  int64_t signed_zeros = 0;  // zero_sign_free: elements passed as +0 against -0 (or the reverse)
  double max_abs = 0, max_rel = 0, max_ulp = 0;
  std::vector<Mismatch> first, last;
  bool both_all_zero = false;
  std::string structural;  // non-empty when dtype or shape differ
  /// Largest |fast - ref| / (atol + rtol * scale) over the compared elements
  /// (tolerance classes only): how much of the error bound was used.
  double max_bound_ratio = 0;
};

/// `mask`, when given, selects the elements compared (others are skipped).
/// Tolerance classes pass element i when |fast - ref| <= atol + rtol * s_i,
/// with s_i = max(|ref_i|, scale_i) when `scale` (an f32 tensor of the same
/// element count: the sum of |terms| behind element i, docs/contract.md §15) is given,
/// else |ref_i|; NaN at the same place in both agrees (any sign and payload,
/// in every class), as do equal infinities. Exact classes (and integer
/// tensors) otherwise compare bits; with `zero_sign_free` (`check` of outside
/// code, docs/contract.md §15) +0 and -0 agree there too, counted in
/// DiffResult::signed_zeros. moeverify's own fast paths are held to the bits.
DiffResult diff_tensors(const Tensor& fast, const Tensor& ref, CompareClass cls, Tolerance tol,
                        const CoordFn& coords, const std::vector<uint8_t>* mask = nullptr,
                        const Tensor* scale = nullptr, bool zero_sign_free = false);

}  // namespace moev
