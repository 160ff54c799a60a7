// Reference capacity dropping (docs/contract.md §11): for each expert's rows of the
// dispatch, a row is kept when fewer than cap rows of its expert beat it
// (policy probs: a higher score, or an equal score and a lower token index;
// policy position: an earlier row, i.e. a lower token index). Counted pair by
// pair, not sorted.
#include "reference.h"

namespace ref {

CapacityDispatch capacity_dispatch(RowsRef rows, const Ids& token_sorted, const Vec& score_sorted, const Ids& row_of,
                                   const Counts& counts, int64_t cap, bool by_probs, bool pad,
                                   const std::vector<uint8_t>* keep) {
  CapacityDispatch d;
  std::vector<int64_t> new_row(token_sorted.size(), -1);
  int64_t s = 0;
  for (int64_t n : counts) {
    int64_t kept = 0;
    for (int64_t i = s; i < s + n; ++i) {
      int64_t beaten_by = 0;
      for (int64_t j = s; j < s + n; ++j) {
        const bool beats = by_probs ? score_sorted[size_t(j)] > score_sorted[size_t(i)] ||
                                          (score_sorted[size_t(j)] == score_sorted[size_t(i)] &&
                                           token_sorted[size_t(j)] < token_sorted[size_t(i)])
                                    : j < i;
        beaten_by += beats;
      }
      if (keep ? !(*keep)[size_t(i)] : beaten_by >= cap) continue;
      new_row[size_t(i)] = int64_t(d.token_sorted.size());
      d.rows.insert(d.rows.end(), rows.row(i), rows.row(i) + rows.row_bytes);
      d.token_sorted.push_back(token_sorted[size_t(i)]);
      d.score_sorted.push_back(score_sorted[size_t(i)]);  // no renormalisation
      ++kept;
    }
    for (int64_t f = kept; pad && f < cap; ++f) {  // zero filler rows, score 0, no token
      d.rows.insert(d.rows.end(), rows.row_bytes, uint8_t(0));
      d.token_sorted.push_back(-1);
      d.score_sorted.push_back(0.f);
    }
    d.counts.push_back(pad ? cap : kept);
    s += n;
  }
  for (int32_t r : row_of) d.row_of.push_back(r >= 0 ? int32_t(new_row[size_t(r)]) : -1);
  return d;
}

}  // namespace ref
