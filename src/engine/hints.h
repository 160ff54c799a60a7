// Diagnosing hints on an INCORRECT check (docs/guide.md "Checking an
// implementation moeverify did not write: export and check"): patterns that
// say why values differ, appended to the note of every check make_check
// makes, for `run` and `check` alike.
#pragma once

#include <string>

#include "stage.h"

namespace moev {

/// The convention keys (docs/contract.md §14) that change a stage's values by
/// a rounding: the keys a one-rounding mismatch there may point at; nullptr
/// for a stage no key rounds.
const char* rounding_keys(const std::string& slot);

/// Appends hints to an INCORRECT check of `yours` against `want` at `slot`
/// (`in`: the rank's board, for the counts that group dispatch rows). Each
/// names a pattern, not a verdict: all zeros where values were expected;
/// every mismatch one rounding apart where a convention key changes that
/// rounding; the same rows per expert in another order (a sort that is not
/// stable).
void add_hints(Check& ch, const std::string& slot, const Tensor& yours, const Tensor& want, const RankBoard& in);

}  // namespace moev
