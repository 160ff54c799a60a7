// The reference of FP8 dispatch (docs/contract.md §16): e4m3fn encoding and
// decoding written from the value formula (not the bit manipulation of
// core/dtype.h that the fast path uses), the per-token block quantisation and
// the dequantisation. Like the rest of reference/, it never includes kernels/.
#pragma once

#include <cstdint>
#include <vector>

#include "reference.h"

namespace ref {

/// The value of an e4m3fn byte: (8 + m) * 2^(e - 10) for exponent field
/// e >= 1, m * 2^-9 for e = 0, NaN for 0x7F and 0xFF; bit 7 the sign.
double e4m3_value(uint8_t b);

/// The e4m3fn byte of v: the nearest value, ties to the even mantissa; a
/// magnitude above 448 (infinity included) gives +-448; NaN gives 0x7F; the
/// sign bit is v's (a value that rounds to zero keeps it).
uint8_t e4m3_encode(float v);

struct Fp8Spec {
  int64_t block = 128;
  bool ue8m0 = false;       // s rounded up to a power of two
  bool amax_ratio = false;  // quotient x * (448 / amax), else x * (1 / s)
  bool divide = false;      // quotient x / s (one fp32 division), else as above
  float clamp = 1e-4f;      // the amax clamp, in fp32
};

struct Fp8Rows {
  Bytes q;    // (rows, D) e4m3 bytes
  Vec scale;  // (rows, D / block)
};

/// Quantises `rows` rows of D values (act values held as floats), block by
/// block in the order of docs/contract.md §16.
Fp8Rows fp8_quantise(const Fp8Spec& spec, const Vec& x, int64_t rows, int64_t D);

/// round_act(fp32(float(q) * s)) for every element, s its block's scale.
Vec fp8_dequantise(Act act, const RowsRef& q, const RowsRef& scale, int64_t D, int64_t block);

/// The end-to-end FP8 error (docs/contract.md §16 "End to end"): the largest
/// |x' - x| of each element of `rows` rows of D values quantised with `spec`
/// and dequantised in `act`: u8 * max(|x|, 2^-6 * s) with s the element's
/// block scale and u8 = 2^-4 + 2^-6 (e4m3's unit roundoff with the fp32 and
/// act roundings around it folded in).
Vec fp8_input_error(const Fp8Spec& spec, const Vec& x, int64_t rows, int64_t D);

/// A bound on |Y(X') - Y(X)| of expert-major rows (expert j owns counts[j]
/// rows) whose elements moved by at most E (same layout): E itself for
/// identity experts; for SwiGLU (W1, W3: (E_l, F, D), W2: (E_l, D, F)),
/// with d1 = E |W1|^T, d3 = E |W3|^T and L = 1.1 >= max |silu'|,
/// |dH| <= L d1 (|h3| + d3) + (|silu(h1)| + L d1) d3 (no linearisation),
/// then |dY| <= |dH| |W2|^T.
Vec fp8_expert_error(bool swiglu, const Vec& X, const Vec& E, const Counts& counts, int64_t D, int64_t F,
                     const Vec& W1, const Vec& W3, const Vec& W2);

/// The combine of row errors: out_err[t] = sum over dispatch rows i of token
/// t of |score_sorted[i]| (1 + 2^-7) * row_err[i] (the factor covers a score
/// rounded to act), layout (T, D).
Vec fp8_combine_error(const Vec& row_err, const Ids& token_sorted, const Vec& score_sorted, int64_t T, int64_t D);

}  // namespace ref
