// Profiles (docs/guide.md "Profiles"): what an implementation computes and
// what it supports, as a YAML file of case keys.
//
//   profile: torchtitan            # a name for messages (optional)
//   about: one line                # optional
//   fix:                           # keys every configuration gets
//     experts.rounding: torchtitan
//   allow:                         # keys the generator may draw, restricted
//     ep: [1, 2, 4]                #   to these values
//     shape.tokens: {min: 0, max: 32}   # or to this range (shape.tokens: every rank's tokens)
//
// `moeverify export --profile P` applies `fix` to every case and leaves out
// (naming why) the cases outside `allow`; `fuzz --impl --profile P` draws
// only configurations inside P; `validate --profile P` explains a bad file.
// A profile NAME is a file NAME.yaml of the shipped profiles folder
// (cases/profiles, installed under share/moeverify/cases/profiles); anything
// with a '/' or ending in .yaml is a file path.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "case.h"

namespace moev {

/// Values are kept as YAML flow text and parsed where used: yaml-cpp nodes
/// share memory between copies, and the fuzz's jobs use a profile at once.
struct Profile {
  struct Fix {
    std::string key;
    std::string value;  // YAML flow text
    int line = 0;
    bool from_set = false;  // given as `fuzz --set KEY=VALUE`, not by the profile's file
  };
  struct Allow {
    std::string key;
    std::vector<std::string> values;  // YAML flow text; or, when empty, the range [min, max]
    double min = 0, max = 0;
    bool integer = true;  // the range's bounds are integers: draw integers
    int line = 0;
    /// "{a, b}" or "[min, max]", as messages show the rule.
    std::string text() const;
  };
  std::string name, about, file;
  std::vector<Fix> fix;
  std::vector<Allow> allow;

  /// The names of the fixed keys.
  std::set<std::string> fixed_keys() const;
  /// Whether entry `entry` of a case file (its base name; its sweep's points
  /// are entry[...]) has a case among `cases` inside the profile that
  /// `selected` keeps: the notes about its keys are about such a case.
  bool keeps_entry(const std::string& entry, const std::vector<Case>& cases,
                   const std::function<bool(const std::string&)>& selected) const;
  /// The fixed keys as `--set` strings ("key=value").
  std::vector<std::string> sets() const;
  /// The user's `--set` strings followed by the fixed keys: a --set of a
  /// fixed key is dropped where its value is the profile's, refused (bad
  /// input naming the profile's value) where it is not.
  std::vector<std::string> sets_after(const std::vector<std::string>& user) const;
  /// Why case `c` lies outside the profile ("" when it lies inside).
  std::string violation(const Case& c) const;
  /// The drawn configuration `yaml` (a flow mapping of one case) made to
  /// fit: fixed keys set, drawn values outside `allow` replaced by allowed
  /// ones (picked by `pick_seed`). nullopt, and `why`, when the result does
  /// not load or still lies outside.
  std::optional<std::string> conform(const std::string& yaml, uint64_t pick_seed, std::string& why) const;
  /// Every drawn configuration `yaml` judged inside the profile as it stands
  /// (fixed keys re-applied): for shrinking, which must not leave it.
  std::optional<std::string> refit(const std::string& yaml, std::string& why) const;
};

/// `fuzz --set KEY=VALUE...` as fixed keys added to `base` (null: no
/// profile; the result then has no file and no name). A key `base` fixes
/// to the same value is dropped, to another refused; a value outside
/// `base`'s allow rule for its key refused; name, seed, sweep and backend
/// (the --backend flag's) refused; the fixed keys together must make a
/// valid case. Refusals are bad input naming the --set.
Profile with_sets(const Profile* base, const std::vector<std::string>& sets);

/// Configuration `i` of the fuzz stream `seed`, inside `p` (null: any): the
/// plain draw when it fits, else the profile's repair of it, else the draws
/// of other seeds; nullopt (and `why`, the last refusal) after 200 tries.
std::optional<std::string> draw_configuration(const Profile* p, uint64_t seed, uint64_t i, std::string& why);

/// Refuses (bad_input, exit 2) a profile that configuration 0 of `seed`
/// cannot be drawn inside: its allowed values make no valid case together
/// (experts 3 beside ep 2). Null: nothing to check.
void require_profile_fits(const Profile* p, uint64_t seed);

/// Loads and validates a profile: NAME or FILE (see above). Throws
/// Error(bad_input) naming the file, the line and what would be valid.
Profile load_profile(const std::string& name_or_file);

/// The shipped profiles' folder that exists ("" when none): the installed
/// one beside the binary first, then this build's source tree.
std::string profiles_dir();

}  // namespace moev
