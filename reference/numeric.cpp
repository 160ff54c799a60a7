// Rounding to the activation type, written as arithmetic on the value (scale to
// an integer quantum, nearbyint, scale back) rather than on bit patterns.
#include <cmath>
#include <limits>

#include "reference.h"

namespace ref {

float round_act(Act act, float v) {
  if (act == Act::fp32 || !std::isfinite(v) || v == 0.f) return v;
  // significand bits p, smallest normal exponent (frexp convention), largest finite
  const int p = act == Act::bf16 ? 8 : 11;
  const int emin = act == Act::bf16 ? -125 : -13;
  const double max_finite = act == Act::bf16 ? std::ldexp(255.0, 120) : 65504.0;
  int e = 0;
  std::frexp(static_cast<double>(v), &e);
  const int q = std::max(e, emin) - p;  // exponent of one unit in the last place
  const double r = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(v), -q)), q);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<float>::infinity(), v);
  return static_cast<float>(r);
}

}  // namespace ref
