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
