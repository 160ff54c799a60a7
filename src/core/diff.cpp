#include "diff.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "parallel_errors.h"

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
    // |terms| (docs/contract.md §15), so rtol = c * u_act with c about 4 for bf16 and
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

namespace {

// --- element access, one overload set per element type -----------------------
// value(): the element as a double (exact for every type but int64 past 2^53,
// as the report has always shown it). raw(): the bits, for bitwise equality.
// ordered(): floats' bits as a signed integer in value order (sign-magnitude
// to two's complement, so -0 and +0 are both 0): ULP distances are
// differences of ordered() values.
inline double value(float v) { return v; }
inline double value(bf16 v) { return to_float(v); }
inline double value(fp16 v) { return to_float(v); }
inline double value(int32_t v) { return v; }
inline double value(int64_t v) { return double(v); }
inline double value(uint8_t v) { return v; }  // e4m3 bytes: the byte (value_text decodes it)
inline uint32_t raw(float v) { return f32_bits(v); }
inline uint16_t raw(bf16 v) { return v.bits; }
inline uint16_t raw(fp16 v) { return v.bits; }
inline int64_t ordered(float v) {
  const uint32_t u = f32_bits(v);
  return (u & 0x80000000u) ? -int64_t(u & 0x7fffffffu) : int64_t(u);
}
inline int64_t ordered(bf16 v) { return (v.bits & 0x8000u) ? -int64_t(v.bits & 0x7fffu) : int64_t(v.bits); }
inline int64_t ordered(fp16 v) { return (v.bits & 0x8000u) ? -int64_t(v.bits & 0x7fffu) : int64_t(v.bits); }

template <class T> constexpr bool kIsFloat = !std::is_integral<T>::value;

/// The magnitude and infinity bit patterns of a float type's raw().
template <class T> struct FloatBits;
template <> struct FloatBits<float> { static constexpr uint32_t abs = 0x7fffffffu, inf = 0x7f800000u; };
template <> struct FloatBits<bf16> { static constexpr uint32_t abs = 0x7fffu, inf = 0x7f80u; };
template <> struct FloatBits<fp16> { static constexpr uint32_t abs = 0x7fffu, inf = 0x7c00u; };

/// How an element passes: bitwise (exact classes, integer tensors);
/// `rounding`: |f - g| <= atol + rtol * scale_i (0 without a scale);
/// `relative`: |f - g| <= atol + rtol * max(|g|, scale_i) (|g| without one).
enum class Rule { bitwise, rounding, relative };

struct Hit {
  int64_t index;
  double fast, ref;
};

/// The mismatches a report keeps, in index order: the first kKeep, and the
/// last kKeep of those after them. Feeding any subsequence that holds every
/// block's own window (first and last kKeep) gives the window of the whole
/// sequence, so per-block windows merge exactly in block order.
struct Window {
  static constexpr int kKeep = 3;
  Hit first[kKeep];
  Hit last[kKeep];  // a ring: last[n_last % kKeep] is the next slot
  int n_first = 0;
  int64_t n_last = 0;

  void add(const Hit& h) {
    if (n_first < kKeep) first[n_first++] = h;
    else last[n_last++ % kKeep] = h;
  }
  template <class F> void each_last(F&& f) const {
    const int64_t n = std::min<int64_t>(n_last, kKeep);
    const int64_t start = n_last <= kKeep ? 0 : n_last % kKeep;
    for (int64_t k = 0; k < n; ++k) f(last[(start + k) % kKeep]);
  }
  template <class F> void each(F&& f) const {
    for (int k = 0; k < n_first; ++k) f(first[k]);
    each_last(f);
  }
};

/// What one block of elements contributes to a DiffResult. Every field merges
/// with an order-free operation (sum, max of non-NaN values, or) except the
/// window, which merges in block order: the result does not depend on the
/// block size or the thread count.
struct Partial {
  int64_t total = 0, mismatches = 0, signed_zeros = 0;
  double max_abs = 0, max_rel = 0, max_ulp = 0, max_bound_ratio = 0;
  bool any_nonzero = false;
  Window window;

