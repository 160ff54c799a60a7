// Element types of the fast path and their conversions, usable from host and
// device code (MOEV_HD is empty without nvcc).
//
// bf16 and fp16 are stored as their IEEE bit patterns. float -> bf16/fp16 is a
// single round-to-nearest-even (docs/contract.md "Numeric conventions"); NaN stays a
// quiet NaN, overflow goes to +-inf. The reference rounds with its own,
// arithmetic formulation (reference/numeric.h) so that a bug here cannot be
// copied there.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#define MOEV_HD __host__ __device__
#else
#define MOEV_HD
#endif

namespace moev {

enum class DType : uint8_t { fp32, bf16, fp16 };

struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

MOEV_HD inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
MOEV_HD inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

MOEV_HD inline float to_float(float v) { return v; }
MOEV_HD inline float to_float(bf16 v) { return f32_from_bits(uint32_t(v.bits) << 16); }
// On a GPU each conversion between fp32 and bf16 / fp16 below is also one
// instruction (cvt.rn.bf16.f32 from sm_80, cvt.rn.f16.f32, cvt.f32.f16), which
// gives the same bits as the integer formulation for every input but NaN (the
// hardware writes one canonical NaN; here a NaN keeps its payload, made
// quiet): device code takes the instruction, and for a NaN the integer
// formulation's result by a select. The combine rounds twice per element and
// routed row: about 20 integer instructions per element and row on the
// integer path, by count (not profiled), enough to make it compute-bound at
// an H200's bandwidth (issue 36). tests/gpu_check.cpp compares both on
// every class of input on the GPU.
#if defined(__CUDA_ARCH__)
#define MOEV_CVT_DEVICE 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MOEV_CVT_BF16_DEVICE 1
#endif

MOEV_HD inline float to_float(fp16 v) {
#ifdef MOEV_CVT_DEVICE
  if ((v.bits & 0x7c00u) != 0x7c00u || (v.bits & 0x3ffu) == 0) {  // not a NaN
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
  }
#endif
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu;
  const uint32_t man = v.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in fp32
    const float mag = float(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

template <class T> MOEV_HD inline T from_float(float f);

template <> MOEV_HD inline float from_float<float>(float f) { return f; }

/// bf16 rounding in 32-bit lanes: RNE by adding 0x7fff plus the kept lsb,
/// NaN made quiet by setting the top mantissa bit. Written as a select, not a
/// branch, so that loops over spans vectorise (kernels/bodies.h combine).
MOEV_HD inline uint32_t bf16_round_bits32(uint32_t u) {
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
}

/// What the integer formulations give for a NaN with bits u, in one step
/// each: bf16 keeps the payload's top bits, made quiet; fp16 gives sign |
/// 0x7e00. The device paths select them for a NaN (a select, not a branch);
/// tests/test_numeric.cpp checks them against the integer paths on every NaN.
MOEV_HD inline uint16_t bf16_nan_bits(uint32_t u) { return uint16_t((u >> 16) | 0x0040u); }
MOEV_HD inline uint16_t fp16_nan_bits(uint32_t u) { return uint16_t(((u >> 16) & 0x8000u) | 0x7e00u); }

template <> MOEV_HD inline bf16 from_float<bf16>(float f) {
#ifdef MOEV_CVT_BF16_DEVICE
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return bf16{f == f ? r : bf16_nan_bits(f32_bits(f))};
#else
  return bf16{uint16_t(bf16_round_bits32(f32_bits(f)) >> 16)};
#endif
}

template <> MOEV_HD inline fp16 from_float<fp16>(float f) {
#ifdef MOEV_CVT_DEVICE
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return fp16{f == f ? r : fp16_nan_bits(f32_bits(f))};
#endif
  const uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};
  if (ax >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf
  const uint32_t e = ax >> 23;
  if (e < 113) {  // result is subnormal (or zero): h = round(m * 2^(e-126))
    if (e < 102) return fp16{sign};  // below half of the smallest subnormal
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t s = 126u - e;
    uint32_t h = m >> s;
    const uint32_t rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return fp16{uint16_t(sign | h)};
  }
  uint32_t h = ((e - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may enter the exponent
  return fp16{uint16_t(sign | h)};
}

/// FP8 e4m3fn (docs/contract.md §16): 1 sign, 4 exponent (bias 7), 3 mantissa
/// bits; no infinity, 0x7F and 0xFF are NaN, the largest finite value is
/// 448 (0x7E). This is the fast path's conversion; the reference has its own
/// (reference/numeric.h), written from the value formula.
struct e4m3 { uint8_t bits; };

MOEV_HD inline float to_float(e4m3 v) {
  const uint32_t sign = uint32_t(v.bits & 0x80u) << 24;
  const uint32_t exp = (v.bits >> 3) & 0xfu, man = v.bits & 0x7u;
  if (exp == 15 && man == 7) return f32_from_bits(0x7fc00000u);
  if (exp == 0) return f32_from_bits(sign | f32_bits(float(man) * 0.001953125f));  // man * 2^-9, exact
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

/// float -> e4m3fn: one round-to-nearest-even; every finite value of
/// magnitude above 448 and +-inf saturate to +-448 (satfinite); NaN gives
/// 0x7F; the sign of a value that rounds to zero is kept (0x80 for -0).
template <> MOEV_HD inline e4m3 from_float<e4m3>(float f) {
  const uint32_t x = f32_bits(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return e4m3{0x7f};
  if (ax >= 0x43e00000u) return e4m3{uint8_t(sign | 0x7eu)};  // >= 448
  if (ax < 0x3c800000u) {  // below 2^-6: a multiple of 2^-9, found as an integer in [0, 8]
    // |f| * 2^9 is exact; adding and removing 2^23 rounds it to an integer, ties to even.
    const float m = (f32_from_bits(ax) * 512.f + 8388608.f) - 8388608.f;
    return e4m3{uint8_t(sign | uint8_t(m))};  // 8 is 2^-6 itself: exponent 1, mantissa 0
  }
  uint32_t b = (((ax >> 23) - 120u) << 3) | ((ax >> 20) & 0x7u);
  const uint32_t rem = ax & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (b & 1u))) ++b;  // a carry enters the exponent; below 448 never 0x7F
  return e4m3{uint8_t(sign | b)};
}

/// round_act(v): one RNE rounding of an fp32 value to the activation type T.
template <class T> MOEV_HD inline float round_to(float v) { return to_float(from_float<T>(v)); }
template <> MOEV_HD inline float round_to<float>(float v) { return v; }
/// The same value as to_float(from_float<bf16>(v)), without leaving 32-bit lanes.
template <> MOEV_HD inline float round_to<bf16>(float v) {
#ifdef MOEV_CVT_BF16_DEVICE
  return to_float(from_float<bf16>(v));
#else
  return f32_from_bits(bf16_round_bits32(f32_bits(v)));
#endif
}

/// from_float<T> of the 2N values v for the 2-byte types, packed two to a
/// word: v[2i] in the low half of d[i], v[2i + 1] in the high half (the
/// element at the lower address in the low bits, little-endian). On a GPU
/// one packed instruction converts each pair (cvt.rn.bf16x2.f32 or
/// cvt.rn.f16x2.f32; it writes its first operand to the high half), and one
/// test for a NaN among all 2N values replaces a scalar conversion's select
/// per value: where one is a NaN, every value takes from_float, so the bits
/// are from_float's for every input. The combine rounds twice per element
/// and routed row this way (kernels/bodies.h); tests/gpu_check.cpp compares
/// it with the host's on the GPU.
template <class T, int N>
MOEV_HD inline void pack_pairs(const float (&v)[2 * N], uint32_t (&d)[N]) {
  static_assert(sizeof(T) == 2, "pack_pairs packs 2-byte elements");
#ifdef MOEV_CVT_BF16_DEVICE
  bool nan = false;
  for (int i = 0; i < N; ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d[i]) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
    else
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d[i]) : "f"(v[2 * i + 1]), "f"(v[2 * i]));
    nan |= !(v[2 * i] == v[2 * i] && v[2 * i + 1] == v[2 * i + 1]);
  }
  if (!nan) return;
#endif
  for (int i = 0; i < N; ++i)
    d[i] = uint32_t(from_float<T>(v[2 * i]).bits) | (uint32_t(from_float<T>(v[2 * i + 1]).bits) << 16);
}

/// v[i] = round_to<T>(v[i]) for the 2N values, through pack_pairs: the same
/// values as 2N round_to calls (none for fp32).
template <class T, int N>
MOEV_HD inline void round_pairs(float (&v)[2 * N]) {
  if constexpr (sizeof(T) == 2) {
    uint32_t d[N];
    pack_pairs<T, N>(v, d);
    for (int i = 0; i < N; ++i) {
      if constexpr (std::is_same_v<T, bf16>) {
        v[2 * i] = f32_from_bits(d[i] << 16);
        v[2 * i + 1] = f32_from_bits(d[i] & 0xffff0000u);
      } else {
        v[2 * i] = to_float(T{uint16_t(d[i] & 0xffffu)});
        v[2 * i + 1] = to_float(T{uint16_t(d[i] >> 16)});
      }
    }
  }
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::fp32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
  }
  return "?";
}

inline size_t dtype_bytes(DType d) { return d == DType::fp32 ? 4 : 2; }

/// The one place where a runtime DType becomes a C++ type.
template <class F> decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::fp32: return f(float{});
    case DType::bf16: return f(bf16{});
    case DType::fp16: return f(fp16{});
  }
  throw std::invalid_argument("unsupported activation dtype code " + std::to_string(int(d)));
}

}  // namespace moev
