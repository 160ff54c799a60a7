// Case files and `--set` overrides (docs/architecture.md "Configuration"):
// reading and parsing the YAML, flattening it into case keys through the
// schema table (case_schema.cpp), expanding sweeps, one Case per entry.
//
// File layout:
//   defaults: { <case keys> }        # optional, applied under every case
//   cases:
//     - name: my_case                # required, unique after sweep expansion
//       <case keys>                  # nested maps or dotted keys: shape.top_k
//       sweep: { dtype: [fp32, bf16], shape.top_k: [1, 2] }   # optional
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>

#include "case_json.h"
#include "case_schema.h"
#include "error.h"

namespace moev {
namespace {

using namespace case_detail;

/// Every key of `map` is a plain scalar and appears once. yaml-cpp keeps both
/// entries of a repeated key, and the last one would silently win; a complex
/// key (`? [a, b]`) has no name to look up.
void check_keys(const YAML::Node& map, const std::string& file, const std::string& prefix, const std::string& valid) {
  std::map<std::string, YAML::Mark> seen;
  for (const auto& kv : map) {
    const Src key{kv.first, file};
    const std::string here = prefix.empty() ? "key" : prefix;
    if (!kv.first.IsScalar())
      fail_at(key, here, "expected a plain key, got " + scalar_text(key) + " (a complex YAML key)", valid);
    if (kv.first.Scalar() == "<<" && kv.first.Tag() == "?")  // a plain << (yaml-cpp keeps merge keys as such); "<<" is a key
      fail_at(key, here, "a YAML merge key (<<: *anchor), which case files do not expand",
              "valid: the keys written out; keys every case shares go under defaults:, values per case in a sweep");
    const auto [it, fresh] = seen.emplace(kv.first.Scalar(), kv.first.Mark());
    if (!fresh)
      fail_at(key, (prefix.empty() ? "" : prefix + ".") + kv.first.Scalar(),
              "duplicate key (first at line " + std::to_string(it->second.line + 1) + ")",
              "valid: each key once per mapping");
  }
}

/// Flattens a mapping of case keys into dotted leaf paths, rejecting unknown
/// keys, and a leaf given twice in one mapping tree (`shape: {tokens: 4}`
/// beside `shape.tokens: 8`).
void flatten(const YAML::Node& map, const std::string& prefix, const std::string& file, Flat& out,
             const std::set<std::string>& extra_ok) {
  if (!map.IsMap()) {
    fail_at({map, file}, prefix.empty() ? "case" : prefix, "expected a mapping, got " + scalar_text({map, file}),
            "valid keys: " + keys_under(prefix));
  }
  const std::set<std::string> here = key_set_under(prefix, prefix.empty() ? extra_ok : std::set<std::string>{});
  const std::string valid = "valid keys here: " + join_keys(here);
  check_keys(map, file, prefix, valid);
  for (const auto& kv : map) {
    const Src key{kv.first, file};
    const std::string path = (prefix.empty() ? "" : prefix + ".") + kv.first.Scalar();
    if (prefix.empty() && extra_ok.count(path)) continue;
    if (is_leaf(path)) {
      const auto it = out.find(path);
      if (it != out.end())
        fail_at(key, path, "set twice in one mapping (also at " + where(it->second) + ")",
                "valid: each key once, either dotted or nested");
      out[path] = Src{kv.second, file};
    } else if (is_section(path) && kv.second.IsMap()) {
      flatten(kv.second, path, file, out, extra_ok);
    } else if (is_section(path)) {
      fail_at({kv.second, file}, path, "expected a mapping of " + keys_under(path), "valid keys: " + keys_under(path));
    } else {
      // a near miss is named: a dotted key among every key's full path
      const std::string hint = path.find('.', prefix.empty() ? 0 : prefix.size() + 1) != std::string::npos
                                   ? did_you_mean(path, leaf_paths())
                                   : did_you_mean(kv.first.Scalar(), here);
      fail_at(key, path, "unknown key" + hint, valid);
    }
  }
}

/// The bytes of a case file, refusing what cannot be one: a missing path, a
/// folder, an unreadable or oversized file.
std::string read_case_file(const std::string& path) {
  const std::string valid = "valid: a readable YAML case file such as cases/basic.yaml";
  if (path.empty()) bad_input("case file: the path is empty; " + valid);
  const std::string shown = printable(path, 200);
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st))
    bad_input(shown + ": cannot open the case file (" + (ec ? ec.message() : std::string("no such file")) + "); " + valid);
  if (std::filesystem::is_directory(st)) bad_input(shown + ": is a folder, not a case file; " + valid);
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_input(shown + ": cannot open the case file (" + std::strerror(errno) + "); " + valid);
  std::string text;
  if (!read_at_most(in, kMaxCaseFileBytes, text))
    bad_input(shown + ": the case file is larger than " + std::to_string(kMaxCaseFileBytes >> 20) +
              " MiB; valid: a case file of at most " + std::to_string(kMaxCaseFileBytes >> 20) +
              " MiB (use sweeps for many cases)");
  if (in.bad()) bad_input(shown + ": cannot read the case file (" + std::strerror(errno) + "); " + valid);
  return text;
}

