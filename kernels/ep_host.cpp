#include "ep_host.h"

#include <algorithm>

#include "bodies.h"
#include "device.h"

namespace moev {

std::vector<int64_t> splits_from_counts(const int64_t* counts, int E, int R) {
  const int E_l = E / R;
  std::vector<int64_t> s(static_cast<size_t>(R), 0);
  for (int e = 0; e < E; ++e) s[size_t(e / E_l)] += counts[e];
  return s;
}

std::vector<int64_t> rank_major_offsets(const int64_t* c, int R, int E_l) {
  std::vector<int64_t> s_in(size_t(R) * size_t(E_l) + 1, 0);
  int64_t run = 0;
  for (size_t i = 0; i < size_t(R) * size_t(E_l); ++i) {
    s_in[i] = run;
    run += c[i];
  }
  s_in.back() = run;
  return s_in;
}

std::vector<int64_t> permute_map_generic(const int64_t* c, int R, int E_l) {
  const std::vector<int64_t> s_in = rank_major_offsets(c, R, E_l);
  const int64_t M = s_in.back();
  std::vector<int64_t> map;
  map.reserve(size_t(M));
  for (int j = 0; j < E_l; ++j)
    for (int p = 0; p < R; ++p)
      for (int64_t i = 0; i < c[p * E_l + j]; ++i) map.push_back(s_in[size_t(p * E_l + j)] + i);
  return map;
}

PadLayout pad_layout(const int64_t* counts, int E_l, int64_t A, EmptyGroupRows empty, const FaultSet& faults) {
  PadLayout l;
  l.rows.resize(size_t(E_l));
  l.start.assign(size_t(E_l) + 1, 0);
  int64_t M = 0;
  for (int j = 0; j < E_l; ++j) {
    const int64_t n = counts[j] == 0 && empty == EmptyGroupRows::align ? A : counts[j];
    l.rows[size_t(j)] = (n + A - 1) / A * A;
    M += counts[j];
  }
  for (int j = 0; j < E_l; ++j) {
    if (faults.has(Fault::offsets_32bit))  // the planted fault: a 32-bit running offset wraps
      l.start[size_t(j) + 1] = int64_t(int32_t(uint32_t(l.start[size_t(j)]) + uint32_t(l.rows[size_t(j)])));
    else
      l.start[size_t(j) + 1] = l.start[size_t(j)] + l.rows[size_t(j)];
  }
  l.buffer_rows = l.start[size_t(E_l)];
  if (empty == EmptyGroupRows::align) l.buffer_rows = std::max(l.buffer_rows, (M + E_l * A + A - 1) / A * A);
  return l;
}

std::vector<int64_t> pad_map(const int64_t* counts, const PadLayout& l, const FaultSet& faults) {
  std::vector<int64_t> map(size_t(l.buffer_rows), -1);
  int64_t src = 0;
  for (size_t j = 0; j < l.rows.size(); ++j) {
    const int64_t pad = l.rows[j] - counts[j];
    const int64_t first = faults.has(Fault::pad_rows_first) ? l.start[j] + pad : l.start[j];
    for (int64_t i = 0; i < counts[j]; ++i) map[size_t(first + i)] = src++;
  }
  return map;
}

std::vector<int64_t> unpad_map(const int64_t* counts, const PadLayout& l) {
  std::vector<int64_t> map;
  for (size_t j = 0; j < l.rows.size(); ++j)
    for (int64_t i = 0; i < counts[j]; ++i) map.push_back(l.start[j] + i);
  return map;
}

std::vector<int64_t> equal_split_pad_map(const std::vector<int64_t>& splits, int64_t Mstar, const FaultSet& faults) {
  std::vector<int64_t> map(splits.size() * size_t(Mstar), -1);
  int64_t src = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    const int64_t first = int64_t(i) * Mstar + (faults.has(Fault::pad_front) ? Mstar - splits[i] : 0);
    for (int64_t r = 0; r < splits[i]; ++r) map[size_t(first + r)] = src++;
  }
  return map;
}

std::vector<int64_t> equal_split_compact_map(const std::vector<int64_t>& splits, int64_t Mstar) {
  std::vector<int64_t> map;
  for (size_t p = 0; p < splits.size(); ++p)
    for (int64_t r = 0; r < splits[p]; ++r) map.push_back(int64_t(p) * Mstar + r);
  return map;
}

