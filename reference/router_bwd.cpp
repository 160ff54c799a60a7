// Reference of the router backward (reference/backward.h, docs/contract.md §13): fp64
// per token for the score steps, Eigen fp64 GEMMs for the gate's two.
#include <Eigen/Core>
#include <cmath>
#include <limits>

#include "backward.h"

namespace ref {

namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr double kU32 = 1.0 / 16777216.0;  // 2^-24, fp32's unit roundoff
/// Stands for an infinite half-width inside the GEMMs of half-widths: an
/// infinity times a zero |x| would give NaN there; this stays finite through
/// E or T products of act values and still rounds to an infinite bound
/// (rounding_halfwidth of a room this wide is infinite).
constexpr double kUnknown = 1e290;
/// fp32's smallest normal: an absolute room added to the GEMMs' results, and
/// the absolute part of a carried score's uncertainty (below it a score's
/// relative precision is lost).
inline const double kSubnormal = std::ldexp(1.0, -126);

/// Unit roundoff of act (2^-p, p its significand bits): a held value is
/// within uh |v| of the exact one per rounding.
double unit_roundoff(Act act) {
  return act == Act::bf16 ? 1.0 / 256 : act == Act::fp16 ? 1.0 / 2048 : kU32;
}
/// Half the smallest subnormal of act: the absolute error one rounding may
/// make where the relative bound fails (a gradient of 1e-7 in fp16 is there).
double underflow_half(Act act) {
  return std::ldexp(1.0, act == Act::bf16 ? -134 : act == Act::fp16 ? -25 : -150);
}
double act_max_finite(Act act) {
  return act == Act::bf16 ? 3.3895313892515355e38 : act == Act::fp16 ? 65504.0 : 3.4028234663852886e38;
}

/// One token's grad_scores (E) and their half-widths, from its K selected
/// scores (docs/contract.md §13, router), each known within srtol |s| + satol.
/// Held scores (spec.held act): the denominator is the forward's held one,
/// and the room covers an act rounding after every operation of autograd's
/// chain (gp; gp / den; s / den, / den again, times gp, their sum), beside
/// an act unit either way of the held denominator (another fp32 summation
/// order of its sum may round to the neighbour).
/// Returns false where route_norm's denominator is not known (the chosen
/// scores sum to less than twice their tolerance): no half-width holds then.
bool token_score_grad(const RouterSpec& spec, const float* s, const int32_t* ids, const float* g, double srtol,
                      double satol, double* gs, double* wgs) {
  const int E = spec.E, K = spec.K;
  const bool held = spec.held != Act::fp32;
  const double uh = held ? unit_roundoff(spec.held) : 0.0;
  const double dh = held ? underflow_half(spec.held) : 0.0, d32 = underflow_half(Act::fp32);
  double den = 0, dot = 0, abs_dot = 0, dden = 0, gp_d = 0, sum_agp = 0;
  for (int k = 0; k < K; ++k) {
    if (ids[k] < 0 || ids[k] >= E) continue;
    const double sk = s[ids[k]], gp = double(g[k]) * spec.route_scale, dk = srtol * std::fabs(sk) + satol;
    sum_agp += std::fabs(gp);
    den += sk;
    dot += gp * sk;
    abs_dot += std::fabs(gp * sk);
    dden += dk;
    gp_d += std::fabs(gp) * dk;
  }
  den = held ? round_act(spec.held, f32(double(round_act(spec.held, f32(den))) + 1e-20)) : den + 1e-20;
  // a held value past act's range (fp16's 65504 within reach of g * route_scale,
  // gp / den, 1 / den^2 (the reciprocal's gradient, where the norm is
  // written top * (1 / den)) or their products) is an infinity in autograd's
  // chain: nothing is known then (the slack: that chain's roundings)
  const double big = held ? act_max_finite(spec.held) / (1 + 8 * uh) : INFINITY;
  bool overflow = false;
  for (int k = 0; k < K; ++k) {
    if (ids[k] < 0 || ids[k] >= E) continue;
    const double gp = std::fabs(double(g[k]) * spec.route_scale);
    overflow = overflow || gp > big || (spec.route_norm && gp / den > big);
  }
  if (spec.route_norm) overflow = overflow || 1 / (den * den) > big || abs_dot / (den * den) > big;
  for (int k = 0; k < K; ++k) {
    const int e = ids[k];
    if (e < 0 || e >= E) continue;
    const double gp = double(g[k]) * spec.route_scale, agp = std::fabs(gp);
    // rounding's absolute part (underflow): fp32's in every step, act's in held ones
    double v = gp, mag = agp, sens = 0, hroom = uh * agp + dh, under = double(2 * K + 8) * d32;
    if (spec.route_norm) {
      const double d2 = den * den;
      v = gp / den - dot / d2;
      mag = agp / den + abs_dot / d2;
      sens = 2 * (agp * dden / d2 + gp_d / d2 + 2 * std::fabs(dot) * dden / (d2 * den));
      // autograd's chain: gp, then gp / den (2 roundings; 3 as gp * (1 /
      // den)); s / den, / den again, times gp, their sum (5 with gp's; as
      // -(sum gp s) (r * r) with r = 1 / den, 6); and the held denominator
      // an act unit (2 uh den, or 2 dh where it is subnormal) either way; to
      // first order with 10 % to spare. Their underflows: gp's (through
      // gp / den and the quotients), s / den's (through / den and times gp),
      // the second quotient's (times gp), each product's and the sum's; in
      // the reciprocal form the sum's, times r * r = 1 / den^2.
      const double unit = 2 * uh * den + 2 * dh;
      hroom = uh * (3 * agp / den + 6 * abs_dot / d2) + 1.1 * unit * (agp / d2 + 2 * std::fabs(dot) / (d2 * den)) +
              1.1 * dh * (2 / den + 1 / d2 + (1 + 1 / den) * sum_agp + K + 2);
      under *= 1 + 1 / d2;  // the fp32 dot's underflow divided by den^2
    }
    overflow = overflow || mag > big;  // the held result itself (its two terms each in range)
    gs[e] += v;
    wgs[e] += sens + double(2 * K + 8) * kU32 * mag + hroom + under;
  }
  return !overflow && !(spec.route_norm && !(dden < den / 2));
}

/// One token's grad_logits (E) and half-widths from its grad_scores, each
/// known within wgs, and its scores, within srtol |s| + satol: to first
/// order in each, plus their product (a score gradient as uncertain as it
/// is large, where route_norm's two terms cancel, times a score that may
/// be another rounding of itself).
void token_logit_grad(const RouterSpec& spec, const float* s, const double* gs, const double* wgs, double srtol,
                      double satol, double* gl, double* wgl) {
  const int E = spec.E;
  auto tol = [&](int e) { return srtol * std::fabs(double(s[e])) + satol; };
  if (spec.score == Score::sigmoid) {
    for (int e = 0; e < E; ++e) {
      // |q|: a score an implementation computed may pass 1 by an ulp or two
      const double se = s[e], q = se * (1 - se), aq = std::fabs(q);
      gl[e] = gs[e] * q;
      wgl[e] = aq * wgs[e] + 2 * (std::fabs(gs[e]) * std::fabs(1 - 2 * se) + wgs[e]) * tol(e) +
               4 * kU32 * aq * std::fabs(gs[e]) + 4 * underflow_half(Act::fp32);
    }
    return;
  }
  double P = 0, absP = 0, wP = 0;
  for (int e = 0; e < E; ++e) {
    P += gs[e] * s[e];
    absP += std::fabs(gs[e] * s[e]);
    wP += wgs[e] * std::fabs(s[e]) + 2 * (std::fabs(gs[e]) + wgs[e]) * tol(e);
  }
  for (int e = 0; e < E; ++e) {
    const double se = s[e], ase = std::fabs(se);
    gl[e] = se * (gs[e] - P);
    wgl[e] = ase * (wgs[e] + wP) + 2 * tol(e) * (std::fabs(gs[e] - P) + wgs[e] + wP) +
             double(E + 4) * kU32 * ase * (std::fabs(gs[e]) + absP) + double(E + 4) * underflow_half(Act::fp32);
  }
}

/// round_act (or fp32) of V within room: the half-width of the stored value.
float gemm_half(Act out, double V, double room) {
  return out == Act::fp32 ? f32(room + kU32 * std::fabs(V) + kSubnormal) : rounding_halfwidth(out, V, room + kSubnormal);
}

}  // namespace

