// Case files: schema, strict validation with file:line:column, sweeps.
//
// File layout:
//   defaults: { <case keys> }        # optional, applied under every case
//   cases:
//     - name: my_case                # required, unique after sweep expansion
//       <case keys>                  # nested maps or dotted keys: shape.top_k
//       sweep: { dtype: [fp32, bf16], shape.top_k: [1, 2] }   # optional
#include "case.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <sstream>

#include "datagen.h"
#include "error.h"

namespace moev {

const EnumTable<DType>& dtype_table() {
  static const EnumTable<DType> t = {{"fp32", DType::fp32}, {"bf16", DType::bf16}, {"fp16", DType::fp16}};
  return t;
}
const EnumTable<DataMode>& data_mode_table() {
  static const EnumTable<DataMode> t = {{"exact", DataMode::exact}, {"realistic", DataMode::realistic}};
  return t;
}
const EnumTable<k::ScoreFunc>& score_table() {
  static const EnumTable<k::ScoreFunc> t = {{"softmax", k::ScoreFunc::softmax}, {"sigmoid", k::ScoreFunc::sigmoid}};
  return t;
}
const EnumTable<ExpertKind>& expert_kind_table() {
  static const EnumTable<ExpertKind> t = {{"identity", ExpertKind::identity}, {"swiglu", ExpertKind::swiglu}};
  return t;
}
const EnumTable<ExpertsImpl>& experts_impl_table() {
  static const EnumTable<ExpertsImpl> t = {
      {"loop", ExpertsImpl::loop}, {"grouped", ExpertsImpl::grouped}, {"batched", ExpertsImpl::batched}};
  return t;
}
const EnumTable<SharedKind>& shared_kind_table() {
  static const EnumTable<SharedKind> t = {
      {"none", SharedKind::none}, {"identity", SharedKind::identity}, {"swiglu", SharedKind::swiglu}};
  return t;
}
const EnumTable<SharedOrder>& shared_order_table() {
  static const EnumTable<SharedOrder> t = {{"add_after", SharedOrder::add_after},
                                           {"init_with_shared", SharedOrder::init_with_shared}};
  return t;
}
const EnumTable<k::Accumulate>& accumulate_table() {
  static const EnumTable<k::Accumulate> t = {{"per_add", k::Accumulate::per_add},
                                             {"fp32_accumulate", k::Accumulate::fp32_accumulate}};
  return t;
}
const EnumTable<CombinePlacement>& placement_table() {
  static const EnumTable<CombinePlacement> t = {{"out_of_place", CombinePlacement::out_of_place},
                                                {"in_place", CombinePlacement::in_place}};
  return t;
}
const EnumTable<OutBuffer>& out_buffer_table() {
  static const EnumTable<OutBuffer> t = {
      {"fresh", OutBuffer::fresh}, {"alias_x", OutBuffer::alias_x}, {"alias_x_offset", OutBuffer::alias_x_offset}};
  return t;
}
const EnumTable<Switch>& switch_table() {
  static const EnumTable<Switch> t = {{"off", Switch::off}, {"on", Switch::on}};
  return t;
}
const EnumTable<EmptyGroups>& empty_groups_table() {
  static const EnumTable<EmptyGroups> t = {{"zero", EmptyGroups::zero}, {"pad", EmptyGroups::pad}};
  return t;
}
const EnumTable<PermuteMode>& permute_table() {
  static const EnumTable<PermuteMode> t = {
      {"auto", PermuteMode::auto_}, {"generic", PermuteMode::generic}, {"equal_count", PermuteMode::equal_count}};
  return t;
}
const EnumTable<EqualSplitPolicy>& equal_split_table() {
  static const EnumTable<EqualSplitPolicy> t = {
      {"off", EqualSplitPolicy::off}, {"force", EqualSplitPolicy::force}, {"adaptive", EqualSplitPolicy::adaptive}};
  return t;
}
const EnumTable<CompareClass>& compare_class_table() {
  static const EnumTable<CompareClass> t = {{"exact", CompareClass::exact},
                                            {"logits", CompareClass::logits},
                                            {"scores", CompareClass::scores},
                                            {"gemm", CompareClass::gemm},
                                            {"end_to_end", CompareClass::end_to_end},
                                            {"rounding", CompareClass::rounding}};
  return t;
}

int64_t Case::tokens_on(int rank) const {
  if (!tokens_per_rank.empty()) return tokens_per_rank[size_t(rank)];
  if (tokens_uniform_lo >= 0) {  // a pure function of (seed, rank): every process draws the same
    const double u = hash_uniform(seed, 0x7043, uint64_t(rank), 0, 0);
    return tokens_uniform_lo + std::min<int64_t>(int64_t(u * double(tokens_uniform_hi - tokens_uniform_lo + 1)),
                                                 tokens_uniform_hi - tokens_uniform_lo);
  }
  return tokens;
}

std::string Case::summary() const {
  std::ostringstream o;
  if (tokens_uniform_lo >= 0) {
    o << "T~U[" << tokens_uniform_lo << "," << tokens_uniform_hi << "]";
  } else if (tokens_per_rank.empty()) {
    o << "T=" << tokens;
  } else {
    o << "T=[";
    for (size_t i = 0; i < tokens_per_rank.size(); ++i) o << (i ? "," : "") << tokens_per_rank[i];
    o << "]";
  }
  o << " D=" << hidden << " F=" << ffn << " E=" << num_experts << " K=" << top_k << " "
    << dtype_name(dtype) << " data=" << enum_name(data_mode_table(), data) << " seed=" << seed
    << " router=" << enum_name(score_table(), router.score)
    << (router.force_load_balance == Switch::on ? "+force_lb" : "")
    << (router.bias == Switch::on ? "+bias" : "")
    << (router.groups > 1 ? "+groups" + std::to_string(router.groups) + "/" + std::to_string(router.limited_groups) : "")
    << " experts=" << enum_name(expert_kind_table(), experts.kind) << "/" << enum_name(experts_impl_table(), experts.impl)
    << " shared=" << enum_name(shared_kind_table(), shared.kind)
    << " combine=" << enum_name(accumulate_table(), combine.accumulate) << "/"
    << enum_name(placement_table(), combine.placement) << "/" << enum_name(out_buffer_table(), combine.buffer);
  if (ep > 1 || align > 1) {
    if (equal_split.policy != EqualSplitPolicy::off)
      o << " equal_split=" << enum_name(equal_split_table(), equal_split.policy) << "@" << equal_split.threshold;
    o << " ep=" << ep << " align=" << align << "/" << enum_name(empty_groups_table(), empty_groups)
      << " permute=" << enum_name(permute_table(), permute);
  }
  return o.str();
}

namespace {

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

std::string where(const Src& s) {
  const YAML::Mark m = s.node.Mark();
  if (m.line < 0) return s.file;
  return s.file + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
}

[[noreturn]] void fail_at(const Src& s, const std::string& key, const std::string& what,
                          const std::string& valid) {
  bad_input(where(s) + ": " + key + ": " + what + "; " + valid);
}

std::string scalar_text(const Src& s) {
  if (s.node.IsScalar()) return "'" + s.node.Scalar() + "'";
  if (s.node.IsSequence()) return "a list";
  if (s.node.IsMap()) return "a mapping";
  return "nothing";
}

int64_t as_int(const Src& s, const std::string& key, int64_t lo, int64_t hi) {
  const std::string valid = "valid: an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!s.node.IsScalar()) fail_at(s, key, "expected an integer, got " + scalar_text(s), valid);
  int64_t v = 0;
  try {
    v = s.node.as<int64_t>();
  } catch (const YAML::Exception&) {
    fail_at(s, key, "expected an integer, got " + scalar_text(s), valid);
  }
  if (v < lo || v > hi) fail_at(s, key, "value " + std::to_string(v) + " is out of range", valid);
  return v;
}

double as_real(const Src& s, const std::string& key, double lo, double hi) {
  std::ostringstream vs;
  vs << "valid: a number in [" << lo << ", " << hi << "]";
  if (!s.node.IsScalar()) fail_at(s, key, "expected a number, got " + scalar_text(s), vs.str());
  double v = 0;
  try {
    v = s.node.as<double>();
  } catch (const YAML::Exception&) {
    fail_at(s, key, "expected a number, got " + scalar_text(s), vs.str());
  }
  if (!std::isfinite(v) || v < lo || v > hi) fail_at(s, key, "value " + s.node.Scalar() + " is out of range", vs.str());
  return v;
}

template <class E>
E as_enum(const Src& s, const std::string& key, const EnumTable<E>& table) {
  std::string valid = "valid: ";
  for (size_t i = 0; i < table.size(); ++i) valid += (i ? " | " : "") + std::string(table[i].first);
  if (!s.node.IsScalar()) fail_at(s, key, "expected one word, got " + scalar_text(s), valid);
  std::string v = s.node.Scalar();
  if (std::is_same_v<E, Switch>) {  // YAML booleans are accepted for on/off switches
    if (v == "true" || v == "yes") v = "on";
    if (v == "false" || v == "no") v = "off";
  }
  for (const auto& [n, e] : table)
    if (v == n) return e;
  fail_at(s, key, "unknown value '" + v + "'", valid);
}

using Setter = std::function<void(Case&, const Src&, const std::string&)>;

struct Field {
  std::string path;
  std::string help;
  Setter set;
};

template <class E>
Field enum_field(const std::string& path, const EnumTable<E>& t, std::function<E&(Case&)> ref) {
  std::string help;
  for (size_t i = 0; i < t.size(); ++i) help += (i ? " | " : "") + std::string(t[i].first);
  return {path, help, [&t, ref](Case& c, const Src& s, const std::string& k) { ref(c) = as_enum(s, k, t); }};
}

Field int_field(const std::string& path, int64_t lo, int64_t hi, std::function<void(Case&, int64_t)> set) {
  return {path, "integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
          [=](Case& c, const Src& s, const std::string& k) { set(c, as_int(s, k, lo, hi)); }};
}

const std::vector<Field>& schema() {
  static const std::vector<Field> f = [] {
    std::vector<Field> v;
    v.push_back({"name", "case name (string)", [](Case& c, const Src& s, const std::string& k) {
                   if (!s.node.IsScalar() || s.node.Scalar().empty())
                     fail_at(s, k, "expected a non-empty name", "valid: a word such as exact_fp32");
                   c.name = s.node.Scalar();
                 }});
    v.push_back(int_field("shape.tokens", 0, 1 << 24, [](Case& c, int64_t x) { c.tokens = x; }));
    v.push_back(int_field("shape.hidden", 1, 1 << 16, [](Case& c, int64_t x) { c.hidden = x; }));
    v.push_back(int_field("shape.ffn", 1, 1 << 16, [](Case& c, int64_t x) { c.ffn = x; }));
    v.push_back(int_field("shape.experts", 1, 4096, [](Case& c, int64_t x) { c.num_experts = int(x); }));
    v.push_back(int_field("shape.top_k", 1, k::kMaxTopK, [](Case& c, int64_t x) { c.top_k = int(x); }));
    v.push_back(enum_field<DType>("dtype", dtype_table(), [](Case& c) -> DType& { return c.dtype; }));
    v.push_back(int_field("seed", 0, std::numeric_limits<int64_t>::max(), [](Case& c, int64_t x) { c.seed = uint64_t(x); }));
    v.push_back(enum_field<DataMode>("data", data_mode_table(), [](Case& c) -> DataMode& { return c.data; }));
    v.push_back(enum_field<k::ScoreFunc>("router.score", score_table(), [](Case& c) -> k::ScoreFunc& { return c.router.score; }));
    v.push_back(enum_field<Switch>("router.bias", switch_table(), [](Case& c) -> Switch& { return c.router.bias; }));
    v.push_back(int_field("router.groups", 1, k::kMaxGroups, [](Case& c, int64_t x) { c.router.groups = int(x); }));
    v.push_back(int_field("router.limited_groups", 1, k::kMaxGroups, [](Case& c, int64_t x) { c.router.limited_groups = int(x); }));
    v.push_back(enum_field<Switch>("router.force_load_balance", switch_table(), [](Case& c) -> Switch& { return c.router.force_load_balance; }));
    v.push_back(enum_field<Switch>("router.route_norm", switch_table(), [](Case& c) -> Switch& { return c.router.route_norm; }));
    v.push_back({"router.route_scale", "number in (0, 1e6]", [](Case& c, const Src& s, const std::string& k) {
                   const double x = as_real(s, k, 0, 1e6);
                   if (x <= 0) fail_at(s, k, "route_scale must be positive", "valid: a number in (0, 1e6]");
                   c.router.route_scale = float(x);
                 }});
    v.push_back(int_field("router.hot_expert", -1, 4095, [](Case& c, int64_t x) { c.router.hot_expert = int(x); }));
    v.push_back(enum_field<ExpertKind>("experts.kind", expert_kind_table(), [](Case& c) -> ExpertKind& { return c.experts.kind; }));
    v.push_back(enum_field<ExpertsImpl>("experts.impl", experts_impl_table(), [](Case& c) -> ExpertsImpl& { return c.experts.impl; }));
    v.push_back(enum_field<SharedKind>("shared_experts.kind", shared_kind_table(), [](Case& c) -> SharedKind& { return c.shared.kind; }));
    v.push_back(enum_field<SharedOrder>("shared_experts.order", shared_order_table(), [](Case& c) -> SharedOrder& { return c.shared.order; }));
    v.push_back(enum_field<Switch>("score_before_experts", switch_table(), [](Case& c) -> Switch& { return c.score_before_experts; }));
    v.push_back(enum_field<k::Accumulate>("combine.accumulate", accumulate_table(), [](Case& c) -> k::Accumulate& { return c.combine.accumulate; }));
    v.push_back(enum_field<CombinePlacement>("combine.placement", placement_table(), [](Case& c) -> CombinePlacement& { return c.combine.placement; }));
    v.push_back(enum_field<OutBuffer>("combine.buffer", out_buffer_table(), [](Case& c) -> OutBuffer& { return c.combine.buffer; }));
    v.push_back(int_field("combine.alias_offset", 1, int64_t(1) << 40, [](Case& c, int64_t x) { c.combine.alias_offset = x; }));
    v.push_back(int_field("ep", 1, 256, [](Case& c, int64_t x) { c.ep = int(x); }));
    v.push_back({"shape.tokens_per_rank", "list of ep integers >= 0, or {uniform: [lo, hi]} drawn per rank from the seed",
                 [](Case& c, const Src& s, const std::string& k) {
                   const std::string valid = "valid: [T_0, T_1, ...] one per EP rank, or {uniform: [lo, hi]}";
                   if (s.node.IsMap()) {
                     const YAML::Node u = s.node["uniform"];
                     if (s.node.size() != 1 || !u || !u.IsSequence() || u.size() != 2)
                       fail_at(s, k, "expected {uniform: [lo, hi]}", valid);
                     c.tokens_uniform_lo = as_int({u[0], s.file}, k + ".uniform", 0, 1 << 24);
                     c.tokens_uniform_hi = as_int({u[1], s.file}, k + ".uniform", c.tokens_uniform_lo, 1 << 24);
                     return;
                   }
                   if (!s.node.IsSequence() || s.node.size() == 0)
                     fail_at(s, k, "expected a non-empty list of token counts", valid);
                   c.tokens_per_rank.clear();
                   for (const auto& e : s.node) c.tokens_per_rank.push_back(as_int({e, s.file}, k, 0, 1 << 24));
                 }});
    v.push_back(int_field("align", 1, 4096, [](Case& c, int64_t x) { c.align = x; }));
    v.push_back(enum_field<EmptyGroups>("empty_groups", empty_groups_table(), [](Case& c) -> EmptyGroups& { return c.empty_groups; }));
    v.push_back(enum_field<PermuteMode>("permute", permute_table(), [](Case& c) -> PermuteMode& { return c.permute; }));
    v.push_back(enum_field<EqualSplitPolicy>("equal_split.policy", equal_split_table(),
                                             [](Case& c) -> EqualSplitPolicy& { return c.equal_split.policy; }));
    v.push_back({"equal_split.threshold", "number in [0, 10] (padding overhead fraction)",
                 [](Case& c, const Src& s, const std::string& k) { c.equal_split.threshold = as_real(s, k, 0, 10); }});
    for (const auto& [cname, cls] : compare_class_table()) {
      if (cls == CompareClass::exact || cls == CompareClass::rounding) continue;
      const std::string base = std::string("tolerance.") + cname;
      for (const char* part : {"rtol", "atol"}) {
        const bool is_rtol = std::string(part) == "rtol";
        const CompareClass cl = cls;
        v.push_back({base + "." + part, "number in [0, 1]", [cl, is_rtol](Case& c, const Src& s, const std::string& k) {
                       const double x = as_real(s, k, 0, 1);
                       Tolerance& t = c.tolerance_override[cl];
                       (is_rtol ? t.rtol : t.atol) = x;
                     }});
      }
    }
    return v;
  }();
  return f;
}

bool is_leaf(const std::string& p) {
  for (const auto& f : schema())
    if (f.path == p) return true;
  return false;
}

bool is_section(const std::string& p) {
  for (const auto& f : schema())
    if (f.path.rfind(p + ".", 0) == 0) return true;
  return false;
}

std::string keys_under(const std::string& prefix) {
  std::set<std::string> keys;
  for (const auto& f : schema()) {
    if (!prefix.empty() && f.path.rfind(prefix + ".", 0) != 0) continue;
    const std::string rest = prefix.empty() ? f.path : f.path.substr(prefix.size() + 1);
    keys.insert(rest.substr(0, rest.find('.')));
  }
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
  return s;
}

using Flat = std::map<std::string, Src>;

/// Flattens a mapping of case keys into dotted leaf paths, rejecting unknown keys.
void flatten(const YAML::Node& map, const std::string& prefix, const std::string& file, Flat& out,
             const std::set<std::string>& extra_ok) {
  if (!map.IsMap()) {
    fail_at({map, file}, prefix.empty() ? "case" : prefix, "expected a mapping, got " + scalar_text({map, file}),
            "valid keys: " + keys_under(prefix));
  }
  for (const auto& kv : map) {
    const Src key{kv.first, file};
    if (!kv.first.IsScalar()) fail_at(key, "key", "expected a plain key", "valid keys: " + keys_under(prefix));
    const std::string path = (prefix.empty() ? "" : prefix + ".") + kv.first.Scalar();
    if (prefix.empty() && extra_ok.count(path)) continue;
    if (is_leaf(path)) {
      out[path] = Src{kv.second, file};
    } else if (is_section(path) && kv.second.IsMap()) {
      flatten(kv.second, path, file, out, extra_ok);
    } else if (is_section(path)) {
      fail_at({kv.second, file}, path, "expected a mapping of " + keys_under(path), "valid keys: " + keys_under(path));
    } else {
      fail_at(key, path, "unknown key", "valid keys here: " + keys_under(prefix));
    }
  }
}

std::string loc(const Flat& flat, const std::string& path, const Case& c) {
  auto it = flat.find(path);
  return it == flat.end() ? c.source + " (default " + path + ")" : where(it->second);
}

void validate(const Case& c, const Flat& flat) {
  auto fail = [&](const std::string& path, const std::string& what, const std::string& valid) {
    bad_input(loc(flat, path, c) + ": " + path + ": " + what + "; " + valid);
  };
  const int E = c.num_experts, K = c.top_k;
  if (K > E)
    fail("shape.top_k", "top_k " + std::to_string(K) + " exceeds experts " + std::to_string(E),
         "valid: 1 <= top_k <= experts (" + std::to_string(E) + ")");
  const int G = c.router.groups, L = c.router.limited_groups;
  if (E % G != 0)
    fail("router.groups", "experts " + std::to_string(E) + " are not divisible by groups " + std::to_string(G),
         "valid: a divisor of experts");
  if (G > 1 && E / G < 2)
    fail("router.groups", "each group needs at least 2 experts (group score = sum of its two largest)",
         "valid: groups <= experts / 2 = " + std::to_string(E / 2));
  if (L > G)
    fail("router.limited_groups", "limited_groups " + std::to_string(L) + " exceeds groups " + std::to_string(G),
         "valid: 1 <= limited_groups <= groups");
  if (G > 1 && int64_t(L) * (E / G) < K)
    fail("router.limited_groups", "the kept groups hold " + std::to_string(L * (E / G)) + " experts, fewer than top_k",
         "valid: limited_groups * experts / groups >= top_k");
  if (c.router.hot_expert >= E)
    fail("router.hot_expert", "expert " + std::to_string(c.router.hot_expert) + " does not exist",
         "valid: -1 (none) or 0 <= hot_expert < experts (" + std::to_string(E) + ")");
  if (E % c.ep != 0)
    fail("ep", "experts " + std::to_string(E) + " are not divisible by ep " + std::to_string(c.ep),
         "valid: ep a divisor of experts (experts are split in contiguous blocks of experts/ep)");
  if (!c.tokens_per_rank.empty() && int(c.tokens_per_rank.size()) != c.ep)
    fail("shape.tokens_per_rank", "has " + std::to_string(c.tokens_per_rank.size()) + " entries for ep " + std::to_string(c.ep),
         "valid: exactly ep entries, one per rank");
  if (c.combine.buffer != OutBuffer::fresh) {
    if (c.shared.kind != SharedKind::identity || c.shared.order != SharedOrder::init_with_shared)
      fail("combine.buffer", "an output buffer aliasing x models an identity shared expert that returns x",
           "valid: shared_experts {kind: identity, order: init_with_shared} with this buffer, or buffer: fresh");
    for (int r = 0; r < c.ep; ++r)
      if (c.tokens_on(r) == 0)
        fail("combine.buffer", "an aliasing buffer needs tokens > 0 on every rank", "valid: buffer: fresh when a rank has no tokens");
  }
  int64_t min_tokens = c.tokens;
  for (int r = 0; r < c.ep; ++r) min_tokens = std::min(min_tokens, c.tokens_on(r));
  if (c.combine.buffer == OutBuffer::alias_x_offset && c.combine.alias_offset >= min_tokens * c.hidden)
    fail("combine.alias_offset", "offset " + std::to_string(c.combine.alias_offset) + " leaves no overlap with x",
         "valid: 1 <= alias_offset < tokens*hidden = " + std::to_string(min_tokens * c.hidden));
  if (c.shared.kind == SharedKind::none && c.shared.order == SharedOrder::init_with_shared)
    fail("shared_experts.order", "init_with_shared needs a shared expert",
         "valid: shared_experts.kind identity | swiglu, or order add_after");
}

Case build_case(const Flat& flat, const std::string& source) {
  Case c;
  c.source = source;
  for (const auto& f : schema()) {
    auto it = flat.find(f.path);
    if (it != flat.end()) f.set(c, it->second, f.path);
  }
  validate(c, flat);
  return c;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> case_keys() {
  std::vector<std::pair<std::string, std::string>> r;
  for (const auto& f : schema()) r.push_back({f.path, f.help});
  return r;
}

std::vector<Case> load_cases(const std::string& path, const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    bad_input(path + ": cannot open the case file; give a readable YAML file such as cases/basic.yaml");
  } catch (const YAML::ParserException& e) {
    bad_input(path + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1) +
              ": YAML syntax error: " + e.msg + "; valid: a YAML mapping with 'cases' (and optional 'defaults')");
  }
  const Src rootsrc{root, path};
  if (!root.IsMap())
    fail_at(rootsrc, "file", "expected a mapping at the top", "valid: keys 'cases' (a list) and optional 'defaults'");
  for (const auto& kv : root) {
    const std::string k = kv.first.as<std::string>();
    if (k != "cases" && k != "defaults")
      fail_at({kv.first, path}, k, "unknown top-level key", "valid: cases, defaults");
  }
  if (!root["cases"] || !root["cases"].IsSequence() || root["cases"].size() == 0)
    fail_at(rootsrc, "cases", "missing or empty", "valid: a non-empty list of case mappings");

