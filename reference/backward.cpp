// Reference of the backward token path (reference/backward.h).
#include "backward.h"

#include <cmath>

namespace ref {

Bytes combine_grad_rows(Act act, ScoreApply apply, ScoreMultiply smul, RowsRef grad_out, const Ids& token_sorted,
                        const Vec& score_sorted) {
  const size_t rb = grad_out.row_bytes, eb = act_bytes(act);
  const int64_t D = int64_t(rb / eb);
  Bytes out(token_sorted.size() * rb);
  for (size_t i = 0; i < token_sorted.size(); ++i) {
    uint8_t* o = out.data() + i * rb;
    if (token_sorted[i] < 0) {  // a pad_to_capacity filler fed no token: zero gradient
      for (int64_t d = 0; d < D; ++d) encode_act(act, 0.f, o + size_t(d) * eb);
      continue;
    }
    const uint8_t* g = grad_out.row(token_sorted[i]);
    const double s = smul == ScoreMultiply::act ? round_act(act, score_sorted[i]) : score_sorted[i];
    for (int64_t d = 0; d < D; ++d) {
      const float gv = decode_act(act, g + size_t(d) * eb);
      const float v = apply == ScoreApply::before_experts ? gv : round_act(act, f32(double(gv) * s));
      encode_act(act, v, o + size_t(d) * eb);
    }
  }
  return out;
}

Vec score_grad(Act act, ScoreMultiply smul, RowsRef token_rows, RowsRef dispatch_rows, const Ids& row_of, int64_t T,
               int64_t D, int K, Vec& halfwidth) {
  const size_t eb = act_bytes(act);
  const Act out_act = smul == ScoreMultiply::act ? act : Act::fp32;
  const double gamma = double(D + 2) * std::ldexp(1.0, -24);
  Vec g(size_t(T * K), 0.f);
  halfwidth.assign(size_t(T * K), 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t a = size_t(t * K + k);
      if (row_of[a] < 0) continue;  // dropped by capacity: added nothing, gradient 0
      const uint8_t* u = token_rows.row(t);
      const uint8_t* v = dispatch_rows.row(row_of[a]);
      double sum = 0, mag = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double p = double(decode_act(act, u + size_t(d) * eb)) * double(decode_act(act, v + size_t(d) * eb));
        sum += p;
        mag += std::fabs(p);
      }
      const float mid = round_act(out_act, f32(sum));
      const double room = gamma * mag + std::ldexp(1.0, -126);
      const float lo = round_act(out_act, f32(sum - room)), hi = round_act(out_act, f32(sum + room));
      g[a] = mid;
      halfwidth[a] = std::isfinite(mid) ? std::max(hi - mid, mid - lo) : 0.f;
    }
  return g;
}

Vec scatter_add_grad(Act act, ScoreApply apply, ScoreMultiply smul, Accumulate acc, RowsRef grad_rows,
                     const Ids& token_sorted, const Vec& score_sorted, const Vec& grad_shared, int64_t T, int64_t D) {
  const size_t eb = act_bytes(act);
  Vec out(size_t(T * D), 0.f);
  for (size_t i = 0; i < token_sorted.size(); ++i) {  // ascending dispatch row
    const int64_t t = token_sorted[i];
    if (t < 0) continue;  // a pad_to_capacity filler
    const double s = smul == ScoreMultiply::act ? round_act(act, score_sorted[i]) : score_sorted[i];
    for (int64_t d = 0; d < D; ++d) {
      const float gv = decode_act(act, grad_rows.row(int64_t(i)) + size_t(d) * eb);
      const float c = apply == ScoreApply::before_experts ? round_act(act, f32(double(gv) * s)) : gv;
      float& o = out[size_t(t * D + d)];
      o = f32(double(o) + double(c));
      if (acc == Accumulate::per_add) o = round_act(act, o);
    }
  }
  for (size_t e = 0; e < out.size(); ++e) {
    if (acc == Accumulate::fp32_accumulate) out[e] = round_act(act, out[e]);
    if (!grad_shared.empty()) out[e] = round_act(act, f32(double(out[e]) + double(grad_shared[e])));
  }
  return out;
}

std::vector<Bytes> ep_send_rows(const std::vector<RowsRef>& rows, const std::vector<Counts>& counts, int R, int E_l) {
  std::vector<Bytes> recv(static_cast<size_t>(R));
  for (int q = 0; q < R; ++q)
    for (int p = 0; p < R; ++p) {
      int64_t start = 0;  // first row of expert e on p: the counts of the experts before it
      for (int e = 0; e < q * E_l; ++e) start += counts[size_t(p)][size_t(e)];
      for (int j = 0; j < E_l; ++j) {
        const int64_t n = counts[size_t(p)][size_t(q * E_l + j)];
        const uint8_t* b = rows[size_t(p)].row(start);
        recv[size_t(q)].insert(recv[size_t(q)].end(), b, b + size_t(n) * rows[size_t(p)].row_bytes);
        start += n;
      }
    }
  return recv;
}

}  // namespace ref