/// Rejects bytes YAML does not allow in text (NUL and other C0 controls but
/// tab, LF and CR; DEL): yaml-cpp reports them as odd escape errors, and
/// echoing them would cut or split the one-line message.
void check_bytes(const std::string& text, const std::string& file) {
  int line = 0, col = 0;
  for (const char ch : text) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (u == '\n') {
      ++line;
      col = 0;
      continue;
    }
    if ((u < 0x20 && u != '\t' && u != '\r') || u == 0x7f) {
      YAML::Mark m;
      m.line = line;
      m.column = col;
      bad_input(at_line_col(file, m) + ": control byte " + printable(std::string(1, ch)) +
                " in the text; valid: printable text (YAML allows tab, LF and CR only)");
    }
    ++col;
  }
}

/// One YAML document from `text`; `file` names it in messages ("--set key"
/// for an override). A parse error, a second document and an empty text are
/// bad input.
YAML::Node parse_one(const std::string& text, const std::string& file, const std::string& valid) {
  check_bytes(text, file);
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(text);
  } catch (const YAML::DeepRecursion& e) {
    bad_input(at_line_col(file, e.mark) + ": YAML nested " + std::to_string(e.depth()) +
              " levels deep, the parser's limit; valid: a case file nests a few levels (cases, a case, a section)");
  } catch (const YAML::ParserException& e) {
    if (e.msg == YAML::ErrorMsg::EOF_IN_SCALAR)
      bad_input(at_line_col(file, e.mark) + ": unclosed quote: the text ends inside a quoted string; " +
                "valid: close the quote, or write the value unquoted");
    bad_input(at_line_col(file, e.mark) + ": YAML syntax error: " + printable(e.msg) + "; " + valid);
  } catch (const YAML::Exception& e) {
    bad_input(at_line_col(file, e.mark) + ": YAML error: " + printable(e.msg) + "; " + valid);
  }
  if (docs.size() > 1) {
    YAML::Mark m = docs[1].Mark();
    bad_input(at_line_col(file, m) + ": a second YAML document (after '---') would be ignored; " +
              "valid: one document");
  }
  return docs.empty() ? YAML::Node() : docs[0];
}

/// yaml-cpp takes a quoted scalar whose closing quote is missing to run to the
/// end of the text (`dtype: "fp32` reads as 'fp32 ' plus every later line).
/// Every quoted scalar is therefore checked against the text for its closing
/// quote. Aliases share a node, so each position is visited once.
void check_quotes(const YAML::Node& n, const std::string& text, const std::string& file, std::set<int>& seen) {
  const YAML::Mark m = n.Mark();
  if (m.pos >= 0 && !seen.insert(m.pos).second) return;
  if (n.IsMap()) {
    for (const auto& kv : n) {
      check_quotes(kv.first, text, file, seen);
      check_quotes(kv.second, text, file, seen);
    }
    return;
  }
  if (n.IsSequence()) {
    for (const auto& e : n) check_quotes(e, text, file, seen);
    return;
  }
  if (!n.IsScalar() || m.pos < 0 || size_t(m.pos) >= text.size()) return;
  const char q = text[size_t(m.pos)];
  if (q != '"' && q != '\'') return;
  for (size_t j = size_t(m.pos) + 1; j < text.size(); ++j) {
    if (q == '"' && text[j] == '\\') {
      ++j;  // an escaped character, possibly a quote
    } else if (text[j] == q) {
      if (q == '\'' && j + 1 < text.size() && text[j + 1] == '\'') {
        ++j;  // '' is a quote inside a single-quoted string
      } else {
        return;
      }
    }
  }
  bad_input(at_line_col(file, m) + ": unclosed quote: the " + (q == '"' ? "double" : "single") +
            "-quoted string starting here has no closing " + q + "; valid: close the quote, or write the value unquoted");
}