std::vector<int64_t> force_lb_counts(int64_t T, int K, int E) {
  const int64_t N = T * K;
  std::vector<int64_t> c(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) c[size_t(e)] = N / E + (e < N % E ? 1 : 0);
  return c;
}

std::vector<int64_t> direct_route_map(int64_t T, int R, int E_l, int64_t Mstar) {
  std::vector<int64_t> map(size_t(R) * size_t(Mstar), -1);
  for (int r = 0; r < R; ++r) {
    int64_t row = 0;
    for (int j = 0; j < E_l; ++j)
      for (int64_t t = r; t < T; t += R)
        if (row < Mstar) map[size_t(r * Mstar + row++)] = t;
  }
  return map;
}

std::vector<int64_t> invert_map(const std::vector<int64_t>& map) {
  std::vector<int64_t> inv(map.size(), -1);
  for (size_t q = 0; q < map.size(); ++q) inv[size_t(map[q])] = int64_t(q);
  return inv;
}

namespace {

/// dst[i] = src[map[i]] for rows of D elements of type T, on the mirror's
/// device when there is one (docs/architecture.md idea 2).
template <class T>
void row_map(const ExecCtx& ctx, const void* src, const int64_t* map, int64_t n, int64_t D, void* dst) {
  if (ctx.mirror) {
    Mirror& m = *ctx.mirror;
    Mirror::Scope scope{m};
    if (n == 0) return;
    int64_t src_rows = 0;  // the rows the map reads: what must be on the device
    for (int64_t i = 0; i < n; ++i) src_rows = std::max(src_rows, map[i] + 1);
    const size_t out_bytes = size_t(n * D) * sizeof(T);
    m.device().run(k::RowMapBody<T>{static_cast<const T*>(m.in(src, size_t(src_rows * D) * sizeof(T))),
                                    static_cast<const int64_t*>(m.in(map, size_t(n) * 8)),
                                    static_cast<T*>(m.out(dst, out_bytes)), D},
                   n);
    m.wrote(dst, out_bytes);
    return;
  }
  host_run(ctx, n, k::RowMapBody<T>{static_cast<const T*>(src), map, static_cast<T*>(dst), D});
}

template <class T>
void equal_count(const ExecCtx& ctx, const void* src, EqualCountMap m, int64_t n, int64_t D, void* dst) {
  if (ctx.mirror) {  // the map is a permutation of the n rows
    Mirror& mr = *ctx.mirror;
    Mirror::Scope scope{mr};
    if (n == 0) return;
    const size_t bytes = size_t(n * D) * sizeof(T);
    mr.device().run(k::FnRowMapBody<T, EqualCountMap>{static_cast<const T*>(mr.in(src, bytes)), m,
                                                      static_cast<T*>(mr.out(dst, bytes)), D},
                    n);
    mr.wrote(dst, bytes);
    return;
  }
  host_run(ctx, n, k::FnRowMapBody<T, EqualCountMap>{static_cast<const T*>(src), m, static_cast<T*>(dst), D});
}

}  // namespace

void apply_row_map(const ExecCtx& ctx, DType dt, const void* src, const int64_t* map, int64_t n, int64_t D, void* dst) {
  dispatch_dtype(dt, [&](auto tag) { row_map<decltype(tag)>(ctx, src, map, n, D, dst); });
}

void apply_row_map_e4m3(const ExecCtx& ctx, const void* src, const int64_t* map, int64_t n, int64_t D, void* dst) {
  row_map<e4m3>(ctx, src, map, n, D, dst);
}

}  // namespace moev

namespace moev {

void apply_equal_count(const ExecCtx& ctx, DType dt, const void* src, EqualCountMap m, int64_t n, int64_t D, void* dst) {
  dispatch_dtype(dt, [&](auto tag) { equal_count<decltype(tag)>(ctx, src, m, n, D, dst); });
}

void apply_equal_count_e4m3(const ExecCtx& ctx, const void* src, EqualCountMap m, int64_t n, int64_t D, void* dst) {
  equal_count<e4m3>(ctx, src, m, n, D, dst);
}

}  // namespace moev
