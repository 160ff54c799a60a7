// Rounding: the kernels' bit-level conversions against the reference's
// arithmetic ones, over every 16-bit pattern's neighbourhood and random floats.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "../kernels/bodies.h"
#include "dtype.h"
#include "../reference/reference.h"

using namespace moev;

namespace {
float bits_to_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; }
}  // namespace

TEST_CASE("bf16 and fp16 rounding agree with the reference around every 16-bit value", "[cpu][numeric]") {
  int64_t checked = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float b = to_float(bf16{uint16_t(h)});
    const float f = to_float(fp16{uint16_t(h)});
    for (float v : {b, f}) {
      if (!std::isfinite(v)) continue;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      // the value, its float neighbours, and the exact midpoints to the next 16-bit values
      for (uint32_t w : {u, u + 1, u - 1, u + 0x8000u, u + 0x1000u, u + 0x0fffu, u + 0x1001u}) {
        const float x = bits_to_f(w);
        if (!std::isfinite(x)) continue;
        REQUIRE(same(round_to<bf16>(x), ref::round_act(ref::Act::bf16, x)));
        REQUIRE(same(round_to<fp16>(x), ref::round_act(ref::Act::fp16, x)));
        ++checked;
      }
    }
  }
  CHECK(checked > 500000);
}

TEST_CASE("rounding agrees on random floats of every magnitude", "[cpu][numeric]") {
  std::mt19937 g(42);
  for (int i = 0; i < 2000000; ++i) {
    const float x = bits_to_f(uint32_t(g()));
    if (!std::isfinite(x)) continue;
    REQUIRE(same(round_to<bf16>(x), ref::round_act(ref::Act::bf16, x)));
    REQUIRE(same(round_to<fp16>(x), ref::round_act(ref::Act::fp16, x)));
  }
}

TEST_CASE("the reference rounding passes zeros, infinities and NaNs through", "[cpu][numeric]") {
  const float inf = std::numeric_limits<float>::infinity();
  for (ref::Act act : {ref::Act::bf16, ref::Act::fp16}) {
    CHECK(same(ref::round_act(act, 0.f), 0.f));
    CHECK(same(ref::round_act(act, -0.f), -0.f));
    CHECK(same(ref::round_act(act, inf), inf));
    CHECK(same(ref::round_act(act, -inf), -inf));
    CHECK(std::isnan(ref::round_act(act, std::numeric_limits<float>::quiet_NaN())));
    CHECK(same(ref::round_act(act, std::numeric_limits<float>::max()), inf));
    CHECK(same(ref::round_act(act, -std::numeric_limits<float>::max()), -inf));
  }
}

TEST_CASE("the device conversions' NaN results are the integer paths' on every NaN", "[cpu][numeric]") {
  // A GPU rounds with the hardware instruction and selects bf16_nan_bits /
  // fp16_nan_bits for a NaN (src/core/dtype.h); the integer paths here are
  // the host's. Every NaN: both signs, every non-zero mantissa.
  int64_t bad_bf16 = 0, bad_fp16 = 0;
  for (uint32_t sign : {0u, 0x80000000u})
    for (uint32_t man = 1; man < (1u << 23); ++man) {
      const uint32_t u = sign | 0x7f800000u | man;
      bad_bf16 += from_float<bf16>(f32_from_bits(u)).bits != bf16_nan_bits(u);
      bad_fp16 += from_float<fp16>(f32_from_bits(u)).bits != fp16_nan_bits(u);
    }
  CHECK(bad_bf16 == 0);
  CHECK(bad_fp16 == 0);
  CHECK(bf16_nan_bits(0x7f800001u) == 0x7fc0);  // a signalling NaN made quiet
  CHECK(fp16_nan_bits(0xffc00000u) == 0xfe00);
}

TEST_CASE("known rounding values", "[cpu][numeric]") {
  CHECK(to_float(from_float<fp16>(65504.f)) == 65504.f);
  CHECK(std::isinf(to_float(from_float<fp16>(65520.f))));
  CHECK(to_float(from_float<fp16>(65519.f)) == 65504.f);
  CHECK(to_float(from_float<fp16>(5.9604644775390625e-8f)) == 5.9604644775390625e-8f);  // smallest subnormal
  CHECK(to_float(from_float<fp16>(2.98023223876953125e-8f)) == 0.f);  // half of it: ties to even (0)
  CHECK(to_float(from_float<bf16>(1.00390625f)) == 1.f);     // 1 + 2^-8: tie, to even
  CHECK(to_float(from_float<bf16>(1.01171875f)) == 1.015625f);  // 1 + 3*2^-8: tie, to even (up)
  CHECK(std::isnan(to_float(from_float<bf16>(std::nanf("")))));
}

