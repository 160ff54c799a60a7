// diff_tensors (src/engine/diff.cpp) against a straightforward per-element
// reference written here: one element at a time through value_at, the
// contract of diff.h read literally. The fast diff compares bytes in runs,
// walks typed spans in blocks on several threads and merges the blocks; the
// planted values sit where those pieces meet (first and last element, run and
// block boundaries) and cover NaN, infinities, -0.0, masks and error scales.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "diff.h"

using namespace moev;

namespace {

// The block and run sizes of src/engine/diff.cpp, in bytes: tensors below span
// several blocks and end in a partial run.
constexpr int64_t kBlockBytes = int64_t(1) << 20;
constexpr int64_t kRunBytes = int64_t(1) << 16;

bool is_float(ElemType t) { return t == ElemType::f32 || t == ElemType::bf16 || t == ElemType::f16; }

bool same_bits(const Tensor& a, const Tensor& b, int64_t i) {
  const size_t eb = elem_bytes(a.type);
  return std::memcmp(static_cast<const uint8_t*>(a.data()) + size_t(i) * eb,
                     static_cast<const uint8_t*>(b.data()) + size_t(i) * eb, eb) == 0;
}

/// ULP distance in the tensor's own type, by the value's bits.
double ulps(const Tensor& a, const Tensor& b, int64_t i) {
  auto ord = [&](const Tensor& t) -> int64_t {
    if (t.type == ElemType::f32) {
      const uint32_t u = f32_bits(t.as<float>()[i]);
      return (u >> 31) ? -int64_t(u & 0x7fffffffu) : int64_t(u);
    }
    const uint16_t u = t.as<uint16_t>()[i];
    return (u >> 15) ? -int64_t(u & 0x7fffu) : int64_t(u);
  };
  return double(std::llabs(ord(a) - ord(b)));
}

DiffResult reference_diff(const Tensor& fast, const Tensor& ref, CompareClass cls, Tolerance tol,
                          const std::vector<uint8_t>* mask, const Tensor* scale) {
  DiffResult r;
  const bool fl = is_float(fast.type);
  bool any_nonzero = false;
  int64_t seen = 0;
  for (int64_t i = 0; i < fast.numel(); ++i) {
    if (mask && !(*mask)[size_t(i)]) continue;
    ++r.total;
    const double f = value_at(fast, i), g = value_at(ref, i);
    const bool f_nan = std::isnan(f), g_nan = std::isnan(g);
    if (f != 0 || g != 0) any_nonzero = true;
    bool ok;
    if (fl && (f_nan || g_nan)) {
      ok = f_nan && g_nan;  // any NaN matches any NaN, exact class too (sign and payload are the machine's)
    } else if (cls == CompareClass::exact || !fl) {
      ok = same_bits(fast, ref, i);
    } else if (std::isinf(f) || std::isinf(g)) {
      // an infinite rounding half-width takes an infinity too
      ok = f == g || (cls == CompareClass::rounding && scale && std::isinf(scale->as<float>()[i]));
      if (!ok) r.max_bound_ratio = INFINITY;
    } else {
      const double sc_i = scale ? double(scale->as<float>()[i]) : 0.0;
      double s;
      if (cls == CompareClass::rounding) s = sc_i;
      else if (scale && sc_i > std::fabs(g)) s = sc_i;
      else s = std::fabs(g);
      const double bound = tol.atol + tol.rtol * s;
      const double err = std::fabs(f - g);
      ok = err <= bound;
      if (bound > 0) {
        if (err / bound > r.max_bound_ratio) r.max_bound_ratio = err / bound;
      } else if (err > 0) {
        r.max_bound_ratio = INFINITY;
      }
    }
    if (!fl) {
      r.max_abs = std::max(r.max_abs, std::fabs(f - g));
    } else if (f_nan != g_nan) {
      r.max_abs = INFINITY;
      r.max_ulp = INFINITY;
    } else if (!f_nan) {
      if (std::isinf(f) && f == g) {
        r.max_abs = INFINITY;  // inf - inf is NaN: reported as an infinite error
      } else {
        const double ad = std::fabs(f - g);
        r.max_abs = std::max(r.max_abs, ad);
        if (g != 0 && ad / std::fabs(g) > r.max_rel) r.max_rel = ad / std::fabs(g);
      }
      r.max_ulp = std::max(r.max_ulp, ulps(fast, ref, i));
    }
    if (!ok) {
      ++r.mismatches;
      const Mismatch m{i, "<" + std::to_string(i) + ">", f, g};
      if (seen++ < 3) r.first.push_back(m);
      else r.last.push_back(m);
    }
  }
  if (r.last.size() > 3) r.last.erase(r.last.begin(), r.last.end() - 3);
  r.both_all_zero = r.total > 0 && !any_nonzero;
  return r;
}

bool same_num(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void require_same(const DiffResult& got, const DiffResult& want) {
  CHECK(got.structural == want.structural);
  CHECK(got.total == want.total);
  CHECK(got.mismatches == want.mismatches);
  CHECK(same_num(got.max_abs, want.max_abs));
  CHECK(same_num(got.max_rel, want.max_rel));
  CHECK(same_num(got.max_ulp, want.max_ulp));
  CHECK(same_num(got.max_bound_ratio, want.max_bound_ratio));
  CHECK(got.both_all_zero == want.both_all_zero);
  auto same_list = [](const std::vector<Mismatch>& a, const std::vector<Mismatch>& b) {
    REQUIRE(a.size() == b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      CHECK(a[k].index == b[k].index);
      CHECK(a[k].coords == b[k].coords);
      CHECK(same_num(a[k].fast, b[k].fast));
      CHECK(same_num(a[k].ref, b[k].ref));
    }
  };
  same_list(got.first, want.first);
  same_list(got.last, want.last);
}

/// Writes the float v into element i of a float tensor (rounded to its type).
void put(Tensor& t, int64_t i, float v) {
  switch (t.type) {
    case ElemType::f32: t.as<float>()[i] = v; break;
    case ElemType::bf16: t.as<bf16>()[i] = from_float<bf16>(v); break;
    case ElemType::f16: t.as<fp16>()[i] = from_float<fp16>(v); break;
    case ElemType::i32: t.as<int32_t>()[i] = int32_t(v); break;
    case ElemType::i64: t.as<int64_t>()[i] = int64_t(v); break;
  }
}

/// The indices where the fast diff's pieces meet, for n elements of eb bytes.
std::vector<int64_t> seams(int64_t n, size_t eb) {
  std::vector<int64_t> at = {0, 1, n - 2, n - 1};
  for (int64_t unit : {kRunBytes / int64_t(eb), kBlockBytes / int64_t(eb)})
    for (int64_t k = unit; k < n && k <= 3 * unit; k += unit) {
      at.push_back(k - 1);
      at.push_back(k);
    }
  return at;
}

enum class Plant { small, large, nan_fast, nan_both, inf_both, inf_fast, inf_signs, neg_zero, bits };

/// Changes element i of `fast` (and of `ref` for planted pairs) by `kind`.
void plant(Tensor& fast, Tensor& ref, int64_t i, Plant kind) {
  const double g = value_at(ref, i);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  if (!is_float(fast.type)) {
    put(fast, i, float(g + (kind == Plant::small ? 1 : -1000)));
    return;
  }
  switch (kind) {
    case Plant::small: put(fast, i, float(g * (1 + 1e-3) + 1e-6)); break;
    case Plant::large: put(fast, i, float(g * 3 + 1)); break;
    case Plant::nan_fast: put(fast, i, nan); break;
    case Plant::nan_both: put(fast, i, nan); put(ref, i, -nan); break;
    case Plant::inf_both: put(fast, i, -inf); put(ref, i, -inf); break;
    case Plant::inf_fast: put(fast, i, inf); break;
    case Plant::inf_signs: put(fast, i, inf); put(ref, i, -inf); break;
    case Plant::neg_zero: put(fast, i, -0.0f); put(ref, i, 0.0f); break;
    case Plant::bits: {  // one ULP (or a NaN payload): the lowest bit flipped
      uint8_t* p = static_cast<uint8_t*>(fast.data()) + size_t(i) * elem_bytes(fast.type);
      *p ^= 1u;
      break;
    }
  }
}

Tensor random_tensor(ElemType t, int64_t n, std::mt19937_64& rng) {
  Tensor x = Tensor::alloc(t, {n}, 0);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_int_distribution<int> small_int(-50, 50);
  for (int64_t i = 0; i < n; ++i) put(x, i, is_float(t) ? normal(rng) : float(small_int(rng)));
  return x;
}

struct Setup {
  ElemType type;
  int64_t n;
};

/// Compares fast with ref under every class, with and without a mask and an
/// error scale; `thorough` adds the scores class and tolerances of zero and of
/// a custom size.
void compare_all_ways(const Tensor& fast, const Tensor& ref, std::mt19937_64& rng, bool thorough = true) {
  const int64_t n = fast.numel();
  std::vector<uint8_t> mask(static_cast<size_t>(n));
  for (auto& m : mask) m = uint8_t(rng() % 4 != 0);
  mask[0] = 0;
  mask[size_t(n - 1)] = 1;
  Tensor scale = random_tensor(ElemType::f32, n, rng);
  for (int64_t i = 0; i < n; ++i) scale.as<float>()[i] = std::fabs(scale.as<float>()[i]);
  const CoordFn coords = [](int64_t i) { return "<" + std::to_string(i) + ">"; };
  for (CompareClass cls : {CompareClass::exact, CompareClass::rounding, CompareClass::scores, CompareClass::gemm}) {
    if (!thorough && cls == CompareClass::scores) continue;  // the rule of gemm, another tolerance
    std::vector<Tolerance> tols = {default_tolerance(cls, DType::bf16)};
    if (thorough) tols.insert(tols.end(), {Tolerance{0, 0}, Tolerance{2e-3, 1e-4}});
    for (const Tolerance tol : tols) {
      for (int use_mask = 0; use_mask < 2; ++use_mask) {
        for (int use_scale = 0; use_scale < 2; ++use_scale) {
          if (use_scale && cls == CompareClass::exact) continue;
          const std::vector<uint8_t>* m = use_mask ? &mask : nullptr;
          const Tensor* sc = use_scale ? &scale : nullptr;
          INFO("class " << int(cls) << " rtol " << tol.rtol << " atol " << tol.atol << " mask " << use_mask << " scale "
                        << use_scale);
          require_same(diff_tensors(fast, ref, cls, tol, coords, m, sc), reference_diff(fast, ref, cls, tol, m, sc));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("diff_tensors equals a per-element reference at planted seams", "[cpu][diff]") {
  const uint64_t seed = 20261123;
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16, ElemType::i32, ElemType::i64}) {
    const size_t eb = elem_bytes(t);
    // One small run, or a full block and a partial block that ends in a partial run.
    for (int64_t n : {int64_t(37), kBlockBytes / int64_t(eb) + kRunBytes / int64_t(eb) * 3 / 2 + 5}) {
      const bool thorough = n < 100;
      const Tensor ref = random_tensor(t, n, rng);
      {
        INFO("type " << elem_name(t) << " n " << n << " equal");
        compare_all_ways(ref.clone(), ref, rng, thorough);
      }
      for (Plant kind : {Plant::small, Plant::large, Plant::nan_fast, Plant::nan_both, Plant::inf_both,
                         Plant::inf_fast, Plant::inf_signs, Plant::neg_zero, Plant::bits}) {
        if (!is_float(t) && kind != Plant::small && kind != Plant::large) continue;
        if (!thorough && (kind == Plant::small || kind == Plant::nan_fast || kind == Plant::inf_fast)) continue;
        INFO("type " << elem_name(t) << " n " << n << " planted " << int(kind));
        Tensor fast = ref.clone(), r = ref.clone();
        for (int64_t i : seams(n, eb)) plant(fast, r, i, kind);
        compare_all_ways(fast, r, rng, thorough);
      }
      {
        INFO("type " << elem_name(t) << " n " << n << " every element differs");
        Tensor fast = ref.clone(), r = ref.clone();
        for (int64_t i = 0; i < n; ++i) plant(fast, r, i, i % 7 ? Plant::small : Plant::bits);
        for (int64_t i : seams(n, eb)) plant(fast, r, i, Plant::large);
        compare_all_ways(fast, r, rng, thorough);
      }
    }
  }
}

TEST_CASE("diff_tensors all-zero verdicts match the reference", "[cpu][diff]") {
  std::mt19937_64 rng(7);
  const int64_t n = 3 * kRunBytes / 2 + 3;
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16, ElemType::i32, ElemType::i64}) {
    INFO("type " << elem_name(t));
    Tensor zero = Tensor::alloc(t, {n}, 0);
    compare_all_ways(zero.clone(), zero, rng);
    if (is_float(t)) {
      Tensor neg = zero.clone();
      for (int64_t i = 0; i < n; i += 3) put(neg, i, -0.0f);
      compare_all_ways(neg, neg.clone(), rng);  // -0.0 is zero
      compare_all_ways(neg, zero, rng);         // and differs bitwise from +0.0
    }
    Tensor one = zero.clone();
    put(one, n - 1, 1.0f);
    compare_all_ways(one.clone(), one, rng);  // the last element alone is nonzero
  }
}

TEST_CASE("diff_tensors equal bits with a NaN or negative bound match the reference", "[cpu][diff]") {
  // An element whose bound atol + rtol * s is NaN (rtol 0 times an infinite
  // scale, a NaN scale) or negative fails even with equal bits.
  std::mt19937_64 rng(11);
  const int64_t n = kRunBytes / 2 + 9;
  const CoordFn coords = [](int64_t i) { return "<" + std::to_string(i) + ">"; };
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16}) {
    INFO("type " << elem_name(t));
    const Tensor ref = random_tensor(t, n, rng);
    Tensor scale = Tensor::alloc(ElemType::f32, {n}, 0);
    scale.as<float>()[n - 1] = std::numeric_limits<float>::infinity();
    scale.as<float>()[5] = std::numeric_limits<float>::quiet_NaN();
    for (CompareClass cls : {CompareClass::rounding, CompareClass::gemm}) {
      for (const Tolerance tol : {Tolerance{0, 1e-3}, Tolerance{1e-3, -1}, Tolerance{-1, 0}}) {
        for (const Tensor* sc : {static_cast<const Tensor*>(nullptr), static_cast<const Tensor*>(&scale)}) {
          INFO("class " << int(cls) << " rtol " << tol.rtol << " atol " << tol.atol << " scale " << (sc != nullptr));
          require_same(diff_tensors(ref.clone(), ref, cls, tol, coords, nullptr, sc),
                       reference_diff(ref.clone(), ref, cls, tol, nullptr, sc));
        }
      }
    }
  }
}

TEST_CASE("diff_tensors takes an infinity where the rounding half-width is infinite", "[cpu][diff]") {
  // combine.order any (docs/contract.md §2): where a partial sum can overflow
  // act, one order gives inf and another a finite value; w = inf takes both.
  // Elsewhere an infinity for a finite value fails, its error/bound inf.
  const CoordFn coords = [](int64_t i) { return "<" + std::to_string(i) + ">"; };
  const float inf = std::numeric_limits<float>::infinity();
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16}) {
    INFO("type " << elem_name(t));
    Tensor ref = Tensor::alloc(t, {4}, 0);
    Tensor scale = Tensor::alloc(ElemType::f32, {4}, 0);
    for (int64_t i = 0; i < 4; ++i) put(ref, i, 1000.0f), scale.as<float>()[i] = 8.0f;
    Tensor fast = ref.clone();
    put(fast, 0, inf);
    scale.as<float>()[0] = inf;
    const DiffResult taken = diff_tensors(fast, ref, CompareClass::rounding, {1, 0}, coords, nullptr, &scale);
    CHECK(taken.mismatches == 0);
    require_same(taken, reference_diff(fast, ref, CompareClass::rounding, {1, 0}, nullptr, &scale));
    put(fast, 1, -inf);  // a finite half-width: fails
    const DiffResult failed = diff_tensors(fast, ref, CompareClass::rounding, {1, 0}, coords, nullptr, &scale);
    CHECK(failed.mismatches == 1);
    CHECK(std::isinf(failed.max_bound_ratio));
    require_same(failed, reference_diff(fast, ref, CompareClass::rounding, {1, 0}, nullptr, &scale));
  }
}

