// Helpers shared by the test files.
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "case.h"

/// The case `name` of the shipped file cases/`file` (fails the test if absent).
inline moev::Case case_named(const std::string& file, const std::string& name) {
  for (const moev::Case& c : moev::load_cases(std::string(MOEV_SOURCE_DIR) + "/cases/" + file, {}))
    if (c.name == name) return c;
  FAIL("no case " << name << " in " << file);
  return {};
}
