// A case (case.h): the enum string tables shared by YAML and the CLI, the
// tolerance a case gives each comparison class, its per-rank token counts
// and one-line summary. The schema table is case_schema.cpp, YAML loading
// case_yaml.cpp, the rules between keys case_validate.cpp
// (docs/architecture.md "Configuration").
#include "case.h"

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "datagen.h"

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
const EnumTable<CombineOrder>& combine_order_table() {
  static const EnumTable<CombineOrder> t = {{"ascending", CombineOrder::ascending}, {"any", CombineOrder::any}};
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

const EnumTable<GradAccumulate>& grad_accumulate_table() {
  static const EnumTable<GradAccumulate> t = {{"as_combine", GradAccumulate::as_combine},
                                              {"per_add", GradAccumulate::per_add},
                                              {"fp32_accumulate", GradAccumulate::fp32_accumulate}};
  return t;
}

k::Accumulate Case::dispatch_grad_accumulate() const {
  switch (grad_accumulate) {
    case GradAccumulate::per_add: return k::Accumulate::per_add;
    case GradAccumulate::fp32_accumulate: return k::Accumulate::fp32_accumulate;
    case GradAccumulate::as_combine: break;
  }
  return combine.accumulate;
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

const EnumTable<WeightStorage>& weight_storage_table() {
  static const EnumTable<WeightStorage> t = {
      {"auto", WeightStorage::auto_}, {"held", WeightStorage::held}, {"streamed", WeightStorage::streamed}};
  return t;
}

double Case::routed_weight_bytes() const {
  return experts.kind == ExpertKind::swiglu
             ? 3.0 * double(num_experts) * double(hidden) * double(ffn) * double(elem_bytes(act_elem(dtype)))
             : 0.0;
}

bool Case::streams_weights() const {
  if (experts.kind != ExpertKind::swiglu) return false;
  if (experts.weights != WeightStorage::auto_) return experts.weights == WeightStorage::streamed;
  return routed_weight_bytes() > kStreamWeightBytes;
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

const EnumTable<DispatchDtype>& dispatch_dtype_table() {
  static const EnumTable<DispatchDtype> t = {{"act", DispatchDtype::act}, {"fp8_e4m3", DispatchDtype::fp8_e4m3}};
  return t;
}
const EnumTable<k::Fp8Scale>& fp8_scale_table() {
  static const EnumTable<k::Fp8Scale> t = {{"fp32", k::Fp8Scale::fp32}, {"ue8m0", k::Fp8Scale::ue8m0}};
  return t;
}
const EnumTable<k::Fp8Quotient>& fp8_quotient_table() {
  static const EnumTable<k::Fp8Quotient> t = {{"reciprocal", k::Fp8Quotient::reciprocal},
                                              {"amax_ratio", k::Fp8Quotient::amax_ratio},
                                              {"divide", k::Fp8Quotient::divide}};
  return t;
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
  // F and the experts' implementation only where a SwiGLU uses them.
  const bool swiglu_experts = experts.kind == ExpertKind::swiglu;
  o << " D=" << hidden;
  if (swiglu_experts || shared.kind == SharedKind::swiglu) o << " F=" << ffn;
  o << " E=" << num_experts << " K=" << top_k << " "
    << dtype_name(dtype) << " data=" << enum_name(data_mode_table(), data) << " backend=" << enum_name(backend_table(), backend) << " seed=" << seed
    << " router=" << enum_name(score_table(), router.score)
    << (router.force_load_balance == Switch::on ? "+force_lb" : "")
    << (router.bias == Switch::on ? "+bias" : "")
    << (router.groups > 1 ? "+groups" + std::to_string(router.groups) + "/" + std::to_string(router.limited_groups) : "")
    << " experts=" << enum_name(expert_kind_table(), experts.kind)
    << (swiglu_experts ? "/" + std::string(enum_name(experts_impl_table(), experts.impl)) : "")
    << " shared=" << enum_name(shared_kind_table(), shared.kind)
    << " combine=" << enum_name(accumulate_table(), combine.accumulate) << "/"
    << enum_name(placement_table(), combine.placement) << "/" << enum_name(out_buffer_table(), combine.buffer)
    << (combine.order == CombineOrder::any ? "/any_order" : "");
  if (ep > 1 || align > 1) {
    if (equal_split.policy != EqualSplitPolicy::off) {  // the threshold only where it chooses
      o << " equal_split=" << enum_name(equal_split_table(), equal_split.policy);
      if (equal_split.policy == EqualSplitPolicy::adaptive) o << "@" << equal_split.threshold;
    }
    o << " ep=" << ep << " align=" << align << "/" << enum_name(empty_groups_table(), empty_groups)
      << " permute=" << enum_name(permute_table(), permute);
  }
  // Framework conventions (docs/contract.md §14): named only when not the default.
  if (router.gate_dtype != GateDtype::fp32) o << " gate_dtype=" << enum_name(gate_dtype_table(), router.gate_dtype);
  if (router.score_dtype != GateDtype::fp32) o << " score_dtype=" << enum_name(gate_dtype_table(), router.score_dtype);
  if (score_multiply != k::ScoreMultiply::fp32)
    o << " score_multiply=" << enum_name(score_multiply_table(), score_multiply);
  if (score_on_hidden == Switch::on) o << " score_on_hidden=on";
  // A convention is named where it is not the default and has an effect.
  const auto named = [&](const char* key) { return key_without_effect(key, *this).empty(); };
  if (experts.w13_fused == Switch::on && named("experts.w13_fused")) o << " experts.w13_fused=on";
  if (experts.rounding != k::SiluRounding::fused && named("experts.rounding"))
    o << " experts.rounding=" << enum_name(experts_rounding_table(), experts.rounding);
  if (experts.compute_dtype != ComputeDtype::act && named("experts.compute_dtype"))
    o << " experts.compute_dtype=" << enum_name(compute_dtype_table(), experts.compute_dtype);
  if (streams_weights()) o << " experts.weights=streamed";
  if (backward == Switch::on) o << " backward=on";
  if (grad_accumulate != GradAccumulate::as_combine && named("grad_accumulate"))
    o << " grad_accumulate=" << enum_name(grad_accumulate_table(), grad_accumulate);
  if (layers > 1) o << " layers=" << layers;
  if (router.hot_expert >= 0) o << " hot_expert=" << router.hot_expert;
  if (sp > 1) o << " sp=" << sp << "/" << enum_name(sp_padding_table(), sp_padding);
  if (batch > 1) o << " batch=" << batch;
  if (capacity.factor > 0)
    o << " capacity=" << capacity.factor << "/" << enum_name(capacity_policy_table(), capacity.policy)
      << (capacity.pad_to_capacity == Switch::on ? "/pad" : "");
  if (fp8())
    o << " dispatch=fp8_e4m3/" << enum_name(fp8_scale_table(), dispatch.scale) << "/block" << dispatch.block << "/"
      << enum_name(fp8_quotient_table(), dispatch.quotient) << "/clamp" << dispatch.amax_clamp;
  return o.str();
}

namespace {

/// The length of the well-formed UTF-8 sequence of a printable character
/// (U+00A0 and above, no surrogate, no overlong form) starting at s[i]; 0
/// when there is none.
size_t utf8_char(const std::string& s, size_t i) {
  const unsigned char u = static_cast<unsigned char>(s[i]);
  const size_t n = u >= 0xf0 && u <= 0xf4 ? 4 : u >= 0xe0 ? 3 : u >= 0xc2 && u < 0xe0 ? 2 : 0;
  if (n == 0 || i + n > s.size() || u >= 0xf8) return 0;
  uint32_t cp = u & (n == 2 ? 0x1f : n == 3 ? 0x0f : 0x07);
  for (size_t k = 1; k < n; ++k) {
    const unsigned char c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (c & 0x3f);
  }
  const bool overlong = (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000);
  if (overlong || cp < 0xa0 || (cp >= 0xd800 && cp < 0xe000) || cp > 0x10ffff) return 0;
  return n;
}

}  // namespace

std::string printable(const std::string& s, size_t max_chars) {
  static const char* hex = "0123456789abcdef";
  std::string o;
  size_t shown = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (shown == max_chars) return o + "...";
    const unsigned char u = static_cast<unsigned char>(s[i]);
    // A printable character written in UTF-8 (§, é, ×) is kept as written.
    if (const size_t n = u >= 0x80 ? utf8_char(s, i) : 0) {
      o.append(s, i, n);
      i += n - 1;
    } else if (u < 0x20 || u >= 0x7f) {
      o += "\\x";
      o += hex[u >> 4];
      o += hex[u & 15];
    } else {
      o += char(u);
    }
    ++shown;
  }
  return o;
}

namespace {
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string nearest_name(const std::string& name, const std::set<std::string>& valid) {
  std::string best;
  size_t d = SIZE_MAX;
  for (const auto& v : valid)
    if (const size_t e = edit_distance(name, v); e < d) d = e, best = v;
  return best;
}

std::string did_you_mean(const std::string& name, const std::set<std::string>& valid) {
  const std::string near = nearest_name(name, valid);
  if (near.empty()) return "";
  const size_t d = edit_distance(name, near);
  const bool typo = d <= (name.size() < 5 ? 1u : 2u) && 2 * d < name.size();
  return typo ? " (did you mean " + near + "?)" : "";
}

}  // namespace moev
