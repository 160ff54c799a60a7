#include "config_hash.h"

#include <optional>

#include <cstring>
#include <string>

namespace moev {
namespace {

struct Fnv {
  uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= b[i];
      h *= 0x100000001b3ull;
    }
  }
  void u64(uint64_t v) { bytes(&v, sizeof(v)); }
  void i64(int64_t v) { u64(uint64_t(v)); }
  void f64(double v) {
    uint64_t b;
    std::memcpy(&b, &v, sizeof(b));
    u64(b);
  }
  template <class E>
  void e(E v) { u64(uint64_t(v)); }
  void str(const std::string& s) {
    u64(s.size());  // length first: ("ab","c") and ("a","bc") differ
    bytes(s.data(), s.size());
  }
};

}  // namespace

// A field added to Case must be added below too: this guard fails the build
// on the one platform CI builds (x86-64, libstdc++) when Case grows.
#if defined(__x86_64__) && defined(__GLIBCXX__) && !defined(_GLIBCXX_DEBUG)
static_assert(sizeof(Case) == 448, "Case changed: hash the new field in config_hash(), then update this size");
#endif

uint64_t config_hash(const Case& c) {
  Fnv f;
  f.str("moeverify case v1");
  f.str(c.name);
  f.i64(c.tokens);
  f.i64(c.hidden);
  f.i64(c.ffn);
  f.i64(c.num_experts);
  f.i64(c.top_k);
  f.e(c.dtype);
  f.u64(c.seed);
  f.e(c.data);
  f.e(c.router.score);
  f.e(c.router.bias);
  f.i64(c.router.groups);
  f.i64(c.router.limited_groups);
  f.e(c.router.force_load_balance);
  f.e(c.router.route_norm);
  f.f64(double(c.router.route_scale));
  f.i64(c.router.hot_expert);
  f.e(c.experts.kind);
  f.e(c.experts.impl);
  f.e(c.shared.kind);
  f.e(c.shared.order);
  f.e(c.score_before_experts);
  // the framework conventions (docs/contract.md §14)
  f.e(c.router.gate_dtype);
  f.e(c.router.score_dtype);
  f.e(c.score_multiply);
  f.e(c.score_on_hidden);
  f.e(c.experts.rounding);
  f.e(c.experts.compute_dtype);
  f.e(c.experts.w13_fused);
  f.e(c.experts.weights);
  f.e(c.combine.accumulate);
  f.e(c.combine.placement);
  f.e(c.combine.order);
  f.e(c.combine.buffer);
  f.i64(c.combine.alias_offset);
  f.u64(c.tolerance_override.size());
  for (const auto& [cls, tol] : c.tolerance_override) {
    f.e(cls);
    for (const std::optional<double>& part : {tol.rtol, tol.atol}) {
      f.u64(part.has_value());
      f.f64(part.value_or(0.0));
    }
  }
  f.i64(c.ep);
  f.u64(c.tokens_per_rank.size());
  for (int64_t t : c.tokens_per_rank) f.i64(t);
  f.i64(c.tokens_uniform_lo);
  f.i64(c.tokens_uniform_hi);
  f.i64(c.align);
  f.e(c.empty_groups);
  f.e(c.permute);
  f.e(c.equal_split.policy);
  f.f64(c.equal_split.threshold);
  // sequence parallel (docs/contract.md §10)
  f.i64(c.sp);
  f.i64(c.batch);
  f.i64(c.seq_len);
  f.e(c.sp_padding);
  f.e(c.backward);  // docs/contract.md §13
  if (c.grad_accumulate != GradAccumulate::as_combine) f.e(c.grad_accumulate);  // §14; the default hashes as before
  f.e(c.backend);
  f.i64(c.layers);   // docs/contract.md §12
  f.i64(c.layer);
  f.f64(c.capacity.factor);  // docs/contract.md §11
  f.e(c.capacity.policy);
  f.e(c.capacity.pad_to_capacity);
  if (c.fp8()) {  // docs/contract.md §16; an act case hashes as before the keys existed
    f.e(c.dispatch.dtype);
    f.e(c.dispatch.scale);
    f.i64(c.dispatch.block);
    f.e(c.dispatch.quotient);
    f.f64(c.dispatch.amax_clamp);
  }
  f.str(c.summary());  // whatever summary() shows is covered even if a field is missed above
  return f.h;
}

uint64_t config_hash(const Case& c, const FaultSet& faults) {
  Fnv f;
  f.u64(config_hash(c));
  f.u64(faults.bits);
  return f.h;
}

}  // namespace moev
