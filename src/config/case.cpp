// Case files: schema, strict validation with file:line:column, sweeps.
//
// File layout:
//   defaults: { <case keys> }        # optional, applied under every case
//   cases:
//     - name: my_case                # required, unique after sweep expansion
//       <case keys>                  # nested maps or dotted keys: shape.top_k
//       sweep: { dtype: [fp32, bf16], shape.top_k: [1, 2] }   # optional
#include "case.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
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
const EnumTable<Backend>& backend_table() {
  static const EnumTable<Backend> t = {{"host", Backend::host}, {"cuda", Backend::cuda}, {"emulated", Backend::emulated}};
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

const EnumTable<GateDtype>& gate_dtype_table() {
  static const EnumTable<GateDtype> t = {{"fp32", GateDtype::fp32}, {"act", GateDtype::act}};
  return t;
}

const EnumTable<k::ScoreMultiply>& score_multiply_table() {
  static const EnumTable<k::ScoreMultiply> t = {{"fp32", k::ScoreMultiply::fp32}, {"act", k::ScoreMultiply::act}};
  return t;
}

const EnumTable<k::SiluRounding>& experts_rounding_table() {
  static const EnumTable<k::SiluRounding> t = {{"fused", k::SiluRounding::fused},
                                               {"torchtitan", k::SiluRounding::rounded_to_act}};
  return t;
}

const EnumTable<ComputeDtype>& compute_dtype_table() {
  static const EnumTable<ComputeDtype> t = {{"act", ComputeDtype::act}, {"bf16", ComputeDtype::bf16}};
  return t;
}

const EnumTable<SpPadding>& sp_padding_table() {
  static const EnumTable<SpPadding> t = {{"virtual", SpPadding::virtual_}, {"tail", SpPadding::tail}};
  return t;
}

const EnumTable<CapacityPolicy>& capacity_policy_table() {
  static const EnumTable<CapacityPolicy> t = {{"probs", CapacityPolicy::probs}, {"position", CapacityPolicy::position}};
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

Tolerance tolerance_for(const Case& c, CompareClass cls) {
  if (cls == CompareClass::rounding) return default_tolerance(cls, c.dtype);
  auto it = c.tolerance_override.find(cls);
  // GEMMs run in bf16 under experts.compute_dtype bf16 (docs/contract.md §14): their
  // outputs, and the combined output built from them, carry bf16 errors.
  const bool bf16_gemm = c.experts.compute_dtype == ComputeDtype::bf16 &&
                         (cls == CompareClass::gemm || cls == CompareClass::end_to_end);
  Tolerance t = default_tolerance(cls, bf16_gemm ? DType::bf16 : c.dtype);
  if (it != c.tolerance_override.end()) {
    if (it->second.rtol) t.rtol = *it->second.rtol;
    if (it->second.atol) t.atol = *it->second.atol;
  }
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
    << dtype_name(dtype) << " data=" << enum_name(data_mode_table(), data) << " backend=" << enum_name(backend_table(), backend) << " seed=" << seed
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
  // Framework conventions (docs/contract.md §14): named only when not the default.
  if (router.gate_dtype != GateDtype::fp32) o << " gate_dtype=" << enum_name(gate_dtype_table(), router.gate_dtype);
  if (score_multiply != k::ScoreMultiply::fp32)
    o << " score_multiply=" << enum_name(score_multiply_table(), score_multiply);
  if (experts.rounding != k::SiluRounding::fused)
    o << " experts.rounding=" << enum_name(experts_rounding_table(), experts.rounding);
  if (experts.compute_dtype != ComputeDtype::act)
    o << " experts.compute_dtype=" << enum_name(compute_dtype_table(), experts.compute_dtype);
  if (backward == Switch::on) o << " backward=on";
  if (layers > 1) o << " layers=" << layers;
  if (capacity.factor > 0)
    o << " capacity=" << capacity.factor << "/" << enum_name(capacity_policy_table(), capacity.policy)
      << (capacity.pad_to_capacity == Switch::on ? "/pad" : "");
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

std::string at_line_col(const std::string& file, const YAML::Mark& m) {
  if (m.line < 0) return printable(file, 200);
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
  if (!std::isfinite(v) || v < lo || v > hi) fail_at(s, key, "value " + printable(s.node.Scalar()) + " is out of range", vs.str());
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
  fail_at(s, key, "unknown value '" + printable(v) + "'", valid);
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
                   const std::string& n = s.node.Scalar();
                   if (n.size() > kMaxCaseNameChars)
                     fail_at(s, k, "the name has " + std::to_string(n.size()) + " characters",
                             "valid: at most " + std::to_string(kMaxCaseNameChars));
                   for (const char ch : n)
                     if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f)
                       fail_at(s, k, "the name '" + printable(n) + "' contains a control character",
                               "valid: printable characters (a report shows the name on one line)");
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
    v.push_back(enum_field<k::ScoreMultiply>("score_multiply", score_multiply_table(), [](Case& c) -> k::ScoreMultiply& { return c.score_multiply; }));
    v.push_back(enum_field<k::SiluRounding>("experts.rounding", experts_rounding_table(), [](Case& c) -> k::SiluRounding& { return c.experts.rounding; }));
    v.push_back(enum_field<ComputeDtype>("experts.compute_dtype", compute_dtype_table(), [](Case& c) -> ComputeDtype& { return c.experts.compute_dtype; }));
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
  check_keys(map, file, prefix, "valid keys here: " + keys_under(prefix));
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
  // sequence parallel (docs/contract.md §10, docs/frameworks.md §10.3)
  const int64_t B = c.batch;
  if (B > 1 && (!c.tokens_per_rank.empty() || c.tokens_uniform_lo >= 0))
    fail("shape.batch", "batch " + std::to_string(B) + " with per-rank token counts",
         "valid: batch 1 with shape.tokens_per_rank, or shape.batch with shape.seq_len (every EP rank holds batch*seq_len tokens)");
  if (B > 1 && c.tokens % B != 0)
    fail("shape.batch", "tokens " + std::to_string(c.tokens) + " are not batch " + std::to_string(B) + " sequences",
         "valid: tokens a multiple of batch, or shape.seq_len instead of shape.tokens");
  const int64_t seq = c.tokens / B;
  if (c.sp > 1 && B > 1 && c.sp_padding == SpPadding::virtual_ && seq % c.sp != 0)
    fail(flat.count("shape.seq_len") ? "shape.seq_len" : flat.count("shape.batch") ? "shape.batch" : "sp",
         "virtual SP padding with batch " + std::to_string(B) + " needs seq_len % sp == 0, but seq_len " +
             std::to_string(seq) + " % sp " + std::to_string(c.sp) + " = " + std::to_string(seq % c.sp) +
             " (the per-sequence shard index would keep the wrong rows, torchtitan #3604)",
         "valid: seq_len a multiple of " + std::to_string(c.sp) + ", batch 1, or sp_padding: tail");
  if (c.sp > 1 && c.router.force_load_balance == Switch::on)
    fail("sp", "force-load-balance routing depends on a token's row on its rank (docs/contract.md §1 step 6), which sequence "
               "parallelism changes, so the SP run cannot equal the sp = 1 run",
         "valid: sp 1, or router.force_load_balance off");
  if (c.sp > 1 && c.combine.buffer != OutBuffer::fresh)
    fail("combine.buffer", "an output buffer aliasing x with sp > 1: each SP rank's x is its own shard",
         "valid: buffer: fresh with sp > 1");
  // backward (docs/contract.md §13): what src/paths/stages_backward.cpp does not model is refused here.
  if (c.backward == Switch::on && c.sp > 1)
    fail("backward", "the backward of the sequence-parallel shard and gather is not implemented",
         "valid: backward: off with sp > 1, or sp: 1");
  // capacity (docs/contract.md §11): what src/paths/stages_capacity.cpp does not model.
  if (c.capacity.factor > 0 && c.sp > 1)
    fail("capacity.factor", "capacity dropping on the sequence-parallel layout is not implemented", "valid: sp: 1 with capacity");
  if (c.capacity.factor > 0 && c.backward == Switch::on)
    fail("capacity.factor", "the backward of capacity dropping is not implemented", "valid: backward: off with capacity");
  if (c.capacity.factor > 0 && c.router.force_load_balance == Switch::on)
    fail("capacity.factor", "the force-load-balance fast path derives its splits from T, K and E, not from the kept counts",
         "valid: router.force_load_balance: off with capacity");
  if (c.backward == Switch::on && c.combine.buffer != OutBuffer::fresh)
    fail("backward", "an output buffer aliasing x adds x itself to the output, a gradient path the backward does not model",
         "valid: combine.buffer: fresh with backward: on");
}

Case build_case(const Flat& flat, const std::string& source) {
  Case c;
  c.source = source;
  for (const auto& f : schema()) {
    auto it = flat.find(f.path);
    if (it != flat.end()) f.set(c, it->second, f.path);
  }
  // shape.seq_len gives the tokens: T = batch * seq_len (docs/contract.md §10).
  if (flat.count("shape.seq_len")) {
    if (flat.count("shape.tokens") && c.tokens != c.batch * c.seq_len)
      bad_input(where(flat.at("shape.tokens")) + ": shape.tokens: " + std::to_string(c.tokens) +
                " disagrees with batch * seq_len = " + std::to_string(c.batch * c.seq_len) +
                "; valid: either shape.tokens or shape.seq_len (with shape.batch)");
    // Each is held to its range alone; their product is the token count,
    // held to shape.tokens' range (batch and seq_len up to 2^24 each would
    // give 2^48 tokens).
    if (c.batch * c.seq_len > int64_t(1) << 24)
      bad_input(where(flat.at("shape.seq_len")) + ": shape.seq_len: batch " + std::to_string(c.batch) +
                " x seq_len " + std::to_string(c.seq_len) + " = " + std::to_string(c.batch * c.seq_len) +
                " tokens, past the token range; valid: batch * seq_len from 0 to 16777216 (2^24), as shape.tokens");
    c.tokens = c.batch * c.seq_len;
  }
  validate(c, flat);
  c.seq_len = c.tokens / c.batch;  // one value for a case however it was written
  return c;
}

// ---- reading and parsing, before any case key is looked at -----------------

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
  std::vector<char> buf(size_t(1) << 16);
  while (in) {  // read at most one byte past the cap: a huge file (or /dev/zero) is not read whole
    in.read(buf.data(), std::streamsize(buf.size()));
    text.append(buf.data(), size_t(in.gcount()));
    if (text.size() > kMaxCaseFileBytes)
      bad_input(shown + ": the case file is larger than " + std::to_string(kMaxCaseFileBytes >> 20) +
                " MiB; valid: a case file of at most " + std::to_string(kMaxCaseFileBytes >> 20) +
                " MiB (use sweeps for many cases)");
  }
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

std::string render(const YAML::Node& n) {
  constexpr size_t kBudget = 200;
  std::string s;
  render(n, s, kBudget);
  if (s.size() > kBudget) s = s.substr(0, kBudget) + "...";
  return s;
}

}  // namespace

std::string printable(const std::string& s, size_t max_chars) {
  static const char* hex = "0123456789abcdef";
  std::string o;
  size_t shown = 0;
  for (const char ch : s) {
    if (shown == max_chars) return o + "...";
    const unsigned char u = static_cast<unsigned char>(ch);
    if (u < 0x20 || u >= 0x7f) {
      o += "\\x";
      o += hex[u >> 4];
      o += hex[u & 15];
    } else {
      o += ch;
    }
    ++shown;
  }
  return o;
}

std::vector<std::pair<std::string, std::string>> case_keys() {
  std::vector<std::pair<std::string, std::string>> r;
  for (const auto& f : schema()) r.push_back({f.path, f.help});
  return r;
}

std::vector<Case> load_cases(const std::string& path, const std::vector<std::string>& overrides) {
  return load_cases_text(read_case_file(path), path, overrides);
}

std::vector<Case> load_cases_text(const std::string& text, const std::string& path,
                                  const std::vector<std::string>& overrides) {
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
  if (!root["cases"] || !root["cases"].IsSequence() || root["cases"].size() == 0)
    fail_at(rootsrc, "cases", "missing or empty", "valid: a non-empty list of case mappings");

  Flat defaults;
  if (root["defaults"]) flatten(root["defaults"], "", path, defaults, {});

  Flat cli;
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0)
      bad_input("--set " + printable(o) + ": expected key=value; valid keys: see `moeverify validate --keys`");
    const std::string key = o.substr(0, eq);
    if (!is_leaf(key))
      bad_input("--set " + printable(o) + ": unknown key '" + printable(key) +
                "'; valid keys: see `moeverify validate --keys`");
    if (cli.count(key))
      bad_input("--set " + printable(key) + ": given twice; valid: each key once (the last would silently win)");
    const std::string value = o.substr(eq + 1);
    const std::string file = "--set " + key;
    const YAML::Node v = parse_one(value, file, "valid: a YAML value such as 128, bf16 or [1, 2]");
    std::set<int> seen;
    check_quotes(v, value, file, seen);
    cli[key] = Src{v, file};
  }

  std::vector<Case> out;
  std::set<std::string> names;
  for (const auto& entry : root["cases"]) {
    const Src esrc{entry, path};
    const std::string source = printable(path, 200) + ":" + std::to_string(entry.Mark().line + 1);
    Flat flat = defaults;
    Flat own;
    flatten(entry, "", path, own, {"sweep"});
    for (auto& [k, v] : own) flat[k] = v;
    if (!own.count("name")) fail_at(esrc, "name", "every case needs a name", "valid: name: <word>");

    // sweep: path -> list of values; the cartesian product in key order
    std::vector<std::pair<std::string, std::vector<Src>>> axes;
    size_t count = 1;
    if (entry["sweep"]) {
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
        // The product is counted (saturating) before anything is expanded.
        count = std::min(count * std::min(kv.second.size(), kMaxCasesPerFile + 1), kMaxCasesPerFile + 1);
        if (out.size() + count > kMaxCasesPerFile)
          fail_at({sweep_key, path}, "sweep",
                  "expands the file to more than " + std::to_string(kMaxCasesPerFile) + " cases",
                  "valid: at most " + std::to_string(kMaxCasesPerFile) + " cases per file after expansion");
        std::vector<Src> vals;
        for (const auto& v : kv.second) vals.push_back({v, path});
        axes.push_back({key, vals});
      }
    }
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
      for (auto& [k, v] : cli) f[k] = v;
      Case c = build_case(f, source);
      c.name += suffix;
      if (!names.insert(c.name).second)
        fail_at(esrc, "name", "duplicate case name '" + printable(c.name) + "'", "valid: names unique within the file");
      out.push_back(std::move(c));
      size_t a = 0;
      while (a < axes.size() && ++idx[a] == axes[a].second.size()) idx[a++] = 0;
      if (a == axes.size()) break;
    }
  }
  return out;
}

}  // namespace moev