// Non-finite values and overflow (issue 11 §4): the random and neighbourhood
// tests above skip non-finite inputs. IEEE conversion to a narrower format
// keeps infinities, turns every NaN into a NaN (a payload that lives only in
// the low 16 bits must not truncate to the all-zero mantissa of an infinity),
// and rounds finite values past the largest finite one (by half an ulp or
// more, ties to even) to infinity. Checked for the kernels' bit-level
// conversions (kernels/dtype.h) and the reference's arithmetic ones
// (reference/numeric.cpp) alike.
TEST_CASE("conversions keep infinities and NaNs and overflow to infinity", "[cpu][numeric]") {
  const float inf = std::numeric_limits<float>::infinity();
  auto kernel_bf16 = [](float v) { return to_float(from_float<bf16>(v)); };
  auto kernel_fp16 = [](float v) { return to_float(from_float<fp16>(v)); };
  auto ref_bf16 = [](float v) { return ref::round_act(ref::Act::bf16, v); };
  auto ref_fp16 = [](float v) { return ref::round_act(ref::Act::fp16, v); };
  struct Conv {
    const char* name;
    std::function<float(float)> f;
  };
  const std::vector<Conv> convs = {{"kernel bf16", kernel_bf16}, {"kernel fp16", kernel_fp16},
                                   {"reference bf16", ref_bf16}, {"reference fp16", ref_fp16}};

  SECTION("infinities stay infinities of the same sign") {
    for (const auto& c : convs) {
      INFO(c.name);
      CHECK(c.f(inf) == inf);
      CHECK(c.f(-inf) == -inf);
    }
    CHECK(from_float<bf16>(inf).bits == 0x7f80u);
    CHECK(from_float<bf16>(-inf).bits == 0xff80u);
    CHECK(from_float<fp16>(inf).bits == 0x7c00u);
    CHECK(from_float<fp16>(-inf).bits == 0xfc00u);
  }

  SECTION("every NaN stays a NaN: both signs, quiet and signalling, payload high or low") {
    const uint32_t nans[] = {
        0x7fc00000u, 0xffc00000u,  // quiet, no payload
        0x7fffffffu, 0xffffffffu,  // quiet, every payload bit
        0x7fc00001u, 0xffc0ffffu,  // quiet, payload in the low 16 bits
        0x7f800001u, 0xff800001u,  // signalling, lowest payload bit only
        0x7f80ffffu, 0xff80ffffu,  // signalling, payload only in the low 16 bits
        0x7f808000u, 0x7f807fffu,  // signalling, payload at / below bf16's rounding bit
        0x7fa00000u, 0xffbfffffu,  // signalling, payload in the high bits
        0x7f801000u, 0x7f800fffu,  // signalling, payload at / below fp16's rounding bit
    };
    for (uint32_t u : nans) {
      const float v = bits_to_f(u);
      REQUIRE(std::isnan(v));
      for (const auto& c : convs) {
        INFO(c.name << " of NaN 0x" << std::hex << u);
        const float r = c.f(v);
        CHECK(std::isnan(r));  // not inf, not a number
      }
      INFO("NaN 0x" << std::hex << u);
      const uint16_t b = from_float<bf16>(v).bits, h = from_float<fp16>(v).bits;
      CHECK((b & 0x7f80u) == 0x7f80u);
      CHECK((b & 0x007fu) != 0u);  // a NaN pattern, not the infinity 0x7f80
      CHECK((h & 0x7c00u) == 0x7c00u);
      CHECK((h & 0x03ffu) != 0u);
    }
  }

  SECTION("every 16-bit NaN and infinity pattern widens to a NaN and an infinity") {
    for (uint32_t s : {0x0000u, 0x8000u}) {
      for (uint32_t m = 0; m < 0x80u; ++m) {
        const float v = to_float(bf16{uint16_t(s | 0x7f80u | m)});
        INFO("bf16 0x" << std::hex << (s | 0x7f80u | m));
        CHECK((m == 0 ? v == (s ? -inf : inf) : std::isnan(v)));
      }
      for (uint32_t m = 0; m < 0x400u; ++m) {
        const float v = to_float(fp16{uint16_t(s | 0x7c00u | m)});
        INFO("fp16 0x" << std::hex << (s | 0x7c00u | m));
        CHECK((m == 0 ? v == (s ? -inf : inf) : std::isnan(v)));
      }
    }
  }

  SECTION("finite values past the largest finite overflow per round-to-nearest-even") {
    const float bf16_max = bits_to_f(0x7f7f0000u);  // 255 * 2^120
    const float fp16_max = 65504.f;
    const std::pair<float, float> bf16_cases[] = {
        {std::numeric_limits<float>::max(), inf},
        {bits_to_f(0x7f7f8000u), inf},       // the exact midpoint to 2^128: ties to even (0x7f80) = inf
        {bits_to_f(0x7f7f7fffu), bf16_max},  // just below the midpoint
        {bf16_max, bf16_max},
    };
    const std::pair<float, float> fp16_cases[] = {
        {std::numeric_limits<float>::max(), inf},
        {1e10f, inf},
        {65520.f, inf},              // the midpoint 65504 + 16: ties to even (0x7c00) = inf
        {65519.99609375f, fp16_max}, // one fp32 ulp below it
        {fp16_max, fp16_max},
    };
    for (float sign : {1.f, -1.f}) {
      for (const auto& [v, want] : bf16_cases) {
        INFO("bf16 of " << sign * v);
        CHECK(kernel_bf16(sign * v) == sign * want);
        CHECK(ref_bf16(sign * v) == sign * want);
      }
      for (const auto& [v, want] : fp16_cases) {
        INFO("fp16 of " << sign * v);
        CHECK(kernel_fp16(sign * v) == sign * want);
        CHECK(ref_fp16(sign * v) == sign * want);
      }
    }
  }
}

