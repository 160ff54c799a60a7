#include "fp8.h"

#include <Eigen/Core>
#include <cmath>
#include <limits>

namespace ref {

double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(double(8 + m), e - 10);
  return (b & 0x80) ? -mag : mag;
}

uint8_t e4m3_encode(float v) {
  if (std::isnan(v)) return 0x7F;
  const double a = std::fabs(double(v));
  uint8_t code = 0x7E;  // 448: every magnitude above it saturates
  if (a <= 448.0) {
    // The quantum of a's binade [2^k, 2^(k+1)) is 2^(k-3) (three mantissa
    // bits); below 2^-6 it is the subnormal step 2^-9. a / quantum is exact.
    int e = 0;
    std::frexp(a, &e);  // a in [2^(e-1), 2^e)
    const int k = a == 0 ? -6 : std::max(e - 1, -6);
    const double quantum = std::ldexp(1.0, k - 3);
    const double n = a / quantum;
    double r = std::floor(n);
    if (n - r > 0.5 || (n - r == 0.5 && std::fmod(r, 2.0) != 0)) r += 1;
    const double value = r * quantum;  // at most 448 (a <= 448 rounds to at most 448)
    if (value < std::ldexp(1.0, -6)) {
      code = uint8_t(value / std::ldexp(1.0, -9));
    } else {
      int ev = 0;
      std::frexp(value, &ev);
      const int kv = ev - 1;  // value in [2^kv, 2^(kv+1)): exponent field kv + 7, mantissa value / 2^(kv-3) - 8
      code = uint8_t(((kv + 7) << 3) | (int(value / std::ldexp(1.0, kv - 3)) - 8));
    }
  }
  return std::signbit(v) ? uint8_t(code | 0x80) : code;
}

namespace {

/// The scale of a block of amax `amax` (clamped): fp32(amax / 448), the
/// smallest power of two not below it under UE8M0. The quotient of an fp32
/// value by 448 = 7 * 2^6 is never within 2^-53 (relative) of an fp32
/// rounding boundary unless it is one exactly, so the double quotient rounded
/// to fp32 is the correctly rounded fp32 quotient; likewise 1 / s and
/// 448 / amax (|2^p - k * m| >= 1 for the integer significands involved).
float block_scale(double amax, bool ue8m0) {
  float s = float(amax / 448.0);
  if (ue8m0) {
    int e = 0;
    const double f = std::frexp(double(s), &e);
    if (f != 0.5) s = float(std::ldexp(1.0, e));
  }
  return s;
}

}  // namespace

Fp8Rows fp8_quantise(const Fp8Spec& spec, const Vec& x, int64_t rows, int64_t D) {
  const int64_t nb = D / spec.block;
  Fp8Rows out;
  out.q.resize(size_t(rows * D));
  out.scale.resize(size_t(rows * nb));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const float* blk = x.data() + t * D + b * spec.block;
      double amax = 0;
      for (int64_t j = 0; j < spec.block; ++j) amax = std::max(amax, std::fabs(double(blk[j])));
      amax = std::max(amax, double(spec.clamp));
      const float s = block_scale(amax, spec.ue8m0);
      // The multiplier in fp32, then the product of two fp32 values (exact
      // in double) rounded once to fp32, then to e4m3.
      const double mul = spec.amax_ratio ? double(float(448.0 / amax)) : double(float(1.0 / double(s)));
      // x / s: the double quotient of two fp32 values rounded to fp32 is the
      // correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits).
      for (int64_t j = 0; j < spec.block; ++j)
        out.q[size_t(t * D + b * spec.block + j)] =
            e4m3_encode(spec.divide ? float(double(blk[j]) / double(s)) : float(double(blk[j]) * mul));
      out.scale[size_t(t * nb + b)] = s;
    }
  return out;
}

Vec fp8_dequantise(Act act, const RowsRef& q, const RowsRef& scale, int64_t D, int64_t block) {
  Vec out(size_t(q.rows * D));
  for (int64_t r = 0; r < q.rows; ++r) {
    const uint8_t* qr = q.data + r * q.row_bytes;
    const uint8_t* sr = scale.data + r * scale.row_bytes;
    for (int64_t c = 0; c < D; ++c) {
      float s;
      std::memcpy(&s, sr + (c / block) * 4, 4);
      // A 4-bit by 24-bit significand product is exact in double: one rounding to fp32.
      out[size_t(r * D + c)] = round_act(act, float(e4m3_value(qr[c]) * double(s)));
    }
  }
  return out;
}

Vec fp8_input_error(const Fp8Spec& spec, const Vec& x, int64_t rows, int64_t D) {
  const Fp8Rows f = fp8_quantise(spec, x, rows, D);
  const int64_t nb = D / spec.block;
  const double u8 = std::ldexp(1.0, -4) + std::ldexp(1.0, -6);
  Vec e(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < D; ++c) {
      const double floor_abs = std::ldexp(double(f.scale[size_t(r * nb + c / spec.block)]), -6);
      e[size_t(r * D + c)] = float(u8 * std::max(std::fabs(double(x[size_t(r * D + c)])), floor_abs));
    }
  return e;
}

Vec fp8_expert_error(bool swiglu, const Vec& X, const Vec& E, const Counts& counts, int64_t D, int64_t F,
                     const Vec& W1, const Vec& W3, const Vec& W2) {
  if (!swiglu) return E;
  using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const double L = 1.1;
  Vec out(X.size(), 0.f);
  int64_t row = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    const int64_t n = counts[j];
    MatD xj(n, D), ej(n, D), w1(F, D), w3(F, D), w2(D, F);
    for (int64_t i = 0; i < n * D; ++i) {
      xj.data()[i] = X[size_t(row * D + i)];
      ej.data()[i] = E[size_t(row * D + i)];
    }
    for (int64_t i = 0; i < F * D; ++i) {
      w1.data()[i] = W1[size_t(int64_t(j) * F * D + i)];
      w3.data()[i] = W3[size_t(int64_t(j) * F * D + i)];
      w2.data()[i] = W2[size_t(int64_t(j) * D * F + i)];
    }
    const MatD h1 = xj * w1.transpose(), h3 = xj * w3.transpose();
    const MatD d1 = ej * w1.cwiseAbs().transpose(), d3 = ej * w3.cwiseAbs().transpose();
    MatD dH(n, F);
    for (int64_t i = 0; i < n * F; ++i) {
      const double a = h1.data()[i], b = h3.data()[i], e1 = d1.data()[i], e3 = d3.data()[i];
      const double silu = a / (1.0 + std::exp(-a));
      dH.data()[i] = L * e1 * (std::fabs(b) + e3) + (std::fabs(silu) + L * e1) * e3;
    }
    const MatD dy = dH * w2.cwiseAbs().transpose();
    for (int64_t i = 0; i < n * D; ++i) out[size_t(row * D + i)] = float(dy.data()[i]);
    row += n;
  }
  return out;
}

Vec fp8_combine_error(const Vec& row_err, const Ids& token_sorted, const Vec& score_sorted, int64_t T, int64_t D) {
  std::vector<double> acc(size_t(T * D), 0.0);
  const double grow = 1.0 + std::ldexp(1.0, -7);
  for (size_t i = 0; i < token_sorted.size(); ++i) {
    const int32_t t = token_sorted[i];
    if (t < 0 || t >= T) continue;
    const double w = std::fabs(double(score_sorted[i])) * grow;
    for (int64_t c = 0; c < D; ++c) acc[size_t(t * D + c)] += w * double(row_err[i * size_t(D) + size_t(c)]);
  }
  return Vec(acc.begin(), acc.end());
}

}  // namespace ref
