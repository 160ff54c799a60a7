#include "profile.h"

#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "case_filter.h"
#include "case_json.h"
#include "case_schema.h"
#include "error.h"
#include "random_case.h"

namespace moev {
namespace {

const char* const kValid = "valid: keys profile, about, fix (key: value) and allow (key: [values] or {min: a, max: b})";

std::string emit_flow(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

std::string at(const std::string& file, const YAML::Node& n) { return case_detail::at_line_col(file, n.Mark()); }

/// A small case every single key can be set on (E = 840 is a multiple of
/// every EP size up to 8; D = 256 of every FP8 block): values are checked
/// on it as --set overrides, so that they are judged by the case loader itself.
const char* const kProbeCase = "{name: profile, shape: {tokens: 8, hidden: 256, ffn: 8, experts: 840, top_k: 2}}";

/// The loader's verdict on `sets` over the probe case ("" when valid).
std::string probe(const std::vector<std::string>& sets) {
  try {
    load_cases_text(std::string("cases:\n  - ") + kProbeCase + "\n", "profile", sets);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

/// Every case key `validate --keys` lists, except those a profile cannot
/// restrict (a case's name and seed are the generator's).
bool profile_key(const std::string& k) {
  if (k == "name" || k == "seed" || k == "sweep") return false;
  for (const auto& [key, help] : case_keys())
    if (key == k) return true;
  return false;
}

bool same_value(const nlohmann::ordered_json& j, const std::string& text) {
  const YAML::Node v = YAML::Load(text);
  if (!v.IsScalar()) return emit_flow(v) == emit_flow(YAML::Load(j.dump()));
  if (j.is_number()) {
    try {
      const double a = j.get<double>(), b = v.as<double>();
      return a == b || std::fabs(a - b) <= 1e-6 * std::max(std::fabs(a), std::fabs(b));
    } catch (const YAML::Exception&) {
      return false;
    }
  }
  return j.is_string() && j.get<std::string>() == v.Scalar();
}

/// The values of key `k` in case `c`: one, or one per rank for shape.tokens
/// (every rank's token count). Empty when the key does not apply (an FP8 key
/// without FP8 dispatch): no rule can be broken there.
std::vector<nlohmann::ordered_json> values_of(const Case& c, const nlohmann::ordered_json& j, const std::string& k) {
  if (k == "shape.tokens") {
    std::vector<nlohmann::ordered_json> v;
    for (int r = 0; r < c.ep; ++r) v.push_back(c.tokens_on(r));
    return v;
  }
  if (j.contains(k)) return {j[k]};
  const nlohmann::ordered_json left = keys_left_out(c);  // at their defaults: still the case's values
  if (left.contains(k)) return {left[k]};
  return {};
}

bool allowed(const Profile::Allow& a, const nlohmann::ordered_json& j) {
  if (a.values.empty()) return j.is_number() && j.get<double>() >= a.min && j.get<double>() <= a.max;
  for (const auto& v : a.values)
    if (same_value(j, v)) return true;
  return false;
}

/// Sets case key `key` on a drawn configuration where the configuration
/// holds it (its nested section when it has one), so that the loader never
/// sees the key twice. shape.tokens replaces every other token-count key.
void set_key(YAML::Node& n, const std::string& key, const std::string& text) {
  const YAML::Node v = YAML::Load(text);
  const YAML::Node& cn = n;
  if (cn[key]) n.remove(key);
  const size_t dot = key.find('.');
  if (dot == std::string::npos) {
    n[key] = v;
    return;
  }
  const std::string sec = key.substr(0, dot), leaf = key.substr(dot + 1);
  if (cn[sec] && cn[sec].IsMap()) {
    YAML::Node s = n[sec];
    if (key == "shape.tokens")
      for (const char* other : {"tokens_per_rank", "batch", "seq_len"}) s.remove(other);
    s[leaf] = v;
    return;
  }
  n[key] = v;
}

std::string pick(const Profile::Allow& a, std::mt19937_64& g) {
  if (!a.values.empty())
    return a.values[size_t(std::uniform_int_distribution<size_t>(0, a.values.size() - 1)(g))];
  std::ostringstream o;
  o.precision(17);
  if (a.integer) o << std::uniform_int_distribution<int64_t>(int64_t(a.min), int64_t(a.max))(g);
  else o << std::uniform_real_distribution<double>(a.min, a.max)(g);
  return o.str();
}

/// The `--set` strings of the allow rules with a single value that is valid
/// alone (a bad key or value is refused at its own line, read_allow_rule):
/// every case the profile admits has that value.
std::vector<std::string> pinned(const YAML::Node& allow) {
  std::vector<std::string> s;
  if (allow && allow.IsMap())
    for (const auto& kv : allow) {
      const std::string k = kv.first.Scalar();
      if (!kv.second.IsSequence() || kv.second.size() != 1 || k == "shape.tokens" || !profile_key(k)) continue;
      const std::string set = k + "=" + emit_flow(kv.second[0]);
      if (probe({set}).empty()) s.push_back(set);
    }
  return s;
}

/// The profile's fixed keys and `pins` (pinned()) but key `own`'s, with
/// `own`'s value `value` after them when given.
std::vector<std::string> probe_sets(const Profile& p, const std::vector<std::string>& pins, const std::string& own = "",
                                    const std::string& value = "") {
  std::vector<std::string> s;
  for (const auto& pin : pins)
    if (own.empty() || pin.compare(0, own.size() + 1, own + "=") != 0) s.push_back(pin);
  for (const auto& f : p.sets()) s.push_back(f);
  if (!own.empty()) s.push_back(own + "=" + value);
  return s;
}

/// The loader's verdict on the profile's fixed keys (and `own`'s `value`):
/// "" when they make a valid case with the pinned values or without them (a
/// fixed score_on_hidden needs the swiglu experts a profile allows alone; an
/// sp the profile allows may need the force-LB it pins off), else the error
/// with the pins.
std::string probe_profile(const Profile& p, const std::vector<std::string>& pins, const std::string& own = "",
                          const std::string& value = "") {
  const std::string with = probe(probe_sets(p, pins, own, value));
  if (with.empty() || probe(probe_sets(p, {}, own, value)).empty()) return "";
  return with;
}

void read_fix(Profile& p, const YAML::Node& fix, const std::vector<std::string>& pins) {
  if (!fix.IsMap()) bad_input(at(p.file, fix) + ": fix: expected a mapping of case keys to values; " + kValid);
  for (const auto& kv : fix) {
    const std::string k = kv.first.Scalar();
    if (!profile_key(k))
      bad_input(at(p.file, kv.first) + ": fix: '" + printable(k) + "' is not a case key a profile can fix; valid: "
                "the keys of `moeverify validate --keys` but name, seed and sweep");
    p.fix.push_back({k, emit_flow(kv.second), int(kv.first.Mark().line) + 1});
  }
  const std::string err = probe_profile(p, pins);
  if (err.empty()) return;
  // The loader names the key it refused ("--set KEY: ..."): point at its line.
  for (const auto& f : p.fix)
    if (err.find("--set " + f.key) != std::string::npos)
      bad_input(p.file + ":" + std::to_string(f.line) + ": fix " + f.key + ": " + err);
  bad_input(at(p.file, fix) + ": fix: the fixed keys do not make a valid case together: " + err);
}

Profile::Allow read_allow_rule(const Profile& p, const YAML::Node& key, const YAML::Node& v,
                               const std::vector<std::string>& pins) {
  const std::string k = key.Scalar();
  Profile::Allow a;
  a.key = k;
  a.line = int(key.Mark().line) + 1;
  const std::string where = at(p.file, key) + ": allow " + k + ": ";
  if (!profile_key(k))
    bad_input(at(p.file, key) + ": allow: '" + printable(k) + "' is not a case key a profile can restrict; valid: the "
              "keys of `moeverify validate --keys` but name, seed and sweep");
  for (const auto& f : p.fix)
    if (f.key == k) bad_input(where + "also fixed (line " + std::to_string(f.line) + "); valid: fix it or allow values, not both");
  if (v.IsSequence() && v.size() > 0) {
    for (const auto& e : v) {
      // shape.tokens alone: the profile's other keys may give the tokens per rank
      const std::string err = k == "shape.tokens" ? probe({k + "=" + emit_flow(e)}) : probe_profile(p, pins, k, emit_flow(e));
      if (!err.empty()) bad_input(at(p.file, e) + ": allow " + k + ": " + err);
      a.values.push_back(emit_flow(e));
    }
    return a;
  }
  if (v.IsMap() && v.size() == 2 && v["min"] && v["max"]) {
    try {
      a.min = v["min"].as<double>();
      a.max = v["max"].as<double>();
    } catch (const YAML::Exception&) {
      bad_input(where + "min and max must be numbers; valid: {min: 0, max: 32}");
    }
    if (!(a.min <= a.max)) bad_input(where + "min is above max; valid: {min: a, max: b} with a <= b");
    a.integer = a.min == std::floor(a.min) && a.max == std::floor(a.max) && std::fabs(a.max) < 1e15;
    // both ends must be values of the key (a range over an enum key, or
    // past the key's range, would refuse every draw far from this line)
    for (const char* end : {"min", "max"}) {
      const std::string text = a.integer ? std::to_string(int64_t(end[1] == 'i' ? a.min : a.max)) : emit_flow(v[end]);
      const std::string err = k == "shape.tokens" ? probe({k + "=" + text}) : probe_profile(p, pins, k, text);
      if (!err.empty()) bad_input(at(p.file, v[end]) + ": allow " + k + ": " + end + " " + text + ": " + err);
    }
    return a;
  }
  bad_input(where + "expected a non-empty list of values or {min: a, max: b}; valid: e.g. [1, 2, 4] or {min: 0, max: 32}");
}

}  // namespace

std::string Profile::Allow::text() const {
  if (values.empty()) {
    std::ostringstream o;
    o << "[" << min << ", " << max << "]";
    return o.str();
  }
  std::string s;
  for (const auto& v : values) s += (s.empty() ? "" : ", ") + v;
  return "{" + s + "}";
}

std::set<std::string> Profile::fixed_keys() const {
  std::set<std::string> k;
  for (const auto& f : fix) k.insert(f.key);
  return k;
}

std::vector<std::string> Profile::sets_after(const std::vector<std::string>& user) const {
  const auto bare = [](std::string v) {  // a value as written, quotes off
    if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front()) v = v.substr(1, v.size() - 2);
    return v;
  };
  std::vector<std::string> all;
  for (const std::string& s : user) {
    const size_t eq = s.find('=');
    const std::string key = s.substr(0, eq);
    const auto f = std::find_if(fix.begin(), fix.end(), [&](const Fix& x) { return x.key == key; });
    if (f == fix.end() || eq == std::string::npos) {
      all.push_back(s);
    } else if (bare(s.substr(eq + 1)) != bare(f->value)) {
      bad_input("--set " + printable(s, 200) + ": profile " + printable(name, 200) + " fixes " + key + " to " +
                printable(f->value, 200) + "; valid: that value, or a profile that does not fix " + key + " (" +
                printable(file, 200) + " is the profile's file)");
    }
  }
  for (const auto& s : sets()) all.push_back(s);
  return all;
}

bool Profile::keeps_entry(const std::string& entry, const std::vector<Case>& cases,
                          const std::function<bool(const std::string&)>& selected) const {
  for (const Case& c : cases)
    if (CaseFilter::of_entry(c.name, entry) && selected(c.name) && violation(c).empty()) return true;
  return false;
}

std::vector<std::string> Profile::sets() const {
  std::vector<std::string> s;
  for (const auto& f : fix) s.push_back(f.key + "=" + f.value);
  return s;
}

std::string Profile::violation(const Case& c) const {
  const nlohmann::ordered_json j = case_to_json(c);
  for (const auto& f : fix)
    for (const auto& v : values_of(c, j, f.key))
      if (!same_value(v, f.value))
        return f.key + " is " + v.dump() + " where the profile fixes " + f.value;
  for (const auto& a : allow)
    for (const auto& v : values_of(c, j, a.key))
      if (!allowed(a, v)) return a.key + " is " + v.dump() + ", outside the profile's " + a.text();
  return "";
}

namespace {

/// The configuration as it stands, when it loads and lies inside `p`.
std::optional<std::string> inside(const Profile& p, const YAML::Node& n, std::string& why) {
  const std::string text = emit_flow(n);
  try {
    why = p.violation(load_one_case(text, "profile"));
  } catch (const Error& e) {
    why = e.what();
  }
  if (why.empty()) return text;
  return std::nullopt;
}

}  // namespace

std::optional<std::string> Profile::refit(const std::string& yaml, std::string& why) const {
  YAML::Node n = YAML::Load(yaml);
  for (const auto& f : fix) set_key(n, f.key, f.value);
  return inside(*this, n, why);
}

std::optional<std::string> Profile::conform(const std::string& yaml, uint64_t pick_seed, std::string& why) const {
  std::mt19937_64 g(pick_seed * 0x9E3779B97F4A7C15ull + 0x50524full);
  YAML::Node n = YAML::Load(yaml);
  for (const auto& f : fix) set_key(n, f.key, f.value);
  // The allow rules of one value hold in every case the profile admits: set
  // with the fixes, before the draw is first loaded, since a fixed key may
  // need them (a fixed score_on_hidden needs the swiglu experts a rule
  // allows alone). Loaded without them, most draws failed on the fixes and
  // some seeds found no configuration in 200 draws.
  for (const auto& a : allow)
    if (a.values.size() == 1 && a.key != "shape.tokens") set_key(n, a.key, a.values[0]);
  try {
    const Case c = load_one_case(emit_flow(n), "profile");
    const nlohmann::ordered_json j = case_to_json(c);
    for (const auto& a : allow)
      for (const auto& v : values_of(c, j, a.key))
        if (!allowed(a, v)) {
          set_key(n, a.key, pick(a, g));
          break;
        }
  } catch (const Error& e) {
    why = e.what();
    return std::nullopt;
  }
  return inside(*this, n, why);
}

std::optional<std::string> draw_configuration(const Profile* p, uint64_t seed, uint64_t i, std::string& why) {
  if (!p) return random_case_yaml(seed, i);
  for (uint64_t attempt = 0; attempt < 200; ++attempt) {
    const uint64_t s = attempt == 0 ? seed : seed ^ (0xD1B54A32D192ED03ull * attempt);
    if (auto y = p->conform(random_case_yaml(s, i), s + i, why)) return y;
  }
  return std::nullopt;
}

std::string profiles_dir() {
  std::vector<std::string> dirs;
  char exe[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len > 0) {
    const std::filesystem::path bin = std::filesystem::path(std::string(exe, size_t(len))).parent_path();
    dirs.push_back((bin.parent_path() / "share/moeverify/cases/profiles").string());
  }
#ifdef MOEVERIFY_SOURCE_DIR
  dirs.push_back(MOEVERIFY_SOURCE_DIR "/cases/profiles");
#endif
  for (const auto& d : dirs)
    if (std::filesystem::is_directory(d)) return d;
  return "";
}

Profile load_profile(const std::string& name_or_file) {
  if (name_or_file.empty()) bad_input("--profile: the name is empty; valid: a shipped profile name or a profile file");
  std::string file = name_or_file;
  const bool is_path = name_or_file.find('/') != std::string::npos ||
                       (name_or_file.size() > 5 && name_or_file.substr(name_or_file.size() - 5) == ".yaml");
  if (!is_path) {
    const std::string dir = profiles_dir();
    std::set<std::string> names;
    if (!dir.empty())
      for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().extension() == ".yaml") names.insert(e.path().stem().string());
    if (!names.count(name_or_file)) {
      std::string v;
      for (const auto& n : names) v += (v.empty() ? "" : ", ") + n;
      bad_input("--profile " + printable(name_or_file) + ": no such shipped profile" +
                (dir.empty() ? " (no profiles folder found)" : " in " + dir) + "; valid: " +
                (v.empty() ? std::string("a profile file path") : v + ", or a profile file path"));
    }
    file = dir + "/" + name_or_file + ".yaml";
  }
  std::ifstream in(file);
  if (!in || std::filesystem::is_directory(file))
    bad_input("--profile " + printable(file, 200) + ": cannot open the profile file; valid: a shipped profile name or a "
              "readable YAML file");
  std::string text;
  if (!case_detail::read_at_most(in, size_t(1) << 20, text))  // a profile is a few dozen lines
    bad_input("--profile " + printable(file, 200) + ": the profile file is larger than 1 MiB; " + kValid);
  const YAML::Node root = case_detail::parse_checked(text, file, kValid);
  Profile p;
  p.file = file;
  p.name = std::filesystem::path(file).stem().string();
  if (!root.IsMap()) bad_input(file + ": expected a mapping at the top; " + kValid);
  for (const auto& kv : root) {
    const std::string k = kv.first.Scalar();
    if (k == "profile" || k == "about") {
      if (!kv.second.IsScalar()) bad_input(at(file, kv.second) + ": " + k + ": expected one line of text; " + kValid);
      (k == "profile" ? p.name : p.about) = kv.second.Scalar();
    } else if (k != "fix" && k != "allow") {
      bad_input(at(file, kv.first) + ": unknown key '" + printable(k) + "'; " + kValid);
    }
  }
  const std::vector<std::string> pins = pinned(root["allow"]);
  if (root["fix"]) read_fix(p, root["fix"], pins);
  if (const YAML::Node allow = root["allow"]) {
    if (!allow.IsMap()) bad_input(at(file, allow) + ": allow: expected a mapping of case keys to values; " + kValid);
    for (const auto& kv : allow) p.allow.push_back(read_allow_rule(p, kv.first, kv.second, pins));
  }
  return p;
}

Profile with_sets(const Profile* base, const std::vector<std::string>& sets) {
  Profile p = base ? *base : Profile{};
  std::set<std::string> seen;
  for (const std::string& s : sets) {
    const size_t eq = s.find('=');
    const std::string key = s.substr(0, std::min(eq, s.size())), shown = "--set " + printable(s, 200);
    if (eq == std::string::npos || eq == 0)
      bad_input(shown + ": expected KEY=VALUE; valid: a case key and its value, e.g. --set combine.order=any");
    if (key == "backend")
      bad_input(shown + ": the fuzz draws on the backend --backend names; valid: --backend " + s.substr(eq + 1));
    if (!profile_key(key))
      bad_input(shown + ": '" + printable(key) + "' is not a case key the fuzz can fix; valid: the keys of "
                "`moeverify validate --keys` but name, seed, sweep and backend");
    if (!seen.insert(key).second)
      bad_input(shown + ": " + key + " is given twice; valid: one --set per key");
    YAML::Node v;
    try {
      v = YAML::Load(s.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      bad_input(shown + ": the value is not YAML (" + e.msg + "); valid: a value as a case file writes it");
    }
    if (base && base->fixed_keys().count(key)) {
      base->sets_after({s});  // refuses another value than the profile's
      continue;               // the profile's own value: nothing to add
    }
    for (const auto& a : p.allow) {
      if (a.key != key || !v.IsScalar()) continue;
      nlohmann::ordered_json j = v.Scalar();
      try {
        j = v.as<double>();
      } catch (const YAML::Exception&) {
      }
      if (!allowed(a, j))
        bad_input(shown + ": profile " + printable(p.name, 200) + " allows " + key + " only in " + a.text() + " (" +
                  printable(p.file, 200) + ":" + std::to_string(a.line) + "); valid: such a value, or a profile "
                  "without that rule");
    }
    p.fix.push_back({key, emit_flow(v), 0, true});
  }
  // The keys as one case: refused where they alone break it (a profile
  // whose fixed keys need its allowed values to load is left to the draws).
  if (const std::string err = probe(p.sets()); !err.empty() && (!base || probe(base->sets()).empty()))
    bad_input("fuzz --set: the fixed keys do not make a valid case together: " + err);
  return p;
}

void require_profile_fits(const Profile* p, uint64_t seed) {
  std::string why;
  const bool sets = p && std::any_of(p->fix.begin(), p->fix.end(), [](const Profile::Fix& f) { return f.from_set; });
  if (p && !draw_configuration(p, seed, 0, why))
    bad_input((p->file.empty() ? std::string("fuzz --set") : "--profile " + p->file + (sets ? " with --set" : "")) +
              ": no configuration in 200 draws lies inside it; the last refused: " + why +
              "; valid: a profile whose allowed values make valid cases together");
}

}  // namespace moev
