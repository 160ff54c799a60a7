#include "diff.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace moev {

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::PASSED: return "PASSED";
    case Outcome::NOT_SUPPORTED: return "NOT_SUPPORTED";
    case Outcome::NOT_VERIFIED: return "NOT_VERIFIED";
    case Outcome::INCORRECT: return "INCORRECT";
    case Outcome::ERROR: return "ERROR";
  }
  return "?";
}

Outcome worst(Outcome a, Outcome b) { return int(a) > int(b) ? a : b; }

// 0 all passed; 1 a result is wrong; 2 is bad input (main); 3 a stage failed
// to run; 4 something could not be verified; 5 a requested path is unsupported.
int exit_status(Outcome o) {
  switch (o) {
    case Outcome::PASSED: return 0;
    case Outcome::INCORRECT: return 1;
    case Outcome::ERROR: return 3;
    case Outcome::NOT_VERIFIED: return 4;
    case Outcome::NOT_SUPPORTED: return 5;
  }
  return 3;
}

Tolerance default_tolerance(CompareClass cls, DType act) {
  switch (cls) {
    case CompareClass::exact: return {0, 0};
    // the bound is the per-element half-width passed as the error scale
    case CompareClass::rounding: return {1, 0};
    // fp32 logits and scores: fp32 accumulation / fp32 exp against an fp64 reference
    case CompareClass::logits: return {1e-5, 1e-5};
    case CompareClass::scores: return {1e-5, 1e-7};
    // GEMM outputs: PyTorch assert_close-like rtol, applied to the sum of
    // |terms| (CONTRACT §15), so rtol = c * u_act with c about 4 for bf16 and
    // fp16 (an intermediate rounding of h1, h3 or H propagated, and the
    // result's own rounding) and 218 for fp32 (fp32 accumulation over D or F
    // terms against an fp64 reference); atol covers results near zero.
    case CompareClass::gemm:
    case CompareClass::end_to_end:
      switch (act) {
        case DType::fp32: return {1.3e-5, 1e-5};
        case DType::bf16: return {1.6e-2, 1.6e-2};
        case DType::fp16: return {2e-3, 2e-3};
      }
  }
  return {0, 0};
}

double gemm_bound_constant(DType act) {
  const double u = act == DType::fp32 ? std::ldexp(1.0, -24) : act == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  return default_tolerance(CompareClass::gemm, act).rtol / u;
}

Tolerance tolerance_for(const Case& c, CompareClass cls) {
  if (cls == CompareClass::rounding) return default_tolerance(cls, c.dtype);
  auto it = c.tolerance_override.find(cls);
  // GEMMs run in bf16 under experts.compute_dtype bf16 (CONTRACT §14): their
  // outputs, and the combined output built from them, carry bf16 errors.
  const bool bf16_gemm = c.experts.compute_dtype == ComputeDtype::bf16 &&
                         (cls == CompareClass::gemm || cls == CompareClass::end_to_end);
  Tolerance t = default_tolerance(cls, bf16_gemm ? DType::bf16 : c.dtype);
  if (it != c.tolerance_override.end()) {
    if (it->second.rtol) t.rtol = *it->second.rtol;
    if (it->second.atol) t.atol = *it->second.atol;
  }
  return t;
}

namespace {

// Distance in units in the last place of the tensor's own type.
double ulp_distance(ElemType t, double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return INFINITY;
  auto ordered = [&](double v) -> int64_t {
    uint32_t u = 0;
    int bits = 32;
    if (t == ElemType::f32) { const float f = float(v); std::memcpy(&u, &f, 4); }
    else if (t == ElemType::bf16) { u = from_float<bf16>(float(v)).bits; bits = 16; }
    else { u = from_float<fp16>(float(v)).bits; bits = 16; }
    const uint32_t sign = 1u << (bits - 1);
    return (u & sign) ? -int64_t(u & (sign - 1)) : int64_t(u);
  };
  return double(std::llabs(ordered(a) - ordered(b)));
}

bool same_bits(const Tensor& a, const Tensor& b, int64_t i) {
  const size_t eb = elem_bytes(a.type);
  return std::memcmp(static_cast<const uint8_t*>(a.data()) + size_t(i) * eb,
                     static_cast<const uint8_t*>(b.data()) + size_t(i) * eb, eb) == 0;
}

}  // namespace

DiffResult diff_tensors(const Tensor& fast, const Tensor& ref, CompareClass cls, Tolerance tol,
                        const CoordFn& coords, const std::vector<uint8_t>* mask, const Tensor* scale) {
  DiffResult r;
  if (scale && (scale->type != ElemType::f32 || scale->numel() != ref.numel()))
    throw std::logic_error("diff_tensors: the error scale must be f32 with the reference's element count");
  if (fast.type != ref.type || fast.shape != ref.shape) {
    r.structural = std::string("fast ") + elem_name(fast.type) + fast.shape_str() + " vs reference " +
                   elem_name(ref.type) + ref.shape_str();
    r.mismatches = 1;
    return r;
  }
  const bool is_float = fast.type == ElemType::f32 || fast.type == ElemType::bf16 || fast.type == ElemType::f16;
  bool any_nonzero = false;
  const size_t keep = 3;
  for (int64_t i = 0; i < fast.numel(); ++i) {
    if (mask && !(*mask)[size_t(i)]) continue;
    ++r.total;
    const double f = value_at(fast, i), g = value_at(ref, i);
    any_nonzero = any_nonzero || f != 0 || g != 0;
    bool ok;
    if (cls == CompareClass::exact || !is_float) {
      ok = same_bits(fast, ref, i);
    } else if (std::isnan(f) || std::isnan(g)) {
      ok = std::isnan(f) && std::isnan(g);
    } else if (std::isinf(f) || std::isinf(g)) {
      ok = f == g;
    } else {
      const double s = cls == CompareClass::rounding ? (scale ? double(scale->as<float>()[i]) : 0.0)
                       : scale ? std::max(std::fabs(g), double(scale->as<float>()[i]))
                               : std::fabs(g);
      const double bound = tol.atol + tol.rtol * s;
      const double err = std::fabs(f - g);
      ok = err <= bound;
      if (bound > 0) r.max_bound_ratio = std::max(r.max_bound_ratio, err / bound);
      else if (err > 0) r.max_bound_ratio = INFINITY;
    }
    if (is_float && !(std::isnan(f) && std::isnan(g))) {
      const double ad = std::fabs(f - g);
      if (!std::isnan(ad)) {
        r.max_abs = std::max(r.max_abs, ad);
        if (g != 0) r.max_rel = std::max(r.max_rel, ad / std::fabs(g));
      } else {
        r.max_abs = INFINITY;
      }
      r.max_ulp = std::max(r.max_ulp, ulp_distance(fast.type, f, g));
    } else if (!is_float) {
      r.max_abs = std::max(r.max_abs, std::fabs(f - g));
    }
    if (!ok) {
      ++r.mismatches;
      Mismatch m{i, coords ? coords(i) : "[" + std::to_string(i) + "]", f, g};
      if (r.first.size() < keep) r.first.push_back(m);
      else {
        r.last.push_back(m);
        if (r.last.size() > keep) r.last.erase(r.last.begin());
      }
    }
  }
  r.both_all_zero = r.total > 0 && !any_nonzero;
  return r;
}

}  // namespace moev
