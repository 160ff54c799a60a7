// Reference expert-parallel dispatch, permute, padding and return: loops over
// ranks, experts and tokens in contract order; segment starts are found by
// walking the loops, never from prefix-sum tables.
#include <cstddef>

#include "reference.h"

using std::size_t;

namespace ref {

namespace {
void put_row(Bytes& out, const uint8_t* row, size_t n) { out.insert(out.end(), row, row + n); }
}  // namespace

EpDispatch ep_dispatch(const std::vector<RowsRef>& routed, const std::vector<Counts>& counts, int R, int E_l,
                       int only) {
  EpDispatch d;
  d.recv.assign(size_t(R), {});
  d.recv_counts.assign(size_t(R), Counts(size_t(R) * size_t(E_l), 0));
  // Each receiver's rows are reserved whole: appended row by row, a vector's
  // doubling would hold up to twice the rows, and the freed halves would
  // scatter the heap.
  for (int q = 0; q < R; ++q) {
    if (only >= 0 && q != only) continue;
    int64_t n = 0;
    for (int p = 0; p < R; ++p)
      for (int j = 0; j < E_l; ++j) n += counts[size_t(p)][size_t(q * E_l + j)];
    d.recv[size_t(q)].reserve(size_t(n) * (routed.empty() ? 0 : routed[0].row_bytes));
  }
  for (int q = 0; q < R; ++q)
    for (int p = 0; p < R; ++p) {
      // walk source p's expert groups up to expert q*E_l
      int64_t row = 0;
      for (int e = 0; e < q * E_l; ++e) row += counts[size_t(p)][size_t(e)];
      for (int j = 0; j < E_l; ++j) {
        const int64_t n = counts[size_t(p)][size_t(q * E_l + j)];
        d.recv_counts[size_t(q)][size_t(p * E_l + j)] = n;
        if (only < 0 || q == only)
          for (int64_t i = 0; i < n; ++i) put_row(d.recv[size_t(q)], routed[size_t(p)].row(row + i), routed[size_t(p)].row_bytes);
        row += n;
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

Bytes permute_to_expert_major(RowsRef recv, const Counts& c, int R, int E_l) {
  Bytes out;
  out.reserve(size_t(recv.rows) * recv.row_bytes);
  for (int j = 0; j < E_l; ++j)
    for (int p = 0; p < R; ++p) {
      const int64_t s = rank_major_start(c, p, j, E_l);
      for (int64_t i = 0; i < c[size_t(p * E_l + j)]; ++i) put_row(out, recv.row(s + i), recv.row_bytes);
    }
  return out;
}

Bytes permute_to_rank_major(RowsRef rows, const Counts& c, int R, int E_l) {
  Bytes out;
  out.reserve(size_t(rows.rows) * rows.row_bytes);
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) {
      const int64_t s = expert_major_start(c, p, j, R, E_l);
      for (int64_t i = 0; i < c[size_t(p * E_l + j)]; ++i) put_row(out, rows.row(s + i), rows.row_bytes);
    }
  return out;
}

Bytes pad_groups(RowsRef rows, const Counts& counts, int64_t A, bool empty_align, Counts& sizes) {
  Bytes out;
  out.reserve(size_t(rows.rows + int64_t(counts.size() + 1) * A) * rows.row_bytes);  // at most A rows per group, and the tail
  sizes.clear();
  const size_t rb = rows.row_bytes;
  int64_t src = 0, M = 0;
  for (int64_t n : counts) {
    int64_t m = n;
    if (n == 0 && empty_align) m = A;
    while (m % A) ++m;
    sizes.push_back(m);
    for (int64_t i = 0; i < n; ++i) put_row(out, rows.row(src + i), rb);
    out.resize(out.size() + size_t(m - n) * rb, 0);
    src += n;
    M += n;
  }
  if (empty_align) {
    int64_t len = M + int64_t(counts.size()) * A;
    while (len % A) ++len;
    out.resize(size_t(len) * rb, 0);
  }
  return out;
}

Bytes unpad_groups(RowsRef rows, const Counts& counts, const Counts& sizes) {
  Bytes out;
  int64_t n = 0;
  for (int64_t v : counts) n += v;
  out.reserve(size_t(n) * rows.row_bytes);
  int64_t start = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    for (int64_t i = 0; i < counts[j]; ++i) put_row(out, rows.row(start + i), rows.row_bytes);
    start += sizes[j];
  }
  return out;
}

std::vector<Bytes> ep_return(const std::vector<RowsRef>& recv_out, const std::vector<Counts>& rc, int R, int E_l,
                             int only) {
  std::vector<Bytes> back(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    if (only >= 0 && p != only) continue;
    int64_t n = 0;
    for (int q = 0; q < R; ++q)
      for (int j = 0; j < E_l; ++j) n += rc[size_t(q)][size_t(p * E_l + j)];
    back[size_t(p)].reserve(size_t(n) * (recv_out.empty() ? 0 : recv_out[0].row_bytes));
  }
  for (int p = 0; p < R; ++p)
    for (int q = 0; q < R; ++q) {
      if (only >= 0 && p != only) break;
      const int64_t s = rank_major_start(rc[size_t(q)], p, 0, E_l);
      int64_t n = 0;
      for (int j = 0; j < E_l; ++j) n += rc[size_t(q)][size_t(p * E_l + j)];
      for (int64_t i = 0; i < n; ++i) put_row(back[size_t(p)], recv_out[size_t(q)].row(s + i), recv_out[size_t(q)].row_bytes);
    }
  return back;
}

}  // namespace ref