TEST_CASE("diff_tensors names only the reported mismatches", "[cpu][diff]") {
  const int64_t n = 100000;
  Tensor ref = Tensor::alloc(ElemType::bf16, {n}, 0), fast = ref.clone();
  for (int64_t i = 0; i < n; i += 2) put(fast, i, 1.0f);
  int64_t named = 0;
  const CoordFn coords = [&](int64_t i) {
    ++named;
    return std::to_string(i);
  };
  const DiffResult r = diff_tensors(fast, ref, CompareClass::exact, {0, 0}, coords);
  CHECK(r.mismatches == n / 2);
  CHECK(named == 6);
  REQUIRE(r.last.size() == 3);
  CHECK(r.last.back().index == n - 2);
  // A shape mismatch names both shapes as NumPy writes them, (80,) for 1-d.
  const DiffResult s = diff_tensors(Tensor::alloc(ElemType::bf16, {80}, 0), Tensor::alloc(ElemType::bf16, {80, 1}, 0),
                                    CompareClass::exact, {0, 0}, coords);
  CHECK(s.structural == "fast bf16(80,) vs reference bf16(80, 1)");
}

TEST_CASE("diff_tensors: +0 against -0 agrees only for outside code (zero_sign_free)", "[cpu][diff]") {
  // docs/contract.md §15 rule 8: check accepts a zero of the other sign and
  // counts it; moeverify's own fast paths stay held to the bits.
  const int64_t n = kRunBytes + 17;
  const CoordFn coords = [](int64_t i) { return "<" + std::to_string(i) + ">"; };
  for (ElemType t : {ElemType::f32, ElemType::bf16, ElemType::f16}) {
    INFO("type " << elem_name(t));
    Tensor ref = Tensor::alloc(t, {n}, 0);
    for (int64_t i = 0; i < n; i += 2) put(ref, i, 1.5f);
    Tensor mine = ref.clone();
    for (int64_t i = 1; i < n; i += 40) put(mine, i, -0.0f);
    const int64_t flipped = (n - 1 + 39) / 40;
    const DiffResult strict = diff_tensors(mine, ref, CompareClass::exact, {}, coords);
    CHECK(strict.mismatches == flipped);
    CHECK(strict.signed_zeros == 0);
    const DiffResult outside = diff_tensors(mine, ref, CompareClass::exact, {}, coords, nullptr, nullptr, true);
    CHECK(outside.mismatches == 0);
    CHECK(outside.signed_zeros == flipped);
    put(mine, 0, 1.25f);  // a real difference still fails
    CHECK(diff_tensors(mine, ref, CompareClass::exact, {}, coords, nullptr, nullptr, true).mismatches == 1);
  }
}
