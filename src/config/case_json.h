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
/// The keys case_to_json leaves out where they hold what the manifest had
/// before they existed, with c's value: grad_accumulate, dispatch.dtype
/// (act) and, at ep 1, shape.tokens_per_rank. (FP8's other keys are left
/// out because they do not apply: not here.)
nlohmann::ordered_json keys_left_out(const Case& c);
/// The case of a manifest's "case" object, validated as a case file entry;
/// `where` names the manifest in messages. Throws Error(bad_input).
Case case_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace moev
