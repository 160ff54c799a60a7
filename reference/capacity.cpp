// Reference capacity dropping (docs/contract.md §11): for each expert's rows of the
// dispatch, a row is kept when it belongs to a capacity group and fewer than
// cap rows of its expert and its group beat it (policy probs: a higher
// score, or an equal score and a lower token index, a NaN score ranking
// above every number and equal to another NaN; policy position: an earlier
// row, i.e. a lower token index). Counted pair by pair, not sorted.
// The groups under sequence parallelism (one per SP rank, pad rows in none)
// are read off the reference shard's positions, not off any index formula.
#include <cmath>

#include "reference.h"

namespace ref {

int64_t capacity_for(int64_t n, int K, int E, double factor) {
  return int64_t(std::ceil(double(n) * double(K) / double(E) * factor));
}

CapacityGroups capacity_groups_one(int64_t T, int K, int E, double factor) {
  CapacityGroups g;
  g.group.assign(size_t(T), 0);
  g.cap.push_back(capacity_for(T, K, E, factor));
  return g;
}

CapacityGroups capacity_groups_sp(const SpShard& sh, int64_t T, int K, int E, double factor) {
  CapacityGroups g;
  size_t i = 0;  // SP-layout row: SP rank s holds rows_per_rank[s] rows after those of ranks < s
  for (size_t s = 0; s < sh.rows_per_rank.size(); ++s) {
    int64_t real = 0;
    for (int64_t t = 0; t < sh.rows_per_rank[s]; ++t, ++i) {
      const bool pad = sh.position[i] >= T;
      g.group.push_back(pad ? -1 : int32_t(s));
      real += !pad;
    }
    g.cap.push_back(capacity_for(real, K, E, factor));
  }
  return g;
}

CapacityDispatch capacity_dispatch(RowsRef rows, const Ids& token_sorted, const Vec& score_sorted, const Ids& row_of,
                                   const Counts& counts, const CapacityGroups& groups, bool by_probs, bool pad,
                                   const std::vector<uint8_t>* keep) {
  CapacityDispatch d;
  std::vector<int64_t> new_row(token_sorted.size(), -1);
  int64_t rows_with_pad = 0;
  for (int64_t c : groups.cap) rows_with_pad += c;
  auto group_of = [&](int64_t i) { return groups.group[size_t(token_sorted[size_t(i)])]; };
  // The score order of policy probs, total with NaN (docs/contract.md §11):
  // NaN above every number, NaNs equal. IEEE comparisons alone would let a
  // NaN row and a number row beat neither the other, and both be kept.
  auto above = [](float a, float b) { return std::isnan(a) ? !std::isnan(b) : a > b; };
  auto same = [](float a, float b) { return std::isnan(a) ? std::isnan(b) : a == b; };
  int64_t s = 0;
  for (int64_t n : counts) {
    int64_t kept = 0;
    for (int64_t i = s; i < s + n; ++i) {
      const int32_t g = group_of(i);
      int64_t beaten_by = 0;
      for (int64_t j = s; j < s + n; ++j) {
        if (group_of(j) != g) continue;
        const float sj = score_sorted[size_t(j)], si = score_sorted[size_t(i)];
        const bool beats =
            by_probs ? above(sj, si) || (same(sj, si) && token_sorted[size_t(j)] < token_sorted[size_t(i)]) : j < i;
        beaten_by += beats;
      }
      const bool in_cap = g >= 0 && beaten_by < groups.cap[size_t(g)];
      if (keep ? !(*keep)[size_t(i)] : !in_cap) continue;
      new_row[size_t(i)] = int64_t(d.token_sorted.size());
      d.rows.insert(d.rows.end(), rows.row(i), rows.row(i) + rows.row_bytes);
      d.token_sorted.push_back(token_sorted[size_t(i)]);
      d.score_sorted.push_back(score_sorted[size_t(i)]);  // no renormalisation
      ++kept;
    }
    for (int64_t f = kept; pad && f < rows_with_pad; ++f) {  // zero filler rows, score 0, no token
      d.rows.insert(d.rows.end(), rows.row_bytes, uint8_t(0));
      d.token_sorted.push_back(-1);
      d.score_sorted.push_back(0.f);
    }
    d.counts.push_back(pad ? rows_with_pad : kept);
    s += n;
  }
  for (int32_t r : row_of) d.row_of.push_back(r >= 0 ? int32_t(new_row[size_t(r)]) : -1);
  return d;
}

}  // namespace ref