  void merge(const Partial& o) {
    total += o.total;
    mismatches += o.mismatches;
    signed_zeros += o.signed_zeros;
    max_abs = std::max(max_abs, o.max_abs);
    max_rel = std::max(max_rel, o.max_rel);
    max_ulp = std::max(max_ulp, o.max_ulp);
    max_bound_ratio = std::max(max_bound_ratio, o.max_bound_ratio);
    any_nonzero = any_nonzero || o.any_nonzero;
    o.window.each([&](const Hit& h) { window.add(h); });
  }
};

/// The typed spans of one comparison. `scale` and `mask` are null when absent.
template <class T> struct Spans {
  const T* fast;
  const T* ref;
  const float* scale;
  const uint8_t* mask;
  Tolerance tol;
  bool zero_sign_free;  // +0 and -0 agree under the bitwise rule (check of outside code)
};

/// Element i, the contract of diff_tensors (diff.h) for one element. Max
/// updates are written std::max(acc, x) so that a NaN x leaves acc as it was.
template <class T, Rule R, bool kScale>
inline void visit(Partial& p, const Spans<T>& s, int64_t i) {
  const T a = s.fast[i], b = s.ref[i];
  const double f = value(a), g = value(b);
  ++p.total;
  p.any_nonzero = p.any_nonzero || f != 0 || g != 0;
  bool ok = true;
  if constexpr (!kIsFloat<T>) {
    ok = a == b;
    p.max_abs = std::max(p.max_abs, std::fabs(f - g));
  } else {
    if constexpr (R == Rule::bitwise) {
      ok = raw(a) == raw(b);
      if (!ok && s.zero_sign_free && f == 0 && g == 0) {
        ok = true;
        ++p.signed_zeros;
      }
    }
    if (std::isnan(f) || std::isnan(g)) {
      // NaN matches NaN whatever its sign and payload, under every rule: the
      // bits of a NaN are the machine's (x86 makes -nan of 0 * inf, a GPU +nan).
      // An element with an infinite half-width is not judged: an overflow
      // within reach may meet its opposite infinity (inf - inf) there.
      ok = std::isnan(f) && std::isnan(g);
      if constexpr (R == Rule::rounding && kScale) ok = ok || std::isinf(s.scale[i]);
      if (!ok) {
        p.max_abs = INFINITY;
        p.max_ulp = INFINITY;
      }
    } else {
      if constexpr (R != Rule::bitwise) {
        if (std::isinf(f) || std::isinf(g)) {
          // An infinite half-width (a sum that may overflow in some order of
          // its additions, docs/contract.md §2) takes an infinity too.
          ok = f == g;
          if constexpr (R == Rule::rounding && kScale) ok = ok || std::isinf(s.scale[i]);
          if (!ok) p.max_bound_ratio = INFINITY;  // an infinity where a finite value was due
        } else {
          double sc;
          if constexpr (R == Rule::rounding) sc = kScale ? double(s.scale[i]) : 0.0;
          else sc = kScale ? std::max(std::fabs(g), double(s.scale[i])) : std::fabs(g);
          const double bound = s.tol.atol + s.tol.rtol * sc;
          const double err = std::fabs(f - g);
          ok = err <= bound;
          if (bound > 0) p.max_bound_ratio = std::max(p.max_bound_ratio, err / bound);
          else if (err > 0) p.max_bound_ratio = INFINITY;
        }
      }
      const double ad = std::fabs(f - g);
      if (!std::isnan(ad)) {
        p.max_abs = std::max(p.max_abs, ad);
        if (g != 0) p.max_rel = std::max(p.max_rel, ad / std::fabs(g));
      } else {
        p.max_abs = INFINITY;  // equal infinities: inf - inf
      }
      p.max_ulp = std::max(p.max_ulp, double(std::llabs(ordered(a) - ordered(b))));
    }
  }
  if (!ok) {
    ++p.mismatches;
    p.window.add(Hit{i, f, g});
  }
}

/// Whether a tolerance rule's bound at finite element i is >= 0 (a NaN or
/// negative bound fails even equal bits).
template <class T, Rule R, bool kScale>
bool bound_valid(const Spans<T>& s, int64_t i) {
  const double g = value(s.ref[i]);
  double sc;
  if constexpr (R == Rule::rounding) sc = kScale ? double(s.scale[i]) : 0.0;
  else sc = kScale ? std::max(std::fabs(g), double(s.scale[i])) : std::fabs(g);
  return s.tol.atol + s.tol.rtol * sc >= 0;
}

/// Element i whose fast and reference bits are equal: adds what visit()
/// would add (see equal_run) and returns true; false, adding nothing, where
/// visit() is needed (a bound that fails equal bits).
template <class T, Rule R, bool kScale>
bool visit_equal(Partial& p, const Spans<T>& s, int64_t i, bool check_bound) {
  if constexpr (!kIsFloat<T>) {
    ++p.total;
    p.any_nonzero = p.any_nonzero || s.ref[i] != 0;
  } else {
    using B = FloatBits<T>;
    const uint32_t mag = raw(s.ref[i]) & B::abs;
    if constexpr (R != Rule::bitwise)
      if (check_bound && mag < B::inf && !bound_valid<T, R, kScale>(s, i)) return false;
    ++p.total;
    p.any_nonzero = p.any_nonzero || mag != 0;
    if (mag == B::inf) p.max_abs = INFINITY;
  }
  return true;
}

/// Every element of [begin, end): equal bits through visit_equal (most
/// elements of a run that memcmp found unequal still are), the rest visit().
template <class T, Rule R, bool kScale>
void walk(Partial& p, const Spans<T>& s, int64_t begin, int64_t end, bool check_bound) {
  for (int64_t i = begin; i < end; ++i) {
    if (s.mask && !s.mask[i]) continue;
    bool same;
    if constexpr (kIsFloat<T>) same = raw(s.fast[i]) == raw(s.ref[i]);
    else same = s.fast[i] == s.ref[i];
    if (!same || !visit_equal<T, R, kScale>(p, s, i, check_bound)) visit<T, R, kScale>(p, s, i);
  }
}

/// [begin, end) whose fast and reference bytes are equal: adds what walk()
/// would add, reading the reference only, and returns true; returns false,
/// adding nothing, where walk() is needed (an element of a tolerance class
/// whose bound is NaN or negative would fail even at equal bits). With equal
/// bits, a compared element adds 0 to every error but an infinity, which adds
/// max_abs = inf (walk() takes inf - inf), and NaN, which adds nothing.
template <class T, Rule R, bool kScale>
bool equal_run(Partial& p, const Spans<T>& s, int64_t begin, int64_t end, bool check_bound) {
  int64_t total = 0;
  if constexpr (!kIsFloat<T>) {
    T any = 0;
    for (int64_t i = begin; i < end; ++i) {
      const bool in = !s.mask || s.mask[i];
      total += in;
      any |= in ? s.ref[i] : T(0);
    }
    p.any_nonzero = p.any_nonzero || any != 0;
  } else {
    using B = FloatBits<T>;
    // Branch-free over the run (the unmasked loop vectorises): an OR of the
    // magnitudes says whether any element is nonzero (NaN included, -0 not),
    // a count says whether any is infinite.
    uint32_t any_mag = 0, n_inf = 0;
    if (!s.mask) {
      total = end - begin;
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t mag = raw(s.ref[i]) & B::abs;
        any_mag |= mag;
        n_inf += mag == B::inf;
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t in = s.mask[i] != 0, mag = in ? raw(s.ref[i]) & B::abs : 0u;
        total += in;
        any_mag |= mag;
        n_inf += mag == B::inf;
      }
    }
    if constexpr (R != Rule::bitwise) {
      if (check_bound) {
        for (int64_t i = begin; i < end; ++i) {
          if ((s.mask && !s.mask[i]) || (raw(s.ref[i]) & B::abs) >= B::inf) continue;
          if (!bound_valid<T, R, kScale>(s, i)) return false;
        }
      }
    }
    p.any_nonzero = p.any_nonzero || any_mag != 0;
    if (n_inf) p.max_abs = INFINITY;
  }
  p.total += total;
  return true;
}

