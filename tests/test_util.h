// Helpers shared by the test files.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "case.h"
#include "runner.h"

/// The case `name` of the shipped file cases/`file` (fails the test if absent).
inline moev::Case case_named(const std::string& file, const std::string& name) {
  for (const moev::Case& c : moev::load_cases(std::string(MOEV_SOURCE_DIR) + "/cases/" + file, {}))
    if (c.name == name) return c;
  FAIL("no case " << name << " in " << file);
  return {};
}

/// Whether a check fails a property test of the token path: INCORRECT,
/// ERROR or NOT_SUPPORTED. NOT_VERIFIED is data that cannot show a bug (a
/// rank whose one token of small exact data is all zero; router gradients
/// that cancel), not a failure: each such stage's own tests judge it, and
/// the properties assert their invariants on the data besides.
inline bool token_path_fails(const moev::Check& ch) {
  return ch.outcome != moev::Outcome::PASSED && ch.outcome != moev::Outcome::NOT_VERIFIED;
}

/// "slot/tensor" of every check of `r` that did not pass.
inline std::vector<std::string> failing(const moev::CaseReport& r) {
  std::vector<std::string> v;
  for (const auto& ch : r.checks)
    if (ch.outcome != moev::Outcome::PASSED) v.push_back(ch.slot + "/" + ch.tensor);
  return v;
}

/// Whether some entry of v starts with `prefix`.
inline bool any_starts(const std::vector<std::string>& v, const std::string& prefix) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& s) { return s.rfind(prefix, 0) == 0; });
}
