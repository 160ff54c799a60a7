// The case schema table (docs/architecture.md "Configuration"): every case
// key with its help text and setter, grouped by section in the order
// `validate --keys` lists them (docs/case-keys.md), and the value readers
// the setters share.
#include <algorithm>
#include "case_schema.h"

#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <type_traits>

#include "error.h"

namespace moev {
namespace case_detail {

std::string at_line_col(const std::string& file, const YAML::Mark& m) {
  if (m.line < 0) return printable(file, 200);
  // A --set value is one line of its own ("--set KEY" is its file): a
  // place inside it is a column of the value, and its start no place at all.
  if (file.rfind("--set ", 0) == 0)
    return printable(file, 200) + (m.line == 0 && m.column == 0 ? "" : " (column " + std::to_string(m.column + 1) + " of the value)");
  return printable(file, 200) + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
}

std::string where(const Src& s) { return at_line_col(s.file, s.node.Mark()); }

/// `key` may be user text (an unknown key): it is escaped and capped here;
/// `what` and `valid` escape the user values they quote themselves.
[[noreturn]] void fail_at(const Src& s, const std::string& key, const std::string& what,
                          const std::string& valid) {
  bad_input(where(s) + ": " + printable(key) + ": " + what + "; " + valid);
}

std::string scalar_text(const Src& s) {
  if (s.node.IsScalar()) return "'" + printable(s.node.Scalar()) + "'";
  if (s.node.IsSequence()) return "a list";
  if (s.node.IsMap()) return "a mapping";
  return "nothing";
}

int64_t as_int(const Src& s, const std::string& key, int64_t lo, int64_t hi) {
  const std::string valid = "valid: an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (!s.node.IsScalar()) fail_at(s, key, "expected an integer, got " + scalar_text(s), valid);
  // Decimal digits only, as YAML 1.2 reads them: yaml-cpp alone would take
  // 010 as octal 8 (and 08 as no integer) and 0x10 as 16, so a sweep's name
  // would say one value while the case ran another.
  const std::string& t = s.node.Scalar();
  const size_t d0 = !t.empty() && (t[0] == '-' || t[0] == '+') ? 1 : 0;
  const bool digits = t.size() > d0 && t.size() - d0 <= 18 &&
                      std::all_of(t.begin() + long(d0), t.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (!digits) fail_at(s, key, "expected an integer, got " + scalar_text(s), valid + " in decimal digits");
  const int64_t v = std::stoll(t);
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
  if (!std::isfinite(v) || v < lo || v > hi) fail_at(s, key, "value " + printable(s.node.Scalar()) + " is out of range", vs.str());
  return v;
}


namespace {

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
  fail_at(s, key, "unknown value '" + printable(v) + "'", valid);
}

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

/// The case itself: its name, shape, dtype, seed, data mode and backend.
void add_case_keys(std::vector<Field>& v) {
  v.push_back({"name", "case name (string)", [](Case& c, const Src& s, const std::string& k) {
                 if (!s.node.IsScalar() || s.node.Scalar().empty())
                   fail_at(s, k, "expected a non-empty name", "valid: a word such as exact_fp32");
                 const std::string& n = s.node.Scalar();
                 if (n.size() > kMaxCaseNameChars)
                   fail_at(s, k, "the name has " + std::to_string(n.size()) + " characters",
                           "valid: at most " + std::to_string(kMaxCaseNameChars));
                 for (const char ch : n)
                   if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f)
                     fail_at(s, k, "the name '" + printable(n) + "' contains a control character",
                             "valid: printable characters (a report shows the name on one line)");
                 // printable() keeps well-formed UTF-8 and escapes the rest: a
                 // name it changes holds bytes that are no text (a JSON report
                 // would show them replaced, the text report raw).
                 if (printable(n, n.size()) != n)
                   fail_at(s, k, "the name '" + printable(n) + "' is not valid UTF-8 text",
                           "valid: UTF-8 text (a JSON report carries the name as written)");
                 c.name = n;
               }});
  v.push_back(int_field("shape.tokens", 0, 1 << 24, [](Case& c, int64_t x) { c.tokens = x; }));
  v.push_back(int_field("shape.hidden", 1, 1 << 16, [](Case& c, int64_t x) { c.hidden = x; }));
  v.push_back(int_field("shape.ffn", 1, 1 << 16, [](Case& c, int64_t x) { c.ffn = x; }));
  v.push_back(int_field("shape.experts", 1, 4096, [](Case& c, int64_t x) { c.num_experts = int(x); }));
  v.push_back(int_field("shape.top_k", 1, k::kMaxTopK, [](Case& c, int64_t x) { c.top_k = int(x); }));
  v.push_back(enum_field<DType>("dtype", dtype_table(), [](Case& c) -> DType& { return c.dtype; }));
  v.push_back(int_field("seed", 0, std::numeric_limits<int64_t>::max(), [](Case& c, int64_t x) { c.seed = uint64_t(x); }));
  v.push_back(enum_field<DataMode>("data", data_mode_table(), [](Case& c) -> DataMode& { return c.data; }));
  v.push_back(enum_field<Backend>("backend", backend_table(), [](Case& c) -> Backend& { return c.backend; }));
}

/// The router (docs/contract.md §1, §14).
void add_router_keys(std::vector<Field>& v) {
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
  v.push_back(enum_field<GateDtype>("router.gate_dtype", gate_dtype_table(), [](Case& c) -> GateDtype& { return c.router.gate_dtype; }));
  v.push_back(enum_field<GateDtype>("router.score_dtype", gate_dtype_table(), [](Case& c) -> GateDtype& { return c.router.score_dtype; }));
}

/// Experts, shared experts and the combine (docs/contract.md §2, §8, §9, §14).
void add_experts_combine_keys(std::vector<Field>& v) {
  v.push_back(enum_field<k::ScoreMultiply>("score_multiply", score_multiply_table(), [](Case& c) -> k::ScoreMultiply& { return c.score_multiply; }));
  v.push_back(enum_field<k::SiluRounding>("experts.rounding", experts_rounding_table(), [](Case& c) -> k::SiluRounding& { return c.experts.rounding; }));
  v.push_back(enum_field<ComputeDtype>("experts.compute_dtype", compute_dtype_table(), [](Case& c) -> ComputeDtype& { return c.experts.compute_dtype; }));
  v.push_back(enum_field<Switch>("experts.w13_fused", switch_table(), [](Case& c) -> Switch& { return c.experts.w13_fused; }));
  v.push_back(enum_field<WeightStorage>("experts.weights", weight_storage_table(), [](Case& c) -> WeightStorage& { return c.experts.weights; }));
  v.push_back(enum_field<ExpertKind>("experts.kind", expert_kind_table(), [](Case& c) -> ExpertKind& { return c.experts.kind; }));
  v.push_back(enum_field<ExpertsImpl>("experts.impl", experts_impl_table(), [](Case& c) -> ExpertsImpl& { return c.experts.impl; }));
  v.push_back(enum_field<SharedKind>("shared_experts.kind", shared_kind_table(), [](Case& c) -> SharedKind& { return c.shared.kind; }));
  v.push_back(enum_field<SharedOrder>("shared_experts.order", shared_order_table(), [](Case& c) -> SharedOrder& { return c.shared.order; }));
  v.push_back(enum_field<Switch>("score_before_experts", switch_table(), [](Case& c) -> Switch& { return c.score_before_experts; }));
  v.push_back(enum_field<Switch>("score_on_hidden", switch_table(), [](Case& c) -> Switch& { return c.score_on_hidden; }));
  v.push_back(enum_field<k::Accumulate>("combine.accumulate", accumulate_table(), [](Case& c) -> k::Accumulate& { return c.combine.accumulate; }));
  v.push_back(enum_field<GradAccumulate>("grad_accumulate", grad_accumulate_table(), [](Case& c) -> GradAccumulate& { return c.grad_accumulate; }));
  v.push_back(enum_field<CombineOrder>("combine.order", combine_order_table(), [](Case& c) -> CombineOrder& { return c.combine.order; }));
  v.push_back(enum_field<CombinePlacement>("combine.placement", placement_table(), [](Case& c) -> CombinePlacement& { return c.combine.placement; }));
  v.push_back(enum_field<OutBuffer>("combine.buffer", out_buffer_table(), [](Case& c) -> OutBuffer& { return c.combine.buffer; }));
  v.push_back(int_field("combine.alias_offset", 1, int64_t(1) << 40, [](Case& c, int64_t x) { c.combine.alias_offset = x; }));
}

/// Expert parallelism: ranks, per-rank tokens, alignment padding, permute (docs/contract.md §3-§5).
void add_ep_keys(std::vector<Field>& v) {
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
}

/// Sequence parallelism, backward, layer entries and capacity (docs/contract.md §10-§13).
void add_sp_backward_capacity_keys(std::vector<Field>& v) {
  // sequence parallel (docs/contract.md §10)
  v.push_back(int_field("sp", 1, 256, [](Case& c, int64_t x) { c.sp = int(x); }));
  v.push_back(int_field("shape.batch", 1, 1 << 24, [](Case& c, int64_t x) { c.batch = x; }));
  v.push_back(int_field("shape.seq_len", 0, 1 << 24, [](Case& c, int64_t x) { c.seq_len = x; }));
  v.push_back(enum_field<SpPadding>("sp_padding", sp_padding_table(), [](Case& c) -> SpPadding& { return c.sp_padding; }));
  // backward of the token path (docs/contract.md §13, src/paths/stages_backward.cpp)
  v.push_back(enum_field<Switch>("backward", switch_table(), [](Case& c) -> Switch& { return c.backward; }));
  // MoE layer entries and the overload factor (docs/contract.md §12)
  v.push_back(int_field("layers", 1, 64, [](Case& c, int64_t x) { c.layers = int(x); }));
  // capacity and token dropping (docs/contract.md §11)
  v.push_back({"capacity.factor", "number in [0, 1000] (cap = ceil(T*K/E * factor); 0: dropless, the default)",
               [](Case& c, const Src& s, const std::string& k) { c.capacity.factor = as_real(s, k, 0, 1000); }});
  v.push_back(enum_field<CapacityPolicy>("capacity.policy", capacity_policy_table(),
                                         [](Case& c) -> CapacityPolicy& { return c.capacity.policy; }));
  v.push_back(enum_field<Switch>("capacity.pad_to_capacity", switch_table(),
                                 [](Case& c) -> Switch& { return c.capacity.pad_to_capacity; }));
}

/// FP8 dispatch with block scales (docs/contract.md §16).
void add_dispatch_keys(std::vector<Field>& v) {
  v.push_back(enum_field<DispatchDtype>("dispatch.dtype", dispatch_dtype_table(),
                                        [](Case& c) -> DispatchDtype& { return c.dispatch.dtype; }));
  v.push_back(enum_field<k::Fp8Scale>("dispatch.scale", fp8_scale_table(), [](Case& c) -> k::Fp8Scale& { return c.dispatch.scale; }));
  v.push_back(int_field("dispatch.block", 1, 1 << 16, [](Case& c, int64_t x) { c.dispatch.block = x; }));
  v.push_back(enum_field<k::Fp8Quotient>("dispatch.quotient", fp8_quotient_table(),
                                         [](Case& c) -> k::Fp8Quotient& { return c.dispatch.quotient; }));
  // At least 1e-12, so that s = amax / 448 is a normal fp32 number and 1 / s finite.
  v.push_back({"dispatch.amax_clamp", "number in [1e-12, 1]",
               [](Case& c, const Src& s, const std::string& k) { c.dispatch.amax_clamp = as_real(s, k, 1e-12, 1); }});
}

/// Tolerance overrides per comparison class (tolerance.CLASS.rtol / .atol).
void add_tolerance_keys(std::vector<Field>& v) {
  for (const auto& [cname, cls] : compare_class_table()) {
    if (cls == CompareClass::exact || cls == CompareClass::rounding) continue;
    const std::string base = std::string("tolerance.") + cname;
    for (const char* part : {"rtol", "atol"}) {
      const bool is_rtol = std::string(part) == "rtol";
      const CompareClass cl = cls;
      v.push_back({base + "." + part, "number in [0, 1]", [cl, is_rtol](Case& c, const Src& s, const std::string& k) {
                     const double x = as_real(s, k, 0, 1);
                     Case::ToleranceOverride& t = c.tolerance_override[cl];
                     (is_rtol ? t.rtol : t.atol) = x;
                   }});
    }
  }
}

}  // namespace

const std::vector<Field>& schema() {
  static const std::vector<Field> table = [] {
    std::vector<Field> v;
    add_case_keys(v);
    add_router_keys(v);
    add_experts_combine_keys(v);
    add_ep_keys(v);
    add_sp_backward_capacity_keys(v);
    add_dispatch_keys(v);
    add_tolerance_keys(v);
    return v;
  }();
  return table;
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

std::set<std::string> key_set_under(const std::string& prefix, const std::set<std::string>& extra) {
  std::set<std::string> keys = extra;
  for (const auto& f : schema()) {
    if (!prefix.empty() && f.path.rfind(prefix + ".", 0) != 0) continue;
    const std::string rest = prefix.empty() ? f.path : f.path.substr(prefix.size() + 1);
    keys.insert(rest.substr(0, rest.find('.')));
  }
  return keys;
}

const std::set<std::string>& leaf_paths() {
  static const std::set<std::string> paths = [] {
    std::set<std::string> p;
    for (const auto& f : schema()) p.insert(f.path);
    return p;
  }();
  return paths;
}

std::string join_keys(const std::set<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
  return s;
}

std::string keys_under(const std::string& prefix) { return join_keys(key_set_under(prefix)); }


}  // namespace case_detail

std::vector<std::pair<std::string, std::string>> case_keys() {
  std::vector<std::pair<std::string, std::string>> r;
  for (const auto& f : case_detail::schema()) r.push_back({f.path, f.help});
  return r;
}

}  // namespace moev
