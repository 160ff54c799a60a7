// Rounding to the activation type, written as arithmetic on the value (scale to
// an integer quantum, nearbyint, scale back) rather than on the bit patterns
// of the result, as the kernels do (kernels/dtype.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "reference.h"

namespace ref {


void encode_act(Act act, float v, uint8_t* p) {
  if (act == Act::fp32) {
    std::memcpy(p, &v, 4);
    return;
  }
  uint16_t h = 0;
  if (act == Act::bf16) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    h = std::isnan(v) ? uint16_t(0x7FC0 | ((u >> 16) & 0x8000)) : uint16_t(u >> 16);  // exact: v is a bf16 value
  } else {
    const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
    const double a = std::fabs(double(v));
    if (std::isnan(v)) {
      h = 0x7E00;
    } else if (std::isinf(v)) {
      h = uint16_t(sign | 0x7C00);
    } else if (a < std::ldexp(1.0, -14)) {  // subnormal or zero: a = fr * 2^-24
      h = uint16_t(sign | uint16_t(std::ldexp(a, 24)));
    } else {
      int e = 0;
      const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1) = (1 + fr/1024) * 2^(e-1)
      h = uint16_t(sign | uint16_t((e - 1 + 15) << 10) | uint16_t(std::ldexp(m, 11) - 1024));
    }
  }
  std::memcpy(p, &h, 2);
}

}  // namespace ref