/// A sweep value as it appears in a case name: scalars as written, lists as
/// [a,b], mappings as {k:v}; at most `budget` characters (an aliased value
/// may be exponentially large).
void render(const YAML::Node& n, std::string& out, size_t budget) {
  if (out.size() > budget) return;
  if (n.IsScalar()) {
    out += n.Scalar();
  } else if (n.IsSequence()) {
    out += "[";
    bool first = true;
    for (const auto& e : n) {
      if (out.size() > budget) return;
      out += first ? "" : ",";
      first = false;
      render(e, out, budget);
    }
    out += "]";
  } else if (n.IsMap()) {
    out += "{";
    bool first = true;
    for (const auto& kv : n) {
      if (out.size() > budget) return;
      out += first ? "" : ",";
      first = false;
      render(kv.first, out, budget);
      out += ":";
      render(kv.second, out, budget);
    }
    out += "}";
  } else {
    out += "null";
  }
}

/// A value as a sweep name shows it: at most 200 characters, a longer one
/// cut there and followed by a hash of the whole, so that two long values
/// that differ past the cut still name two cases.
std::string render(const YAML::Node& n) {
  constexpr size_t kBudget = 200;
  std::string s;
  render(n, s, size_t(1) << 24);  // a case file is at most 16 MiB; aliases may multiply a value past it
  if (s.size() <= kBudget) return s;
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char ch : s) h = (h ^ ch) * 16777619u;
  char tag[16];
  std::snprintf(tag, sizeof tag, "...#%08x", h);
  return s.substr(0, kBudget) + tag;
}

/// The document of a case file, checked at the top: a mapping with `cases`
/// (a non-empty list) and optional `defaults`, nothing else.
YAML::Node parse_root(const std::string& text, const std::string& path) {
  const std::string top_valid = "valid: a YAML mapping with 'cases' (and optional 'defaults')";
  const YAML::Node root = parse_one(text, path, top_valid);
  {
    std::set<int> seen;
    check_quotes(root, text, path, seen);
  }
  const Src rootsrc{root, path};
  if (root.IsNull()) fail_at(rootsrc, "file", "the case file is empty", top_valid);
  if (!root.IsMap())
    fail_at(rootsrc, "file", "expected a mapping at the top", "valid: keys 'cases' (a list) and optional 'defaults'");
  check_keys(root, path, "", "valid top-level keys: cases, defaults");
  for (const auto& kv : root) {
    const std::string k = kv.first.Scalar();
    if (k != "cases" && k != "defaults")
      fail_at({kv.first, path}, k, "unknown top-level key", "valid: cases, defaults");
  }
  if (root["cases"] && !root["cases"].IsNull() && !root["cases"].IsSequence())
    fail_at({root["cases"], path}, "cases", root["cases"].IsMap() ? "a mapping, not a list" : "not a list",
            "valid: a list of case mappings, each item starting with '- ', or cases: [{name: a}]");
  if (!root["cases"] || !root["cases"].IsSequence() || root["cases"].size() == 0)
    fail_at(rootsrc, "cases", "missing or empty", "valid: a non-empty list of case mappings");
  if (root["defaults"] && !root["defaults"].IsMap())
    fail_at({root["defaults"], path}, "defaults", "expected a mapping of case keys, got " +
            scalar_text({root["defaults"], path}), "valid: defaults: {dtype: bf16, ...}");
  return root;
}

