// Reference expert-parallel dispatch, permute, padding and return: loops over
// ranks, experts and tokens in contract order; segment starts are found by
// walking the loops, never from prefix-sum tables.
#include <cstddef>

#include "reference.h"

using std::size_t;

namespace ref {

EpDispatch ep_dispatch(Act act, ScoreApply apply, const std::vector<Vec>& x, const std::vector<Ids>& ids,
                       const std::vector<Vec>& topk_scores, int64_t D, int K, int E, int R,
                       ScoreMultiply smul) {
  const int E_l = E / R;
  EpDispatch d;
  d.recv.assign(size_t(R), {});
  d.recv_counts.assign(size_t(R), Counts(size_t(R) * size_t(E_l), 0));
  for (int q = 0; q < R; ++q)
    for (int p = 0; p < R; ++p)
      for (int j = 0; j < E_l; ++j) {
        const int e = q * E_l + j;
        const int64_t T = int64_t(ids[size_t(p)].size()) / K;
        for (int64_t t = 0; t < T; ++t)
          for (int k = 0; k < K; ++k) {
            if (ids[size_t(p)][size_t(t * K + k)] != e) continue;
            const float s0 = topk_scores[size_t(p)][size_t(t * K + k)];
            const float s = smul == ScoreMultiply::act ? round_act(act, s0) : s0;
            for (int64_t c = 0; c < D; ++c) {
              const float v = x[size_t(p)][size_t(t * D + c)];
              d.recv[size_t(q)].push_back(apply == ScoreApply::before_experts ? round_act(act, f32(double(v) * s)) : v);
            }
            ++d.recv_counts[size_t(q)][size_t(p * E_l + j)];
          }
      }
  return d;
}

namespace {
// Row where segment (p, j) starts in rank-major order.
int64_t rank_major_start(const Counts& c, int p, int j, int E_l) {
  int64_t s = 0;
  for (int pp = 0; pp < p; ++pp)
    for (int jj = 0; jj < E_l; ++jj) s += c[size_t(pp * E_l + jj)];
  for (int jj = 0; jj < j; ++jj) s += c[size_t(p * E_l + jj)];
  return s;
}
// Row where segment (j, p) starts in expert-major order.
int64_t expert_major_start(const Counts& c, int p, int j, int R, int E_l) {
  int64_t s = 0;
  for (int jj = 0; jj < j; ++jj)
    for (int pp = 0; pp < R; ++pp) s += c[size_t(pp * E_l + jj)];
  for (int pp = 0; pp < p; ++pp) s += c[size_t(pp * E_l + j)];
  return s;
}
}  // namespace

Vec permute_to_expert_major(const Vec& recv, const Counts& c, int R, int E_l, int64_t D) {
  Vec out;
  out.reserve(recv.size());
  for (int j = 0; j < E_l; ++j)
    for (int p = 0; p < R; ++p) {
      const int64_t s = rank_major_start(c, p, j, E_l);
      for (int64_t i = 0; i < c[size_t(p * E_l + j)] * D; ++i) out.push_back(recv[size_t(s * D + i)]);
    }
  return out;
}

Vec permute_to_rank_major(const Vec& rows, const Counts& c, int R, int E_l, int64_t D) {
  Vec out;
  out.reserve(rows.size());
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) {
      const int64_t s = expert_major_start(c, p, j, R, E_l);
      for (int64_t i = 0; i < c[size_t(p * E_l + j)] * D; ++i) out.push_back(rows[size_t(s * D + i)]);
    }
  return out;
}

Vec pad_groups(const Vec& rows, const Counts& counts, int64_t A, bool empty_align, int64_t D, Counts& sizes) {
  Vec out;
  sizes.clear();
  int64_t src = 0, M = 0;
  for (int64_t n : counts) {
    int64_t m = n;
    if (n == 0 && empty_align) m = A;
    while (m % A) ++m;
    sizes.push_back(m);
    for (int64_t i = 0; i < n * D; ++i) out.push_back(rows[size_t(src * D + i)]);
    for (int64_t i = 0; i < (m - n) * D; ++i) out.push_back(0.f);
    src += n;
    M += n;
  }
  if (empty_align) {
    int64_t len = M + int64_t(counts.size()) * A;
    while (len % A) ++len;
    while (int64_t(out.size()) < len * D) out.push_back(0.f);
  }
  return out;
}

Vec unpad_groups(const Vec& rows, const Counts& counts, const Counts& sizes, int64_t D) {
  Vec out;
  int64_t start = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    for (int64_t i = 0; i < counts[j] * D; ++i) out.push_back(rows[size_t(start * D + i)]);
    start += sizes[j];
  }
  return out;
}

std::vector<Vec> ep_return(const std::vector<Vec>& recv_out, const std::vector<Counts>& rc, int R, int E_l, int64_t D) {
  std::vector<Vec> back(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p)
    for (int q = 0; q < R; ++q) {
      const int64_t s = rank_major_start(rc[size_t(q)], p, 0, E_l);
      int64_t n = 0;
      for (int j = 0; j < E_l; ++j) n += rc[size_t(q)][size_t(p * E_l + j)];
      for (int64_t i = 0; i < n * D; ++i) back[size_t(p)].push_back(recv_out[size_t(q)][size_t(s * D + i)]);
    }
  return back;
}

}  // namespace ref
