// A case as JSON: the golden manifest's "case" and the run report's
// "config" (docs/json-schema.md).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "case.h"

namespace moev {

/// The resolved configuration of a case as {dotted key: value}; loading it
/// back with case_from_json gives the same case (tokens resolved per rank).
nlohmann::ordered_json case_to_json(const Case& c);
/// The case of a manifest's "case" object, validated as a case file entry;
/// `where` names the manifest in messages. Throws Error(bad_input).
Case case_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace moev
