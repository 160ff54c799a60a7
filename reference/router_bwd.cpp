// Reference of the router backward (reference/backward.h, docs/contract.md §13): fp64
// per token for the score steps, Eigen fp64 GEMMs for the gate's two.
#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <stdexcept>

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

/// One token's grad_scores (E) and their half-widths, from its K selected
/// scores (docs/contract.md §13, router), each known within srtol |s| + satol.
/// Returns false where route_norm's denominator is not known (the chosen
/// scores sum to less than twice their tolerance): no half-width holds then.
bool token_score_grad(const RouterSpec& spec, const float* s, const int32_t* ids, const float* g, double srtol,
                      double satol, double* gs, double* wgs) {
  const int E = spec.E, K = spec.K;
  double den = 1e-20, dot = 0, abs_dot = 0, dden = 0, gp_d = 0;
  for (int k = 0; k < K; ++k) {
    if (ids[k] < 0 || ids[k] >= E) continue;
    const double sk = s[ids[k]], gp = double(g[k]) * spec.route_scale, dk = srtol * std::fabs(sk) + satol;
    den += sk;
    dot += gp * sk;
    abs_dot += std::fabs(gp * sk);
    dden += dk;
    gp_d += std::fabs(gp) * dk;
  }
  for (int k = 0; k < K; ++k) {
    const int e = ids[k];
    if (e < 0 || e >= E) continue;
    const double gp = double(g[k]) * spec.route_scale;
    double v = gp, mag = std::fabs(gp), sens = 0;
    if (spec.route_norm) {
      const double d2 = den * den;
      v = gp / den - dot / d2;
      mag = std::fabs(gp) / den + abs_dot / d2;
      sens = 2 * (std::fabs(gp) * dden / d2 + gp_d / d2 + 2 * std::fabs(dot) * dden / (d2 * den));
    }
    gs[e] += v;
    wgs[e] += sens + double(2 * K + 8) * kU32 * mag;
  }
  return !(spec.route_norm && !(dden < den / 2));
}

/// One token's grad_logits (E) and half-widths from its grad_scores.
void token_logit_grad(const RouterSpec& spec, const float* s, const double* gs, const double* wgs, double srtol,
                      double satol, double* gl, double* wgl) {
  const int E = spec.E;
  auto tol = [&](int e) { return srtol * std::fabs(double(s[e])) + satol; };
  if (spec.score == Score::sigmoid) {
    for (int e = 0; e < E; ++e) {
      // |q|: a score an implementation computed may pass 1 by an ulp or two
      const double se = s[e], q = se * (1 - se), aq = std::fabs(q);
      gl[e] = gs[e] * q;
      wgl[e] = aq * wgs[e] + 2 * std::fabs(gs[e]) * std::fabs(1 - 2 * se) * tol(e) + 4 * kU32 * aq * std::fabs(gs[e]);
    }
    return;
  }
  double P = 0, absP = 0, wP = 0;
  for (int e = 0; e < E; ++e) {
    P += gs[e] * s[e];
    absP += std::fabs(gs[e] * s[e]);
    wP += wgs[e] * std::fabs(s[e]) + 2 * std::fabs(gs[e]) * tol(e);
  }
  for (int e = 0; e < E; ++e) {
    const double se = s[e], ase = std::fabs(se);
    gl[e] = se * (gs[e] - P);
    wgl[e] = ase * (wgs[e] + wP) + 2 * tol(e) * std::fabs(gs[e] - P) + double(E + 4) * kU32 * ase * (std::fabs(gs[e]) + absP);
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
  // each score known within score_rtol |s| + 2^-126 (exactly where the scores are the implementation's own)
  const double score_atol = score_rtol > 0 ? kSubnormal : 0.0;
  if (spec.held != Act::fp32) throw std::logic_error("router_backward: held scores have no backward rule");
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
  for (int64_t t = 0; t < T; ++t) {
    std::fill(gs.begin(), gs.end(), 0.0);
    std::fill(wgs.begin(), wgs.end(), 0.0);
    const float* s = &scores[size_t(t * E)];
    const bool known = token_score_grad(spec, s, &ids[size_t(t * K)], &grad_topk[size_t(t * K)], score_rtol,
                                        score_atol, gs.data(), wgs.data());
    token_logit_grad(spec, s, gs.data(), wgs.data(), score_rtol, score_atol, gl.data(), wgl.data());
    for (int e = 0; e < E; ++e) {
      const size_t i = size_t(t * E + e);
      r.grad_scores[i] = f32(gs[size_t(e)]);
      r.grad_logits[i] = f32(gl[size_t(e)]);
      // An unknown normalisation reaches the chosen scores, and through the
      // softmax every logit; an unchosen sigmoid score's gradient stays 0.
      const bool chosen = wgs[size_t(e)] > 0 || gs[size_t(e)] != 0;
      const bool unknown = !known && (chosen || spec.score == Score::softmax);
      // the stored fp32 value is one more rounding of the exact one
      const double hs = unknown && chosen ? INFINITY : wgs[size_t(e)] + kU32 * std::fabs(gs[size_t(e)]);
      const double hl = unknown ? INFINITY : wgl[size_t(e)] + kU32 * std::fabs(gl[size_t(e)]);
      if (want_half) {
        r.half_scores[i] = f32(hs);
        r.half_logits[i] = f32(hl);
      }
      const double v = gl[size_t(e)];
      a(t, e) = gate == GateDtype::act ? round_act(act, f32(v)) : v;
      const double w = gate == GateDtype::act ? rounding_halfwidth(act, v, hl) : hl;
      wa(t, e) = std::isfinite(w) ? w : kUnknown;  // finite through the GEMMs of |x| and |wg| below
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
  for (int64_t i = 0; i < int64_t(E) * D; ++i) {
    r.grad_wg[size_t(i)] = round_act(act, f32(dwg.data()[i]));
    if (want_half) r.half_wg[size_t(i)] = gemm_half(act, dwg.data()[i], room_wg.data()[i]);
  }
  for (int64_t i = 0; i < T * D; ++i) {
    r.grad_x[size_t(i)] = round_act(act, f32(dx.data()[i]));
    if (want_half) r.half_x[size_t(i)] = gemm_half(act, dx.data()[i], room_x.data()[i]);
  }
  return r;
}

}  // namespace ref
