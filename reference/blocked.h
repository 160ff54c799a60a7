// The reference's GEMM plumbing (docs/contract.md §8, §15): Eigen's blocked
// GEMM in fp64 for every value the contract accumulates in fp64, an fp32
// GEMM of absolute values for the sums of |terms| behind the error bounds
// (made a rigorous upper bound below), and a fixed split of the rows into
// blocks run on threads. Block boundaries never depend on the thread count,
// and each block is one single-threaded Eigen product, so every result is
// the same for any number of threads.
#pragma once

#include <Eigen/Core>

// Every target defines it (CMakeLists.txt): Eigen's GEMM driver is one inline
// symbol across objects, so one object built without it lets Eigen start
// OpenMP teams inside the reference's own threads.
#ifndef EIGEN_DONT_PARALLELIZE
#error "EIGEN_DONT_PARALLELIZE must be defined for every target (CMakeLists.txt)"
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <thread>
#include <vector>

#include "reference.h"

namespace ref {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Rows of one GEMM block: large enough for Eigen's panels, small enough that
/// a rank's few hundred rows per expert still give every thread work.
constexpr int64_t kRowBlock = 128;

/// body(i) for i in [0, n) on up to `threads` threads, items taken in
/// ascending order as threads free up; each item runs on one thread. An
/// exception leaves no thread's function (that would call std::terminate):
/// the first one is rethrown here after every thread has joined.
template <class Body>
void parallel_items(int64_t n, int threads, Body body) {
  const int64_t w = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (w <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(w));
  auto run = [&](int64_t k) {
    try {
      for (int64_t i = next++; i < n; i = next++) body(i);
    } catch (...) {
      errors[size_t(k)] = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < w; ++k) pool.emplace_back(run, k);
  run(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// The fp32 sums s of k non-negative products each as an fp64 upper bound
/// of the exact sum. From s (any order, with or without FMA): each product
/// and each addition loses at most a factor (1 - 2^-24), and a product in
/// fp32's subnormal range at most 2^-150 absolutely, so the exact sum is at
/// most (s + k 2^-149) (1 + 2 (k + 1) 2^-24) while (k + 1) 2^-24 <= 1/2. An
/// element whose fp32 sum overflows is summed again in fp64 by exact(i, j),
/// so that the bound is infinite only where the exact sum is.
template <class Exact>
MatD abs_upper(const MatF& s, int64_t k, Exact exact) {
  MatD out(s.rows(), s.cols());
  // a loop that vectorises; the rare overflowed sums are redone afterwards
  const double add = double(k) * std::ldexp(1.0, -149), mul = 1.0 + 2.0 * double(k + 1) * std::ldexp(1.0, -24);
  bool any_inf = false;
  for (int64_t i = 0; i < s.size(); ++i) {
    const float v = s.data()[i];
    out.data()[i] = (double(v) + add) * mul;
    any_inf |= std::fabs(v) > std::numeric_limits<float>::max();
  }
  if (any_inf)
    for (int64_t i = 0; i < s.rows(); ++i)
      for (int64_t j = 0; j < s.cols(); ++j)
        if (std::isinf(s(i, j))) out(i, j) = exact(i, j);
  return out;
}

/// sum_d |a_id| |b_jd| for rows i of `a` (m, k) and j of `b` (n, k), both
/// already absolute values in fp32, as fp64 upper bounds of the exact sums.
inline MatD abs_product_nt(const MatF& a, const MatF& b) {
  const int64_t k = a.cols();
  return abs_upper(a * b.transpose(), k, [&](int64_t i, int64_t j) {
    double e = 0;
    for (int64_t d = 0; d < k; ++d) e += double(a(i, d)) * double(b(j, d));
    return e;
  });
}

/// The same for a (m, k) times b (k, n): sum_d |a_id| |b_dj|.
inline MatD abs_product_nn(const MatF& a, const MatF& b) {
  const int64_t k = a.cols();
  return abs_upper(a * b, k, [&](int64_t i, int64_t j) {
    double e = 0;
    for (int64_t d = 0; d < k; ++d) e += double(a(i, d)) * double(b(d, j));
    return e;
  });
}

/// |m| as fp32 (exact for values of an fp32, bf16 or fp16 tensor; an fp64
/// intermediate is rounded up, so a product of it stays an upper bound).
inline MatF abs_f32_up(const MatD& m) {
  MatF o(m.rows(), m.cols());
  for (int64_t i = 0; i < m.size(); ++i) {
    const double v = std::fabs(m.data()[i]);
    const float f = float(v);
    // one step up where f fell below v: for f >= 0 finite, the next float
    // up has the next bit pattern (0 -> the least subnormal, max -> inf)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += double(f) < v ? 1u : 0u;
    std::memcpy(&o.data()[i], &u, 4);
  }
  return o;
}

/// Experts [0, counts.size()) in row blocks of kRowBlock (block b of expert j
/// holds its rows [b kRowBlock, min((b + 1) kRowBlock, counts[j]))): prep(j)
/// builds what every block of expert j reads (its converted weights), then
/// block(prepared, j, r0, r1) runs for each block, r0 and r1 relative to the
/// expert's first row. With at least as many experts as threads, each expert
/// goes whole to one thread (one expert's converted weights per thread);
/// with fewer, the experts go one after the other, each over every thread.
template <class Prep, class Block>
void over_expert_blocks(const std::vector<int64_t>& counts, int threads, Prep prep, Block block) {
  const int64_t E = int64_t(counts.size());
  auto blocks_of = [&](int64_t j) { return (counts[size_t(j)] + kRowBlock - 1) / kRowBlock; };
  if (threads <= 1 || E >= threads) {
    parallel_items(E, threads, [&](int64_t j) {
      if (counts[size_t(j)] == 0) return;
      const auto w = prep(j);
      for (int64_t b = 0; b < blocks_of(j); ++b)
        block(w, j, b * kRowBlock, std::min(counts[size_t(j)], (b + 1) * kRowBlock));
    });
    return;
  }
  for (int64_t j = 0; j < E; ++j) {
    if (counts[size_t(j)] == 0) continue;
    const auto w = prep(j);
    parallel_items(blocks_of(j), threads,
                   [&](int64_t b) { block(w, j, b * kRowBlock, std::min(counts[size_t(j)], (b + 1) * kRowBlock)); });
  }
}

/// An absolute room added to every room below, so that a result of 0 with
/// a room of 0 still admits the smallest values around it.
inline const double kTiny = std::ldexp(1.0, -118);

/// The rounding to the compute dtype ca of a value (through fp32).
/// CA and ACT are template arguments: the rounding has no branch on the
/// dtype (most of the backward's time is roundings).
template <Act CA, Act ACT>
struct Rounder {
  static constexpr Act ca = CA, act = ACT;
  float c(double v) const { return round_act_to<CA>(f32(v)); }
  /// A result of the compute dtype handed back as an act tensor (a value of
  /// ca is one of act already when they are the same type: one rounding).
  float out(double v) const {
    if constexpr (CA == ACT) return c(v);
    else return round_act_to<ACT>(c(v));
  }
};

/// A GEMM result V with room: the middle value and half-width of
/// round_act(round_ca(v)) over v in [V - room, V + room], into mid/half.
template <class Rd>
void gemm_out(const Rd& R, const MatD& V, const MatD& room, Vec& mid, Vec& half, size_t at, bool want_half) {
  const double* v = V.data();
  float* m = &mid[at];
  for (int64_t i = 0; i < V.size(); ++i) m[i] = R.out(v[i]);
  if (!want_half) return;
  float* h = &half[at];
  for (int64_t i = 0; i < V.size(); ++i) {  // branch-free: it vectorises
    const double r = room.data()[i] + kTiny;
    const float w = std::max(std::fabs(R.out(v[i] + r) - m[i]), std::fabs(m[i] - R.out(v[i] - r)));
    h[i] = std::fabs(m[i]) <= std::numeric_limits<float>::max() ? w : 0.f;  // 0 where m is inf or NaN
  }
}

}  // namespace ref
