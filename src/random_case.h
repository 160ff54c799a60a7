// Random valid case configurations over every case key (issue 11: "a
// generator draws random valid configurations over every key"). Each draw is
// a YAML mapping that goes through the same loader and validation as a case
// file, so the generator cannot produce a configuration a user could not
// write. Draws lean toward MoE edge cases: zero-token ranks, one hot expert,
// K = E, E_l = 1, T*K < E, tiny D, large route_scale, exact ties.
#pragma once

#include <cstdint>
#include <string>

namespace moev {

/// The YAML text of case `index` of the stream `seed` (one flow mapping with
/// a name, no trailing newline). Pure function of (seed, index).
std::string random_case_yaml(uint64_t seed, uint64_t index);

}  // namespace moev