/// Elements per block (the unit of parallel work and of merging) and per
/// run (bytes compared with one memcmp, then rescanned from cache).
constexpr int64_t kBlockBytes = int64_t(1) << 20;
constexpr int64_t kRunBytes = int64_t(1) << 16;

template <class T, Rule R, bool kScale>
Partial compare_block(const Spans<T>& s, int64_t begin, int64_t end, bool check_bound) {
  Partial p;
  const int64_t run = kRunBytes / int64_t(sizeof(T));
  for (int64_t b = begin; b < end; b += run) {
    const int64_t e = std::min(end, b + run);
    const bool same = std::memcmp(s.fast + b, s.ref + b, size_t(e - b) * sizeof(T)) == 0;
    if (!same || !equal_run<T, R, kScale>(p, s, b, e, check_bound)) walk<T, R, kScale>(p, s, b, e, check_bound);
  }
  return p;
}

template <class T, Rule R, bool kScale>
Partial compare(const Spans<T>& s, int64_t n) {
  // A tolerance bound is >= 0 at every element when atol and rtol are finite
  // and >= 0 and no scale enters it; otherwise equal runs check it.
  const bool check_bound = kScale || !(s.tol.atol >= 0 && s.tol.rtol >= 0 && std::isfinite(s.tol.atol) &&
                                       std::isfinite(s.tol.rtol));
  const int64_t block = kBlockBytes / int64_t(sizeof(T));
  const int64_t blocks = (n + block - 1) / block;
  std::vector<Partial> parts(static_cast<size_t>(blocks));
  ParallelErrors errors;  // a block's partial result holds its first mismatches
#pragma omp parallel for schedule(dynamic, 1) if (blocks > 1 && !omp_in_parallel())
  for (int64_t k = 0; k < blocks; ++k) errors.run(k, [&] {
    parts[size_t(k)] = compare_block<T, R, kScale>(s, k * block, std::min(n, (k + 1) * block), check_bound);
  });
  errors.rethrow();
  Partial all;
  for (const Partial& p : parts) all.merge(p);
  return all;
}