RouterGrad router_backward(const RouterSpec& spec, GateDtype gate, Act act, const Vec& scores, const Ids& ids,
                           const Vec& grad_topk, const Vec& x, const Vec& wg, int64_t T, int64_t D, double score_rtol,
                           bool want_half) {
  const bool held = spec.held != Act::fp32;
  // each score known within score_rtol |s| + 2^-126 (exactly where the scores
  // are the implementation's own); a held score of its own may also be the
  // other act rounding of a value within that tolerance: two act units more
  if (held && score_rtol > 0) score_rtol += 2 * unit_roundoff(spec.held);
  const double score_atol = score_rtol > 0 ? kSubnormal : 0.0;
  const int E = spec.E, K = spec.K;
  RouterGrad r;
  r.grad_scores.assign(size_t(T * E), 0.f);
  r.grad_logits.assign(size_t(T * E), 0.f);
  if (want_half) {
    r.half_scores.assign(size_t(T * E), 0.f);
    r.half_logits.assign(size_t(T * E), 0.f);
  }
  // a = the gate GEMMs' operand (grad_logits, act-rounded under the act gate), wa its half-width
  MatD a(T, E), wa(T, E);
  std::vector<double> gs(static_cast<size_t>(E)), wgs(gs), gl(gs), wgl(gs);
  std::vector<bool> chosen(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(gs.begin(), gs.end(), 0.0);
    std::fill(wgs.begin(), wgs.end(), 0.0);
    const float* s = &scores[size_t(t * E)];
    const bool known = token_score_grad(spec, s, &ids[size_t(t * K)], &grad_topk[size_t(t * K)], score_rtol,
                                        score_atol, gs.data(), wgs.data());
    // An unknown normalisation reaches the chosen scores, and through the
    // softmax every logit; an unchosen sigmoid score's gradient stays 0.
    for (int e = 0; e < E; ++e) {
      const size_t i = size_t(t * E + e), j = size_t(e);
      chosen[j] = wgs[j] > 0 || gs[j] != 0;
      // the stored fp32 value is one more rounding of the exact one
      double hs = !known && chosen[j] ? INFINITY : wgs[j] + kU32 * std::fabs(gs[j]);
      r.grad_scores[i] = f32(gs[j]);
      if (held) {
        // the gradient of a held score is an act value: the logits' steps
        // start from it, within its half-width
        r.grad_scores[i] = round_act(spec.held, f32(gs[j]));
        hs = std::isfinite(hs) ? rounding_halfwidth(spec.held, gs[j], hs) : hs;
        gs[j] = r.grad_scores[i];
        wgs[j] = hs;
      }
      if (want_half) r.half_scores[i] = f32(hs);
    }
    // Held scores of fp32 logits (the fp32 gate): autograd's sigmoid or
    // softmax backward reads its own fp32 output, saved before the cast to
    // act: each score there is within one act rounding of the held one
    // (relative uh, or half act's smallest subnormal where it underflowed).
    const bool fp32_saved = held && gate == GateDtype::fp32;
    token_logit_grad(spec, s, gs.data(), wgs.data(), score_rtol + (fp32_saved ? unit_roundoff(spec.held) : 0.0),
                     score_atol + (fp32_saved ? underflow_half(spec.held) : 0.0), gl.data(), wgl.data());
    for (int e = 0; e < E; ++e) {
      const size_t i = size_t(t * E + e);
      r.grad_logits[i] = f32(gl[size_t(e)]);
      const bool unknown = !known && (chosen[size_t(e)] || spec.score == Score::softmax);
      const double hl = unknown ? INFINITY : wgl[size_t(e)] + kU32 * std::fabs(gl[size_t(e)]);
      const double v = gl[size_t(e)];
      a(t, e) = gate == GateDtype::act ? round_act(act, f32(v)) : v;
      const double w = gate == GateDtype::act && std::isfinite(hl) ? rounding_halfwidth(act, v, hl) : hl;
      // finite through the GEMMs of |x| and |wg| below; an operand rounded
      // past act's range is unknown too (inf - inf in a sum is NaN)
      wa(t, e) = std::isfinite(w) && std::isfinite(a(t, e)) ? w : kUnknown;
      // held scores under the act gate: the logits are an act tensor, their gradient the GEMMs' operand
      const bool act_logits = held && gate == GateDtype::act;
      if (act_logits) r.grad_logits[i] = f32(a(t, e));
      if (want_half) r.half_logits[i] = f32(act_logits ? w : hl);
    }
  }
  MatD xm(T, D), wm(E, D);
  for (int64_t i = 0; i < T * D; ++i) xm.data()[i] = x[size_t(i)];
  for (int64_t i = 0; i < int64_t(E) * D; ++i) wm.data()[i] = wg[size_t(i)];
  const MatD dwg = a.transpose() * xm, dx = a * wm;
  MatD room_wg, room_x;
  if (want_half) {
    const MatD ax = xm.cwiseAbs(), aw = wm.cwiseAbs(), aa = a.cwiseAbs();
    room_wg = wa.transpose() * ax + double(T + 2) * kU32 * (aa.transpose() * ax);
    room_x = wa * aw + double(E + 2) * kU32 * (aa * aw);
  }
  r.grad_wg.resize(size_t(E * D));
  r.grad_x.resize(size_t(T * D));
  if (want_half) {
    r.half_wg.resize(size_t(E * D));
    r.half_x.resize(size_t(T * D));
  }
  // An unknown operand may be an infinity or a NaN (a held overflow), which
  // a zero of the other operand does not cancel: its whole row of grad_x and
  // its expert's row of grad_wg are unknown.
  std::vector<bool> unknown_e(static_cast<size_t>(E)), unknown_t(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      if (wa(t, e) >= kUnknown) unknown_e[size_t(e)] = unknown_t[size_t(t)] = true;
  for (int64_t i = 0; i < int64_t(E) * D; ++i) {
    r.grad_wg[size_t(i)] = round_act(act, f32(dwg.data()[i]));
    if (want_half)
      r.half_wg[size_t(i)] = unknown_e[size_t(i / D)] ? INFINITY : gemm_half(act, dwg.data()[i], room_wg.data()[i]);
  }
  for (int64_t i = 0; i < T * D; ++i) {
    r.grad_x[size_t(i)] = round_act(act, f32(dx.data()[i]));
    if (want_half)
      r.half_x[size_t(i)] = unknown_t[size_t(i / D)] ? INFINITY : gemm_half(act, dx.data()[i], room_x.data()[i]);
  }
  return r;
}

}  // namespace ref
