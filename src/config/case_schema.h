// The case schema (docs/architecture.md "Configuration"): the one table of
// every case key with its help text and the setter that reads its YAML
// value into a Case, and the value readers the setters share. Internal to
// src/config/: case_schema.cpp holds the table, case_yaml.cpp reads case
// files and `--set` overrides through it, case_validate.cpp builds a Case
// from the flattened keys and checks it whole. Everyone else reads case.h.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <istream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "case.h"

namespace moev {
namespace case_detail {

/// A YAML value together with the file it came from, for error locations.
struct Src {
  YAML::Node node;
  std::string file;
  Src() = default;
  Src(YAML::Node n, std::string f) : node(std::move(n)), file(std::move(f)) {}
  Src(const Src&) = default;
  // YAML::Node::operator= writes *through* the handle into the document; an
  // override must rebind the handle instead, or it overwrites the defaults.
  Src& operator=(const Src& o) {
    node.reset(o.node);
    file = o.file;
    return *this;
  }
};

/// Reads `in` to its end into `text`; false as soon as more than `cap`
/// bytes came (the rest unread).
bool read_at_most(std::istream& in, size_t cap, std::string& text);
/// One YAML document checked as a case file is (no control bytes, no second
/// document, every quote closed, every mapping's keys plain and given once),
/// for YAML files that are not case files (profiles); errors name FILE:LINE.
YAML::Node parse_checked(const std::string& text, const std::string& file, const std::string& valid);

/// FILE:LINE:COLUMN of a YAML mark (FILE alone where the mark has no line).
std::string at_line_col(const std::string& file, const YAML::Mark& m);
/// Where a value came from: FILE:LINE:COLUMN.
std::string where(const Src& s);

/// Throws bad input "WHERE: KEY: WHAT; VALID".
/// `key` may be user text (an unknown key): it is escaped and capped here;
/// `what` and `valid` escape the user values they quote themselves.
[[noreturn]] void fail_at(const Src& s, const std::string& key, const std::string& what, const std::string& valid);

/// How a value reads in a message: 'scalar', a list, a mapping, nothing.
std::string scalar_text(const Src& s);

/// An integer in [lo, hi], or bad input naming the range.
int64_t as_int(const Src& s, const std::string& key, int64_t lo, int64_t hi);
/// A finite number in [lo, hi], or bad input naming the range.
double as_real(const Src& s, const std::string& key, double lo, double hi);

using Setter = std::function<void(Case&, const Src&, const std::string&)>;

struct Field {
  std::string path;
  std::string help;
  Setter set;
};

/// Every case key in one table, in the order `validate --keys` lists them
/// and build_case applies them.
const std::vector<Field>& schema();

/// A key of the table (a leaf such as shape.top_k).
bool is_leaf(const std::string& path);
/// A prefix of keys (a section such as shape).
bool is_section(const std::string& path);
/// The key names one level under `prefix` ("" for the top) and `extra`,
/// sorted.
std::set<std::string> key_set_under(const std::string& prefix, const std::set<std::string>& extra = {});
/// Every settable key's full dotted path.
const std::set<std::string>& leaf_paths();
/// Key names comma-separated, in order.
std::string join_keys(const std::set<std::string>& keys);
/// The key names one level under `prefix`, comma-separated.
std::string keys_under(const std::string& prefix);

/// Case keys by dotted path, each with the YAML value and file it came from.
using Flat = std::map<std::string, Src>;

/// The Case of one expanded entry (case_validate.cpp): every key of `flat`
/// set through the table, shape.seq_len resolved into tokens, then the
/// whole case validated (bad input naming the key and what would be valid).
Case build_case(const Flat& flat, const std::string& source);

}  // namespace case_detail
}  // namespace moev
