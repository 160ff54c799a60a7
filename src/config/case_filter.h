// --case of run, bench and export: names or shell patterns over the expanded
// sweep names (`name[key=value,...]`).
#pragma once

#include <fnmatch.h>

#include <string>
#include <vector>

#include "error.h"

namespace moev {

/// A pattern selects a name it equals (so a sweep name's own brackets need
/// no escaping), every point of a sweep it names, or a name it matches as a
/// shell glob (`*`, `?`, `[...]`; a pattern ending in `[key=value,...]`
/// keeps those brackets literal). No
/// pattern: every case. An empty pattern, or one that selects nothing in the
/// files given, is bad input naming it.
struct CaseFilter {
  std::vector<std::string> patterns;

  bool selects(const std::string& name) const {
    if (patterns.empty()) return true;
    for (const auto& p : patterns)
      if (matches(p, name)) return true;
    return false;
  }
  /// A swept case's base name selects every point: `fp8_local` selects
  /// `fp8_local[dispatch.scale=fp32]` and the others.
  /// A pattern that names a sweep point (`BASE[key=value,...]`) takes its
  /// brackets literally, only BASE as a pattern: as a glob, `x[ep=2]` would
  /// also select `x2` and `xe`, and a near miss would select those silently.
  static bool matches(const std::string& p, const std::string& name) {
    if (p == name) return true;
    const size_t b = p.find('[');
    if (b != std::string::npos && p.back() == ']' && p.find('=', b) != std::string::npos) {
      const size_t nb = name.find('[');
      return nb != std::string::npos && name.compare(nb, std::string::npos, p, b, std::string::npos) == 0 &&
             fnmatch(p.substr(0, b).c_str(), name.substr(0, nb).c_str(), 0) == 0;
    }
    return fnmatch(p.c_str(), name.c_str(), 0) == 0 ||
           (name.size() > p.size() && name[p.size()] == '[' && name.compare(0, p.size(), p) == 0);
  }
  /// A note about a case entry (its base name; "" for the whole file) is
  /// said where the entry, or any of its sweep's points in `names`, is selected.
  bool selects_entry(const std::string& base, const std::vector<std::string>& names) const {
    if (base.empty() || selects(base)) return true;
    for (const auto& n : names)
      if (of_entry(n, base) && selects(n)) return true;
    return false;
  }
  /// Whether case `name` is entry `base` or a point of its sweep (base[...]).
  static bool of_entry(const std::string& name, const std::string& base) {
    return name == base ||
           (name.size() > base.size() && name[base.size()] == '[' && name.compare(0, base.size(), base) == 0);
  }
  void check_not_empty() const {
    for (const auto& p : patterns)
      if (p.empty()) bad_input("--case: the name is empty; valid: a case name or pattern as `moeverify validate FILE` lists names");
  }
  /// After selecting: every pattern must have selected some name.
  void check_each_used(const std::vector<std::string>& names, const std::string& where) const {
    for (const auto& p : patterns) {
      bool used = false;
      for (const auto& n : names) used = used || matches(p, n);
      if (!used)
        bad_input("--case " + printable(p) + ": no case of that name or pattern in " + where +
                  "; valid: a name as `moeverify validate FILE` lists it, or a pattern such as 'ep4_*'");
    }
  }
};

}  // namespace moev