template <class T>
Partial compare_typed(const Tensor& fast, const Tensor& ref, CompareClass cls, Tolerance tol,
                      const std::vector<uint8_t>* mask, const Tensor* scale, bool zero_sign_free) {
  const Spans<T> s{fast.as<T>(), ref.as<T>(), scale ? scale->as<float>() : nullptr, mask ? mask->data() : nullptr,
                   tol, zero_sign_free};
  const int64_t n = fast.numel();
  if (!kIsFloat<T> || cls == CompareClass::exact) return compare<T, Rule::bitwise, false>(s, n);
  if (cls == CompareClass::rounding)
    return scale ? compare<T, Rule::rounding, true>(s, n) : compare<T, Rule::rounding, false>(s, n);
  return scale ? compare<T, Rule::relative, true>(s, n) : compare<T, Rule::relative, false>(s, n);
}

}  // namespace

namespace {

/// The bits of value v stored in type t (v is exactly representable there).
uint32_t bits_of(double v, ElemType t) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (t == ElemType::bf16) return u >> 16;
  if (t == ElemType::f16) {
    fp16 h = from_float<fp16>(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  return u;
}

/// Bits mapped to a line where adjacent values are adjacent integers.
int64_t ordered(uint32_t b, int width) {
  const uint32_t sign = 1u << (width - 1);
  return (b & sign) ? -int64_t(b & (sign - 1)) : int64_t(b);
}

}  // namespace

std::string value_text(double v, ElemType t) {
  std::ostringstream o;
  if (t == ElemType::i32 || t == ElemType::i64) {
    o << int64_t(v);
    return o.str();
  }
  if (t == ElemType::e4m3) {  // v is the byte (value_at)
    const uint8_t b = uint8_t(v);
    o << to_float(e4m3{b}) << " (0x" << std::hex << std::setw(2) << std::setfill('0') << unsigned(b) << ")";
    return o.str();
  }
  o << std::setprecision(t == ElemType::f32 ? 9 : 5) << v << " (0x" << std::hex << std::setw(t == ElemType::f32 ? 8 : 4)
    << std::setfill('0') << bits_of(v, t) << ")";
  return o.str();
}

int64_t ulp_distance(double a, double b, ElemType t) {
  if (t == ElemType::i32 || t == ElemType::i64) return 0;
  if (t == ElemType::e4m3) {  // bytes: steps between sign-magnitude codes
    const uint8_t x = uint8_t(a), y = uint8_t(b);
    if ((x & 0x7f) == 0x7f || (y & 0x7f) == 0x7f) return -1;
    return std::llabs(ordered(x, 8) - ordered(y, 8));
  }
  if (!std::isfinite(a) || !std::isfinite(b)) return -1;
  const int w = t == ElemType::f32 ? 32 : 16;
  return std::llabs(ordered(bits_of(a, t), w) - ordered(bits_of(b, t), w));
}

DiffResult diff_tensors(const Tensor& fast, const Tensor& ref, CompareClass cls, Tolerance tol,
                        const CoordFn& coords, const std::vector<uint8_t>* mask, const Tensor* scale,
                        bool zero_sign_free) {
  DiffResult r;
  r.type = ref.type;
  if (scale && (scale->type != ElemType::f32 || scale->numel() != ref.numel()))
    throw std::logic_error("diff_tensors: the error scale must be f32 with the reference's element count");
  if (fast.type != ref.type || fast.shape != ref.shape) {
    r.structural = std::string("fast ") + elem_name(fast.type) + fast.shape_str() + " vs reference " +
                   elem_name(ref.type) + ref.shape_str();
    r.mismatches = 1;
    return r;
  }
  if (mask && int64_t(mask->size()) < fast.numel())
    throw std::logic_error("diff_tensors: the mask is shorter than the tensors");
  Partial p;
  switch (fast.type) {
    case ElemType::f32: p = compare_typed<float>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;
    case ElemType::bf16: p = compare_typed<bf16>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;
    case ElemType::f16: p = compare_typed<fp16>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;
    case ElemType::i32: p = compare_typed<int32_t>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;
    case ElemType::i64: p = compare_typed<int64_t>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;
    case ElemType::e4m3: p = compare_typed<uint8_t>(fast, ref, cls, tol, mask, scale, zero_sign_free); break;  // bytes, bitwise
  }
  r.total = p.total;
  r.mismatches = p.mismatches;
  r.signed_zeros = p.signed_zeros;
  r.max_abs = p.max_abs;
  r.max_rel = p.max_rel;
  r.max_ulp = p.max_ulp;
  r.max_bound_ratio = p.max_bound_ratio;
  r.both_all_zero = r.total > 0 && !p.any_nonzero;
  // Coordinates are named for the reported mismatches only.
  auto named = [&](const Hit& h) {
    return Mismatch{h.index, coords ? coords(h.index) : "[" + std::to_string(h.index) + "]", h.fast, h.ref};
  };
  for (int k = 0; k < p.window.n_first; ++k) r.first.push_back(named(p.window.first[k]));
  p.window.each_last([&](const Hit& h) { r.last.push_back(named(h)); });
  return r;
}

}  // namespace moev