/// The `--set key=value` overrides as case keys, each a known key given once;
/// each value is a YAML document of its own, named "--set KEY" in messages.
Flat parse_overrides(const std::vector<std::string>& overrides) {
  Flat cli;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      bad_input("--set " + printable(o) + ": expected key=value; valid keys: see `moeverify validate --keys`");
    const std::string key = o.substr(0, eq);
    if (!is_leaf(key))
      bad_input("--set " + printable(o) + ": unknown key '" + printable(key) + "'" + did_you_mean(key, leaf_paths()) +
                "; valid keys: see `moeverify validate --keys`");
    if (key == "name")
      bad_input("--set name: a case's name is its file's (every case would take one name); valid: select cases "
                "with --case NAME");
    if (cli.count(key))
      bad_input("--set " + printable(key) + ": given twice; valid: each key once (the last would silently win)");
    const std::string value = o.substr(eq + 1);
    const std::string file = "--set " + key;
    const YAML::Node v = parse_one(value, file, "valid: a YAML value such as 128, bf16 or [1, 2]");
    std::set<int> seen;
    check_quotes(v, value, file, seen);
    cli[key] = Src{v, file};
  }
  return cli;
}

/// The sweep axes of one entry: per swept key, its list of values.
using Axes = std::vector<std::pair<std::string, std::vector<Src>>>;

/// The axes of an entry's `sweep: {key: [values]}` in key order, each a
/// sweepable key the entry does not also fix. `count` is set to the number
/// of cases they expand to (saturating past kMaxCasesPerFile), counted
/// before anything is expanded; `done` cases of the file come before them.
Axes sweep_axes(const YAML::Node& entry, const std::string& path, const Flat& own, size_t done, size_t& count) {
  Axes axes;
  count = 1;
  if (!entry["sweep"]) return axes;
  const YAML::Node sw = entry["sweep"];
  YAML::Node sweep_key;  // sweep-wide messages point at the word "sweep"
  for (const auto& kv : entry)
    if (kv.first.Scalar() == "sweep") sweep_key = kv.first;
  if (!sw.IsMap()) fail_at({sw, path}, "sweep", "expected a mapping key -> list", "valid: sweep: {dtype: [fp32, bf16]}");
  check_keys(sw, path, "sweep", "valid: a case key such as shape.top_k or dtype");
  for (const auto& kv : sw) {
    const std::string key = kv.first.Scalar();
    if (!is_leaf(key) || key == "name")
      fail_at({kv.first, path}, "sweep." + key, "not a sweepable key", "valid: a case key such as shape.top_k or dtype");
    if (own.count(key))
      fail_at({kv.first, path}, "sweep." + key, "the case also sets " + key + " at " + where(own.at(key)),
              "valid: either a fixed value or a sweep for each key");
    if (!kv.second.IsSequence() || kv.second.size() == 0)
      fail_at({kv.second, path}, "sweep." + key, "expected a non-empty list of values", "valid: [v1, v2, ...]");
    count = std::min(count * std::min(kv.second.size(), kMaxCasesPerFile + 1), kMaxCasesPerFile + 1);
    if (done + count > kMaxCasesPerFile)
      fail_at({sweep_key, path}, "sweep",
              "expands the file to more than " + std::to_string(kMaxCasesPerFile) + " cases",
              "valid: at most " + std::to_string(kMaxCasesPerFile) + " cases per file after expansion");
    std::vector<Src> vals;
    for (const auto& v : kv.second) vals.push_back({v, path});
    axes.push_back({key, vals});
  }
  return axes;
}

/// Key `k`'s value `v` as a case holds it (set alone on a default case), to
/// compare two spellings (on and true, 1 and 1.0): bad input where `v` is
/// malformed, as it would be without an override replacing it.
nlohmann::ordered_json held_value(const std::string& k, const Src& v) {
  Case scratch;
  for (const auto& f : schema())
    if (f.path == k) f.set(scratch, v, k);
  const nlohmann::ordered_json j = case_to_json(scratch);
  return j.contains(k) ? j[k] : nlohmann::ordered_json(render(v.node));
}

