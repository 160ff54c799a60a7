// What `fuzz` (moeverify's own fast paths) and `fuzz --impl` (a user's
// implementation) share: the verdict of one configuration and the shrinking
// of a failing one, whoever judges it.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "fuzz.h"
#include "report.h"

namespace moev {

/// What one configuration gave: the first check that did not pass.
struct Verdict {
  Outcome outcome = Outcome::PASSED;
  std::string check;  // slot/variant/tensor, tensor without its @rank
  std::string key;    // slot/tensor: what shrinking must keep failing
  std::string note;
};

/// The verdict of a report: its outcome and the first check with it.
/// `against` names the compared values in the note ("fast", "yours").
Verdict verdict_of(const CaseReport& r, const char* mine = "fast");

/// A YAML node as one flow line.
std::string flow(const YAML::Node& n);

/// The largest token count of any rank of a configuration.
int64_t tokens_of(const std::string& yaml);

/// Judges one configuration (its YAML flow text).
using JudgeFn = std::function<Verdict(const std::string& yaml)>;
/// A shrink candidate as it must run (nullopt: not a configuration to try:
/// invalid, or outside the profile).
using FitFn = std::function<std::optional<std::string>(const std::string& yaml)>;

/// Shrinks a failing configuration while it fails the same check (slot and
/// tensor) with the same outcome, trying smaller configurations in a fixed
/// order (fewer tokens and ranks, smaller D, F, E, K, then options back to
/// their defaults); at most `budget` configurations are judged (`runs`).
std::string shrink(const std::string& yaml, const Verdict& v, const JudgeFn& judge, const FitFn& fit, int budget,
                   int& runs);

/// The comment lines that head a shrunk case file, given its path and case name.
using HeaderFn = std::function<std::string(const std::string& path, const std::string& name)>;
/// Writes failure f's shrunk case as OUT/fuzz_SEED_INDEX.yaml under its
/// header (--out was checked before the first draw; a link at the path is
/// not followed). Returns the path, or "" with the reason added to f.note.
std::string write_shrunk_case(const FuzzOptions& o, FuzzFailure& f, const HeaderFn& header);

/// The bound of a replay line as the run was given it: " --iterations N"
/// (the same configurations: configuration i depends on the seed and i
/// alone) and/or " --seconds S".
std::string replay_bound(const FuzzOptions& o);

/// Checks --out (made when missing) before the first draw and says, in one
/// line on `progress`, which case files of earlier runs it already holds
/// (kept: they may be someone's; a configuration of the same seed failing
/// again replaces its own), so that they are not taken for this run's.
void prepare_out_dir(const FuzzOptions& o, std::ostream& progress);

}  // namespace moev
