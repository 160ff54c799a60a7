// What each case key means, in one sentence: docs/case-keys.md is generated
// from it and the schema (`moeverify validate --keys --markdown`).
#pragma once

#include <string>

namespace moev {

/// The meaning of a dotted case key ("" when undocumented: a test requires
/// every key of the schema to have one).
std::string case_key_meaning(const std::string& key);

/// docs/case-keys.md: every key with its valid values, default and meaning.
std::string case_keys_markdown();

}  // namespace moev
