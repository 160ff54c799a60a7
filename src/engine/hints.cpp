#include "hints.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

namespace moev {

namespace {

/// Rows of `t` grouped by `counts`, each group's rows as byte strings,
/// sorted: the multiset of rows per expert.
std::vector<std::vector<std::string>> rows_per_segment(const Tensor& t, const std::vector<int64_t>& counts) {
  std::vector<std::vector<std::string>> seg;
  const int64_t rows = t.shape.empty() ? 0 : t.shape[0];
  const size_t width = rows ? size_t(t.bytes() / uint64_t(rows)) : 0;
  int64_t at = 0;
  for (int64_t n : counts) {
    if (n < 0 || at + n > rows) return {};
    std::vector<std::string> g;
    for (int64_t i = at; i < at + n; ++i)
      g.emplace_back(static_cast<const char*>(t.data()) + size_t(i) * width, width);
    std::sort(g.begin(), g.end());
    seg.push_back(std::move(g));
    at += n;
  }
  if (at != rows) return {};
  return seg;
}

}  // namespace

const char* rounding_keys(const std::string& slot) {
  static const std::map<std::string, const char*> keys = {
      {"router_logits", "router.gate_dtype"},
      {"experts", "experts.rounding, experts.compute_dtype"},
      {"shared_experts", "experts.rounding"},
      {"combine", "combine.accumulate, score_multiply"},
      {"combine_bwd", "score_multiply"},
      {"experts_bwd", "experts.rounding, experts.compute_dtype"},
      {"shared_experts_bwd", "experts.rounding"},
      {"dispatch_bwd", "grad_accumulate, combine.accumulate"},
      {"router_bwd", "router.gate_dtype, router.score_dtype"},
      {"fp8_quant", "dispatch.quotient, dispatch.scale"}};
  auto k = keys.find(slot);
  return k == keys.end() ? nullptr : k->second;
}

void add_hints(Check& ch, const std::string& slot, const Tensor& yours, const Tensor& want, const RankBoard& in) {
  if (ch.outcome != Outcome::INCORRECT || !ch.diff.structural.empty() || yours.shape != want.shape) return;
  std::vector<std::string> hints;
  const bool floating = yours.type == ElemType::f32 || yours.type == ElemType::bf16 || yours.type == ElemType::f16;
  if (floating && yours.numel() > 0) {
    const std::vector<float> y = to_floats(yours), w = to_floats(want);
    const bool all_zero = std::all_of(y.begin(), y.end(), [](float v) { return v == 0.f; });
    if (all_zero && std::any_of(w.begin(), w.end(), [](float v) { return v != 0.f; }))
      hints.push_back("all zeros where values were expected: output not written?");
    else if (slot == "combine" && ch.diff.max_ulp <= 8 && ch.diff.mismatches > 0)
      // A sum of K rounded terms: another order of the additions moves it by
      // a few units as surely as another rounding convention does.
      hints.push_back("every mismatch is within " + std::to_string(int64_t(ch.diff.max_ulp)) +
                      " ulp: a convention? see " + rounding_keys(slot) + " (docs/contract.md §14); or the order of "
                      "the additions: a token's rows are added in dispatch row order, ascending expert id "
                      "(docs/contract.md §2; code that adds in no fixed order, GPU atomics, declares "
                      "combine.order: any)");
    else if (ch.diff.max_ulp <= 1 && ch.diff.mismatches > 0 && rounding_keys(slot))
      hints.push_back(std::string("every mismatch is one rounding apart: a convention? see ") + rounding_keys(slot) +
                      " (docs/contract.md §14)");
  }
  if (slot == "dispatch" && in.count("counts") && !yours.shape.empty()) {
    const std::vector<int64_t> counts = to_ints(in.at("counts"));
    const auto a = rows_per_segment(yours, counts), b = rows_per_segment(want, counts);
    if (!a.empty() && a == b)
      hints.push_back("same rows per expert, another order: is the sort stable? (docs/contract.md §2)");
  }
  for (const std::string& h : hints) ch.note += (ch.note.empty() ? "hint: " : "; hint: ") + h;
}

}  // namespace moev