/// The values an entry writes that the overrides `cli` replace (`written`:
/// its first point before them, defaults included; `sweeps`: its swept keys
/// that an override replaces) are checked alone, so that a malformed one is
/// refused as it is without the override; with `notes`, each that differs
/// from the override's value is a LoadNotes::replaced of entry `entry`, in
/// the file's order.
void check_replaced(const std::string& entry, const Flat& written, const Axes& sweeps, const Flat& cli,
                    LoadNotes* notes) {
  std::vector<std::pair<YAML::Mark, LoadNotes::Replaced>> found;
  auto shown = [](const nlohmann::ordered_json& j, const Src& v) {
    return j.is_string() ? j.get<std::string>() : render(v.node);
  };
  for (const auto& [k, vals] : sweeps) {
    const nlohmann::ordered_json now = held_value(k, cli.at(k));
    bool differs = false;
    std::string list;
    for (const Src& v : vals) {
      differs = held_value(k, v) != now || differs;
      list += (list.empty() ? "[" : ", ") + render(v.node);
    }
    if (differs) found.push_back({vals.front().node.Mark(), {entry, k, where(vals.front()), "sweep " + list + "]",
                                                              shown(now, cli.at(k))}});
  }
  for (const auto& [k, v] : cli) {
    if (!written.count(k) || std::any_of(sweeps.begin(), sweeps.end(), [&](const auto& a) { return a.first == k; }))
      continue;
    const nlohmann::ordered_json was = held_value(k, written.at(k)), now = held_value(k, v);
    if (was != now)
      found.push_back({written.at(k).node.Mark(),
                       {entry, k, where(written.at(k)), render(written.at(k).node), shown(now, v)}});
  }
  if (!notes) return;
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first.pos < b.first.pos; });
  for (auto& f : found) notes->replaced.push_back(std::move(f.second));
}

