// Rounding: the kernels' bit-level conversions against the reference's
// arithmetic ones, over every 16-bit pattern's neighbourhood and random floats.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "../kernels/dtype.h"
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