TEST_CASE("the reference decodes and encodes every 16-bit pattern as the kernels do", "[cpu][numeric]") {
  // The compact reference (rows kept as bytes of their type) decodes values
  // where the contract computes and stores the rounded result back.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = uint16_t(h);
    uint8_t raw[2];
    std::memcpy(raw, &bits, 2);
    for (ref::Act act : {ref::Act::bf16, ref::Act::fp16}) {
      const float want = act == ref::Act::bf16 ? to_float(bf16{bits}) : to_float(fp16{bits});
      const float got = ref::decode_act(act, raw);
      INFO("act " << int(act) << " bits " << h);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got));
        continue;
      }
      REQUIRE(std::memcmp(&want, &got, 4) == 0);
      uint8_t back[2];
      ref::encode_act(act, got, back);
      REQUIRE(std::memcmp(back, raw, 2) == 0);
    }
  }
}

TEST_CASE("the kernels' exp is within 2 ulp of e^v over every float magnitude", "[cpu][numeric]") {
  // k_exp is built from + * and exponent bits so that the host and CUDA
  // executors agree bitwise; this measures it against double-precision exp
  // on every 997th float bit pattern (both signs, subnormal results included).
  double worst = 0;
  float worst_at = 0;
  int64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 997) {
    float v;
    const uint32_t b = uint32_t(u);
    std::memcpy(&v, &b, 4);
    if (std::isnan(v)) continue;
    const double ex = std::exp(double(v));
    if (ex > double(std::numeric_limits<float>::max())) continue;  // checked below
    const float ef = float(ex);
    const double ulp = ex < std::ldexp(1.0, -126) ? std::ldexp(1.0, -149)
                                                   : double(std::nextafter(ef, INFINITY)) - double(ef);
    const double err = std::fabs(double(k::k_exp(v)) - ex) / ulp;
    if (err > worst) {
      worst = err;
      worst_at = v;
    }
    ++checked;
  }
  INFO("worst " << worst << " ulp at " << worst_at << " over " << checked << " values");
  CHECK(checked > 3000000);  // NaNs and overflowing values (about a quarter) are left out
  CHECK(worst <= 2.0);
  CHECK(k::k_exp(0.f) == 1.f);
  CHECK(std::fabs(double(k::k_exp(1.f)) - std::exp(1.0)) <= 2.4e-7);  // 1 ulp at e
  CHECK(std::isinf(k::k_exp(88.73f)));
  CHECK(std::isinf(k::k_exp(INFINITY)));
  CHECK(k::k_exp(-INFINITY) == 0.f);
  CHECK(k::k_exp(-104.f) == 0.f);
  CHECK(k::k_exp(-100.f) > 0.f);  // a subnormal
  CHECK(std::isnan(k::k_exp(std::nanf(""))));
  // the last finite result and the first overflow, where the C library's expf has them
  CHECK(std::isfinite(k::k_exp(88.7228317f)));
  CHECK(std::isfinite(std::exp(88.7228317f)));
  CHECK(std::isinf(k::k_exp(88.72283935546875f)));
  CHECK(std::isinf(std::exp(88.72283935546875f)));
}