/// Appends the cases of one entry of `cases`: its keys over the defaults,
/// one case per point of the sweep's cartesian product (named NAME[key=value,
/// ...]), the `--set` overrides applied last; names stay unique in the file.
void expand_entry(const YAML::Node& entry, const std::string& path, const Flat& defaults, const Flat& cli,
                  std::vector<Case>& out, std::set<std::string>& names,
                  std::vector<std::pair<std::string, Error>>* misfits, LoadNotes* notes) {
  const size_t first = out.size();
  const Src esrc{entry, path};
  const std::string source = printable(path, 200) + ":" + std::to_string(entry.Mark().line + 1);
  Flat flat = defaults;
  Flat own;
  flatten(entry, "", path, own, {"sweep"});
  for (auto& [k, v] : own) flat[k] = v;
  if (!own.count("name")) fail_at(esrc, "name", "every case needs a name", "valid: name: <word>");
  size_t count = 1;
  Axes axes = sweep_axes(entry, path, own, out.size(), count);
  // The tokens come one way (shape.tokens; shape.seq_len with shape.batch;
  // shape.tokens_per_rank): where the case or its sweep gives them, the
  // defaults' other ways give way.
  const auto gives = [&](const std::string& k) {
    return own.count(k) || std::any_of(axes.begin(), axes.end(), [&](const auto& a) { return a.first == k; });
  };
  const std::vector<std::string> token_keys = {"shape.tokens", "shape.seq_len", "shape.tokens_per_rank"};
  if (std::any_of(token_keys.begin(), token_keys.end(), gives))
    for (const std::string& k : token_keys)
      if (!gives(k)) flat.erase(k);
  // A --set of a swept key replaces the sweep over it (--set of the per-rank
  // tokens a sweep of the count): its points would otherwise be named by
  // values they no longer have.
  const auto replaced = [&](const auto& a) {
    return cli.count(a.first) > 0 ||
           (cli.count("shape.tokens_per_rank") && (a.first == "shape.tokens" || a.first == "shape.seq_len"));
  };
  Axes swept_over;  // swept keys an override replaces (check_replaced)
  for (const auto& a : axes)
    if (cli.count(a.first)) swept_over.push_back(a);
  axes.erase(std::remove_if(axes.begin(), axes.end(), replaced), axes.end());
  if (out.size() + count > kMaxCasesPerFile)
    fail_at(esrc, "cases", "the file has more than " + std::to_string(kMaxCasesPerFile) + " cases",
            "valid: at most " + std::to_string(kMaxCasesPerFile) + " cases per file after expansion");
  std::vector<size_t> idx(axes.size(), 0);
  while (true) {
    Flat f = flat;
    std::string suffix;
    for (size_t a = 0; a < axes.size(); ++a) {
      f[axes[a].first] = axes[a].second[idx[a]];
      suffix += (suffix.empty() ? "[" : ",") + axes[a].first + "=" + render(axes[a].second[idx[a]].node);
    }
    if (!suffix.empty()) suffix += "]";
    const Flat own_point = f;
    for (auto& [k, v] : cli) f[k] = v;
    if (cli.count("shape.tokens_per_rank"))  // per rank, in place of any count (--set shape.tokens beside it too)
      for (const char* k : {"shape.tokens", "shape.seq_len"}) f.erase(k);
    std::optional<Case> c;
    try {
      // shape.tokens_per_rank stands in place of shape.tokens: a --set of the
      // tokens alone would change nothing in such a case, silently.
      if (cli.count("shape.tokens") && !cli.count("shape.tokens_per_rank") && own_point.count("shape.tokens_per_rank"))
        throw Error(ErrorKind::bad_input,
                    source + ": shape.tokens: --set shape.tokens does not apply to a case with shape.tokens_per_rank " +
                        render(own_point.at("shape.tokens_per_rank").node) +
                        " (its tokens per rank); valid: --set shape.tokens_per_rank=[...] for it");
      c = build_case(f, source);
    } catch (const Error& e) {
      // Valid alone, invalid with the overrides: they do not fit this case.
      if (!misfits || e.kind != ErrorKind::bad_input || cli.empty()) throw;
      const Case alone = build_case(own_point, source);  // throws when the case itself is bad
      misfits->push_back({alone.name + suffix, e});
    }
    if (c && out.size() == first && !cli.empty()) check_replaced(c->name, own_point, swept_over, cli, notes);
    if (c) {
      c->name += suffix;
      if (!names.insert(c->name).second)
        fail_at(esrc, "name", "duplicate case name '" + printable(c->name) + "'", "valid: names unique within the file");
      out.push_back(std::move(*c));
    }
    size_t a = 0;
    while (a < axes.size() && ++idx[a] == axes[a].second.size()) idx[a++] = 0;
    if (a == axes.size()) break;
  }
  if (!notes || out.size() == first) return;
  // A key the entry writes that changes none of its cases is named (a
  // key of a sweep point alone, alias_offset beside a swept buffer, is not).
  const std::string base = out[first].name.substr(0, out[first].name.find('['));
  Flat written = own;
  for (const auto& [k, vals] : axes) written[k] = vals.front();
  for (const auto& [k, src] : written) {
    const std::string why = k == "name" ? "" : key_without_effect(k, out[first]);
    if (why.empty() || !std::all_of(out.begin() + long(first), out.end(),
                                    [&](const Case& c) { return !key_without_effect(k, c).empty(); }))
      continue;
    notes->no_effect.push_back({base, where(src) + ": " + k + " has no effect in case " + printable(base, 200) +
                                          (out.size() - first > 1 ? " (in any point of its sweep)" : "") + ": " + why});
  }
}

}  // namespace

namespace case_detail {
bool read_at_most(std::istream& in, size_t cap, std::string& text) {
  std::vector<char> buf(size_t(1) << 16);
  while (in) {  // one buffer past the cap at most: a huge file (or /dev/zero) is not read whole
    in.read(buf.data(), std::streamsize(buf.size()));
    text.append(buf.data(), size_t(in.gcount()));
    if (text.size() > cap) return false;
  }
  return true;
}

YAML::Node parse_checked(const std::string& text, const std::string& file, const std::string& valid) {
  const YAML::Node root = parse_one(text, file, valid);
  std::set<int> seen;
  check_quotes(root, text, file, seen);
  // every mapping's keys plain and once (aliases share nodes: each visited once)
  std::set<int> visited;
  const std::function<void(const YAML::Node&)> keys = [&](const YAML::Node& n) {
    if (n.Mark().pos >= 0 && !visited.insert(n.Mark().pos).second) return;
    if (n.IsMap()) {
      check_keys(n, file, "", valid);
      for (const auto& kv : n) keys(kv.second);
    } else if (n.IsSequence()) {
      for (const auto& e : n) keys(e);
    }
  };
  keys(root);
  return root;
}
}  // namespace case_detail