  Flat defaults;
  if (root["defaults"]) flatten(root["defaults"], "", path, defaults, {});

  Flat cli;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      bad_input("--set " + o + ": expected key=value; valid keys: see `moeverify validate --keys`");
    const std::string key = o.substr(0, eq);
    if (!is_leaf(key)) bad_input("--set " + o + ": unknown key '" + key + "'; valid keys: see `moeverify validate --keys`");
    cli[key] = Src{YAML::Load(o.substr(eq + 1)), "--set " + key};
  }

  std::vector<Case> out;
  std::set<std::string> names;
  for (const auto& entry : root["cases"]) {
    const Src esrc{entry, path};
    const std::string source = path + ":" + std::to_string(entry.Mark().line + 1);
    Flat flat = defaults;
    Flat own;
    flatten(entry, "", path, own, {"sweep"});
    for (auto& [k, v] : own) flat[k] = v;
    if (!own.count("name")) fail_at(esrc, "name", "every case needs a name", "valid: name: <word>");

    // sweep: path -> list of values; the cartesian product in key order
    std::vector<std::pair<std::string, std::vector<Src>>> axes;
    if (entry.IsMap() && entry["sweep"]) {
      const YAML::Node sw = entry["sweep"];
      if (!sw.IsMap()) fail_at({sw, path}, "sweep", "expected a mapping key -> list", "valid: sweep: {dtype: [fp32, bf16]}");
      for (const auto& kv : sw) {
        const std::string key = kv.first.as<std::string>();
        if (!is_leaf(key) || key == "name")
          fail_at({kv.first, path}, "sweep." + key, "not a sweepable key", "valid: a case key such as shape.top_k or dtype");
        if (!kv.second.IsSequence() || kv.second.size() == 0)
          fail_at({kv.second, path}, "sweep." + key, "expected a non-empty list of values", "valid: [v1, v2, ...]");
        std::vector<Src> vals;
        for (const auto& v : kv.second) vals.push_back({v, path});
        axes.push_back({key, vals});
      }
    }
    std::vector<size_t> idx(axes.size(), 0);
    while (true) {
      Flat f = flat;
      std::string suffix;
      for (size_t a = 0; a < axes.size(); ++a) {
        f[axes[a].first] = axes[a].second[idx[a]];
        suffix += (suffix.empty() ? "[" : ",") + axes[a].first + "=" + axes[a].second[idx[a]].node.Scalar();
      }
      if (!suffix.empty()) suffix += "]";
      for (auto& [k, v] : cli) f[k] = v;
      Case c = build_case(f, source);
      c.name += suffix;
      if (!names.insert(c.name).second)
        fail_at(esrc, "name", "duplicate case name '" + c.name + "'", "valid: names unique within the file");
      out.push_back(std::move(c));
      size_t a = 0;
      while (a < axes.size() && ++idx[a] == axes[a].second.size()) idx[a++] = 0;
      if (a == axes.size()) break;
    }
  }
  return out;
}

}  // namespace moev