std::string left_out_cause(bool profile, bool sets) {
  if (!profile) return "--set does not fit it";
  return sets ? "--set or the profile's fixed keys do not fit it" : "the profile's fixed keys do not fit it";
}

std::vector<std::string> replaced_notes(const LoadNotes& notes, const std::string& profile,
                                        const std::set<std::string>& fixed,
                                        const std::function<bool(const std::string&)>& selects) {
  std::vector<std::string> lines;                            // in file order of first mention
  std::map<std::string, std::vector<std::string>> entries;  // line -> the entries it applies to
  for (const LoadNotes::Replaced& r : notes.replaced) {
    if (!fixed.count(r.key) || !selects(r.entry)) continue;
    const std::string line = r.where + ": " + r.key + ": " + r.written + " is replaced by " + r.value +
                             ", which profile " + printable(profile, 200) + " fixes";
    auto [it, fresh] = entries.emplace(line, std::vector<std::string>{});
    if (fresh) lines.push_back(line);
    it->second.push_back(printable(r.entry, 200));
  }
  for (std::string& line : lines) {
    const std::vector<std::string>& e = entries.at(line);
    line += e.size() == 1 ? " (case " + e[0] : " (" + std::to_string(e.size()) + " cases: " + e[0];
    for (size_t i = 1; i < e.size() && i < 4; ++i) line += ", " + e[i];
    line += e.size() > 4 ? ", ...)" : ")";
  }
  return lines;
}

std::string left_out_note(const std::pair<std::string, std::string>& left_out, const std::string& cause) {
  return "case " + printable(left_out.first, 200) + " left out (" + cause + "): " + left_out.second;
}

std::vector<Case> load_cases(const std::string& path, const std::vector<std::string>& overrides, LoadNotes* notes) {
  return load_cases_text(read_case_file(path), path, overrides, notes);
}

std::vector<Case> load_cases_text(const std::string& text, const std::string& path,
                                  const std::vector<std::string>& overrides, LoadNotes* notes) {
  const YAML::Node root = parse_root(text, path);
  Flat defaults;
  if (root["defaults"]) flatten(root["defaults"], "", path, defaults, {});
  if (defaults.count("name"))
    fail_at(defaults.at("name"), "defaults.name", "a name under defaults would name every case alike",
            "valid: name in each case");
  const Flat cli = parse_overrides(overrides);
  std::vector<Case> out;
  std::set<std::string> names;
  std::vector<std::pair<std::string, Error>> misfits;
  // A file the fuzz wrote holds each draw's keys whole (a profile's fixed
  // keys in every case): its keys without effect are not named.
  const bool drawn = text.rfind("# moeverify fuzz", 0) == 0;
  LoadNotes entries;
  for (const auto& entry : root["cases"])
    expand_entry(entry, path, defaults, cli, out, names, notes ? &misfits : nullptr,
                 notes && !drawn ? &entries : nullptr);
  if (!misfits.empty() && out.empty()) throw misfits.front().second;  // the overrides fit no case: refused as before
  if (!notes) return out;
  for (const auto& [name, e] : misfits) notes->left_out.push_back({name, e.what()});
  for (const auto& [k, src] : drawn ? Flat{} : defaults) {
    const std::string why = out.empty() ? "" : key_without_effect(k, out.front());
    if (!why.empty() && std::all_of(out.begin(), out.end(), [&](const Case& c) { return !key_without_effect(k, c).empty(); }))
      notes->no_effect.push_back({"", where(src) + ": defaults: " + k + " has no effect in any case of the file: " + why});
  }
  notes->no_effect.insert(notes->no_effect.end(), entries.no_effect.begin(), entries.no_effect.end());
  notes->replaced = std::move(entries.replaced);
  return out;
}

}  // namespace moev
