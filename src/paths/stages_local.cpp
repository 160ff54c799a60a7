// Stage variants of the local (EP = 1) MoE path: router, local dispatch,
// experts, shared experts, combine. Each pairs a fast function (kernels/ on the
// host executor) with the reference function (reference/) of the same stage.
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "datagen.h"
#include "parallel_errors.h"
#include "../reference/reference.h"
#include "error.h"
#include "stages.h"

namespace moev {

void judged_in_any_order(OutputSpec& o) {
  o.cls_for = [](const Case& c) {
    return c.combine.order == CombineOrder::any ? CompareClass::rounding : CompareClass::exact;
  };
}

ref::Act ref_act(DType d) { return d == DType::fp32 ? ref::Act::fp32 : d == DType::bf16 ? ref::Act::bf16 : ref::Act::fp16; }

ref::WeightView weight_view(const Tensor& w, int64_t first) {
  const int64_t per = w.numel() / w.shape[0];
  const ref::Act t = w.type == ElemType::f32    ? ref::Act::fp32
                     : w.type == ElemType::bf16 ? ref::Act::bf16
                     : w.type == ElemType::f16  ? ref::Act::fp16
                                                : throw std::logic_error("weight_view: not a float tensor");
  return ref::WeightView(static_cast<const uint8_t*>(w.data()) + size_t(first * per) * elem_bytes(w.type), t);
}

ref::Ids ref_ids(const Tensor& t) {
  ref::Ids v;
  for (int64_t x : to_ints(t)) v.push_back(int32_t(x));
  return v;
}

ref::Counts ref_counts(const Tensor& t) { return to_ints(t); }

ref::RowsRef rows_of(const Tensor& t) {
  const int64_t rows = t.shape.empty() ? 0 : t.shape[0];
  size_t row_bytes = elem_bytes(t.type);  // from the shape: a tensor with no rows still has a row size
  for (size_t i = 1; i < t.shape.size(); ++i) row_bytes *= size_t(t.shape[i]);
  return {static_cast<const uint8_t*>(t.data()), rows, row_bytes};
}

Tensor rows_tensor(ref::Bytes&& b, ElemType t, int64_t cols) {
  Tensor o;
  o.type = t;
  const size_t row_bytes = size_t(cols) * elem_bytes(t);
  o.shape = {int64_t(b.size() / row_bytes), cols};
  o.storage = std::make_shared<std::vector<uint8_t>>(std::move(b));
  return o;
}

Tensor ids_tensor(const ref::Ids& v, ElemType t, std::vector<int64_t> shape) {
  return from_ints(std::vector<int64_t>(v.begin(), v.end()), t, std::move(shape));
}

RouterConfig router_config(const Case& c) {
  RouterConfig r;
  r.E = c.num_experts;
  r.K = c.top_k;
  r.groups = c.router.groups;
  r.limited_groups = c.router.limited_groups;
  r.route_scale = c.router.route_scale;
  r.score = c.router.score;
  r.selection = c.router.force_load_balance == Switch::on ? k::Selection::force_load_balance : k::Selection::topk;
  r.norm = c.router.route_norm == Switch::on ? k::RouteNorm::on : k::RouteNorm::off;
  r.held = score_held(c);
  r.biased = c.router.bias == Switch::on || c.router.hot_expert >= 0;  // a hot expert is a bias
  return r;
}

k::ScoreHeld score_held(const Case& c) {
  if (c.router.score_dtype != GateDtype::act) return k::ScoreHeld::fp32;
  return c.dtype == DType::bf16 ? k::ScoreHeld::bf16 : c.dtype == DType::fp16 ? k::ScoreHeld::fp16 : k::ScoreHeld::fp32;
}

ref::RouterSpec ref_router_spec(const Case& c) {
  ref::RouterSpec spec;
  spec.E = c.num_experts;
  spec.K = c.top_k;
  spec.groups = c.router.groups;
  spec.limited_groups = c.router.limited_groups;
  spec.score = c.router.score == k::ScoreFunc::softmax ? ref::Score::softmax : ref::Score::sigmoid;
  spec.selection = c.router.force_load_balance == Switch::on ? ref::Selection::force_load_balance : ref::Selection::topk;
  spec.route_norm = c.router.route_norm == Switch::on;
  spec.route_scale = c.router.route_scale;
  if (c.router.score_dtype == GateDtype::act) spec.held = ref_act(c.dtype);
  spec.bias = c.router.bias == Switch::on || c.router.hot_expert >= 0;  // a hot expert is a bias
  return spec;
}

bool combine_starts_at_zeros(const Case& c) {
  return c.combine.buffer == OutBuffer::fresh &&
         !(c.shared.kind != SharedKind::none && c.shared.order == SharedOrder::init_with_shared);
}

Tensor combine_init_tensor(const Case& c, const RankBoard& in) {
  const Tensor& x = in.at("x");
  switch (c.combine.buffer) {
    case OutBuffer::alias_x: return x;
    case OutBuffer::alias_x_offset:
      return x.view(x.type, x.shape, x.offset_bytes + size_t(c.combine.alias_offset) * elem_bytes(x.type));
    case OutBuffer::fresh: break;
  }
  if (combine_starts_at_zeros(c)) return Tensor{};
  const Tensor& shared = in.at("shared_out");
  if (shared.type != x.type || shared.bytes() != x.bytes())
    throw std::logic_error("combine: shared_out is not of x's type and size");
  return shared;
}

std::vector<float> combine_init(const Case& c, const RankBoard& in) {
  const Tensor t = combine_init_tensor(c, in);
  return t.storage ? to_floats(t) : std::vector<float>(size_t(in.at("x").numel()), 0.f);
}

ref::Vec routed_row_scores(const Case& c, const RankBoard& b) {
  ref::Vec s = to_floats(b.at("score_sorted"));
  if (c.score_multiply == k::ScoreMultiply::act)
    for (float& v : s) v = ref::round_act(ref_act(c.dtype), v);
  return s;
}

namespace {

Decision always(const Case&) { return {}; }

/// The conventions of a SwiGLU site (docs/contract.md §14): experts.rounding applies
/// to the routed and the shared experts (torchtitan's FeedForward rounds
/// silu(h1) too), the compute dtype to the routed experts only (docs/frameworks.md
/// §8.1: GroupedExperts casts X and W to bf16; the shared FeedForward runs in act).
/// `mid` is the site's intermediate prefix: "expert_" (routed) or "shared_".
SwigluConventions swiglu_conventions(const Case& c, const std::string& mid) {
  return {c.experts.rounding, mid == "expert_" ? c.experts.compute_dtype : ComputeDtype::act};
}
/// The dtype of a site's intermediates h13 and H.
ElemType mid_type(const Case& c, const SwigluConventions& v) {
  return v.compute == ComputeDtype::bf16 ? ElemType::bf16 : act_elem(c.dtype);
}
ref::Act mid_act(const Case& c, const SwigluConventions& v) {
  return v.compute == ComputeDtype::bf16 ? ref::Act::bf16 : ref_act(c.dtype);
}
ref::SiluRounding ref_rounding(const SwigluConventions& v) {
  return v.rounding == k::SiluRounding::rounded_to_act ? ref::SiluRounding::torchtitan : ref::SiluRounding::fused;
}
ref::ScoreMultiply ref_smul(const Case& c) {
  return c.score_multiply == k::ScoreMultiply::act ? ref::ScoreMultiply::act : ref::ScoreMultiply::fp32;
}

/// routed_row_scores, or empty with the key off and for the shared expert
/// (`mid` "shared_").
ref::Vec hidden_scores(const Case& c, const RankBoard& b, const std::string& mid) {
  if (c.score_on_hidden != Switch::on || mid != "expert_") return {};
  return routed_row_scores(c, b);
}
/// Row r0 of hidden_scores, or null where there are none.
const float* scores_from(const ref::Vec& s, int64_t r0) { return s.empty() ? nullptr : s.data() + r0; }

/// Whether the combine multiplies by the score (docs/contract.md §2): not
/// when the score was applied before the experts or inside them.
bool combine_scales(const Case& c) {
  return c.score_before_experts == Switch::off && c.score_on_hidden == Switch::off;
}

int64_t group_rows(const Tensor& counts) {
  int64_t n = 0;
  for (int64_t v : to_ints(counts)) n += v;
  return n;
}

ref::CombineSpec combine_spec(const Case& c) {
  ref::CombineSpec s;
  s.act = ref_act(c.dtype);
  s.apply = combine_scales(c) ? ref::ScoreApply::after_experts : ref::ScoreApply::before_experts;
  s.acc = c.combine.accumulate == k::Accumulate::per_add ? ref::Accumulate::per_add : ref::Accumulate::fp32_accumulate;
  s.shared_add = c.shared.kind != SharedKind::none && c.shared.order == SharedOrder::add_after ? ref::SharedAdd::add_after
                                                                                                : ref::SharedAdd::none;
  s.smul = ref_smul(c);
  return s;
}

CombineArgs combine_args(const FastCtx& ctx) {
  const Case& c = ctx.c;
  CombineArgs a;
  a.dt = c.dtype;
  a.routed_out = ctx.input("routed_output").data();
  a.score_sorted = ctx.input("score_sorted").as<float>();
  a.row_of = ctx.input("row_of").as<int32_t>();
  a.rows = ctx.input("routed_output").shape[0];
  a.T = ctx.input("x").shape[0];
  a.D = c.hidden;
  a.K = c.top_k;
  // The planted fault applies the score again after score_on_hidden did.
  a.apply = combine_scales(c) || ctx.exec.faults.has(Fault::score_applied_twice) ? k::ScoreApply::after_experts
                                                                                  : k::ScoreApply::before_experts;
  a.acc = c.combine.accumulate;
  const bool add_after = c.shared.kind != SharedKind::none && c.shared.order == SharedOrder::add_after;
  a.shared_add = add_after ? k::SharedAdd::add_after : k::SharedAdd::none;
  a.shared = add_after ? ctx.input("shared_out").data() : nullptr;
  a.smul = c.score_multiply;
  return a;
}

/// The reference combine of every rank, ranks over RefCtx::threads threads
/// (each rank's sums stay in contract order; ranks are independent).
void ref_combine(RefCtx& r) {
  const Case& c = r.c;
  const int R = int(r.in.ranks.size());
  std::vector<Tensor> outs(static_cast<size_t>(R));
  ParallelErrors errors;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(1, r.threads)) if (r.threads > 1 && R > 1)
  for (int q = 0; q < R; ++q) errors.run(q, [&] {
      const RankBoard& in = r.in.ranks[size_t(q)];
      const Tensor& x = in.at("x");
      const bool add_after = c.shared.kind != SharedKind::none && c.shared.order == SharedOrder::add_after;
      const ref::Vec shared = add_after ? to_floats(in.at("shared_out")) : ref::Vec{};
      outs[size_t(q)] = from_floats(
          ref::combine(combine_spec(c), rows_of(in.at("routed_output")), ref_ids(in.at("token_sorted")),
                       to_floats(in.at("score_sorted")), combine_init(c, in), shared, x.shape[0], c.hidden,
                       R >= r.threads ? 1 : r.threads / R),
          x.type, x.shape);
  });
  errors.rethrow();
  for (int q = 0; q < R; ++q) r.out.ranks[size_t(q)]["out"] = std::move(outs[size_t(q)]);
}

std::vector<std::string> combine_inputs(const Case& c) {
  std::vector<std::string> v = {"x", "routed_output", "score_sorted", "row_of", "token_sorted"};
  if (c.shared.kind != SharedKind::none) v.push_back("shared_out");
  return v;
}

/// The weights of experts [first, first + n) of the `w_prefix` tensors, in
/// chunks: fn(j0, m, w) for the experts [first + j0, first + j0 + m), w their
/// w1, w3 (m, F, D) and w2 (m, D, F). Held weights (every shared expert; the
/// routed ones unless experts.weights streams them) come as views into the
/// board's tensors, all in one chunk unless `max_step` says fewer; streamed
/// ones are generated a chunk at a time (make_expert_weights) on `threads`
/// threads and freed after fn.
template <class Fn>
void for_weight_chunks(const Case& c, const RankBoard& b, const std::string& w_prefix, int64_t first, int64_t n,
                       int threads, Fn fn, int64_t max_step = std::numeric_limits<int64_t>::max()) {
  if (n <= 0) return;
  const bool held = !w_prefix.empty() || !c.streams_weights();
  const int64_t step = std::max<int64_t>(1, std::min(max_step, held ? n : streamed_chunk_experts(c, n)));
  auto slice = [&](const std::string& name, int64_t e0, int64_t m) {
    const Tensor& w = b.at(w_prefix + name);
    const int64_t per = w.numel() / w.shape[0];
    return w.view(w.type, {m, w.shape[1], w.shape[2]}, w.offset_bytes + size_t(e0 * per) * elem_bytes(w.type));
  };
  ExpertWeightSlice w;  // streamed: one chunk's storage, written over by the next
  for (int64_t j0 = 0; j0 < n; j0 += step) {
    const int64_t m = std::min(step, n - j0), e0 = first + j0;
    w = held ? ExpertWeightSlice{slice("w1", e0, m), slice("w3", e0, m), slice("w2", e0, m)}
             : make_expert_weights(c, e0, m, threads, &w);
    fn(j0, m, static_cast<const ExpertWeightSlice&>(w));
  }
}

/// The first row of group j0 and the rows of groups [j0, j0 + m).
std::pair<int64_t, int64_t> chunk_rows(const int64_t* counts, int64_t j0, int64_t m) {
  int64_t r0 = 0, n = 0;
  for (int64_t j = 0; j < j0; ++j) r0 += counts[j];
  for (int64_t j = j0; j < j0 + m; ++j) n += counts[j];
  return {r0, n};
}

/// Row r0 of a (rows, ...) tensor.
template <class T>
T* row_ptr(T* base, const Tensor& t, int64_t r0) {
  return reinterpret_cast<T*>(reinterpret_cast<std::conditional_t<std::is_const_v<T>, const uint8_t*, uint8_t*>>(base) +
                              size_t(r0) * size_t(t.numel() / std::max<int64_t>(t.shape[0], 1)) * elem_bytes(t.type));
}

/// Runs SwiGLU experts on `X` rows grouped by `counts` (E_l groups) with the
/// weights of experts [expert0, expert0 + E_l) of the `w_prefix` tensors.
/// The intermediates are written as `mid`h13 and `mid`hidden.
void fast_swiglu(FastCtx& ctx, ExpertsImpl impl, const Tensor& X, const int64_t* counts, int E_l,
                 const std::string& w_prefix, int expert0, const std::string& out, const std::string& mid) {
  const Case& c = ctx.c;
  int64_t rows = 0;
  for (int j = 0; j < E_l; ++j) rows += counts[j];
  const SwigluConventions conv = swiglu_conventions(c, mid);
  Tensor& Y = ctx.output(out, X.type, {rows, c.hidden});
  Tensor& h13 = ctx.output(mid + "h13", mid_type(c, conv), {rows, 2 * c.ffn});
  Tensor& H = ctx.output(mid + "hidden", mid_type(c, conv), {rows, c.ffn});
  const ref::Vec scores = hidden_scores(c, ctx.in, mid);
  for_weight_chunks(c, ctx.in, w_prefix, expert0, E_l, ctx.exec.threads,
                    [&](int64_t j0, int64_t m, const ExpertWeightSlice& w) {
                      const int64_t r0 = chunk_rows(counts, j0, m).first;
                      SwigluConventions cv = conv;
                      cv.row_scale = scores_from(scores, r0);
                      experts_swiglu(ctx.exec, c.dtype, impl, row_ptr(X.data(), X, r0), counts + j0, int(m), c.hidden,
                                     c.ffn, w.w1.data(), w.w3.data(), w.w2.data(), row_ptr(Y.data(), Y, r0),
                                     SwigluIntermediates{row_ptr(h13.data(), h13, r0), row_ptr(H.data(), H, r0)}, cv);
                    });
}

/// The first sum(counts) rows of X as floats: rows past the last group (a
/// padding tail) are no expert's.
ref::Vec group_floats(const Case& c, const Tensor& X, const ref::Counts& counts) {
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  ref::Vec xv = to_floats(X);
  xv.resize(size_t(rows * c.hidden));
  return xv;
}

/// f(x, counts, w, r0) -> a (rows, width) Vec per chunk of experts (its
/// first row r0 of all), assembled
/// into one for all of [first, first + counts.size()): the reference's
/// per-expert functions over held or streamed weights alike.
template <class F>
ref::Vec over_chunks(const Case& c, const RankBoard& b, const ref::Vec& xv, const ref::Counts& counts,
                     const std::string& w_prefix, int64_t first, int64_t width, int threads, F f,
                     int64_t in_width = -1) {
  if (in_width < 0) in_width = c.hidden;  // xv's row width: X's, or H's (F) for the W2 GEMM
  int64_t rows = 0;
  for (int64_t n : counts) rows += n;
  ref::Vec out;
  for_weight_chunks(c, b, w_prefix, first, int64_t(counts.size()), threads,
                    [&](int64_t j0, int64_t m, const ExpertWeightSlice& w) {
                      const auto [r0, n] = chunk_rows(counts.data(), j0, m);
                      if (j0 == 0 && m == int64_t(counts.size())) {
                        out = f(xv, counts, w, 0);
                        return;
                      }
                      out.resize(size_t(rows * width));
                      const ref::Vec part =
                          f(ref::Vec(xv.begin() + r0 * in_width, xv.begin() + (r0 + n) * in_width),
                            ref::Counts(counts.begin() + j0, counts.begin() + j0 + m), w, r0);
                      std::copy(part.begin(), part.end(), out.begin() + r0 * width);
                    });
  if (out.empty()) out.assign(size_t(rows * width), 0.f);
  return out;
}

/// Error scale of SwiGLU over the first sum(counts) rows of X with the
/// weights of experts [first, first + counts.size()) of the `w_prefix` tensors
/// (and the rows' hidden_scores, if any).
Tensor swiglu_scale(const Case& c, const RankBoard& b, const Tensor& X, const ref::Counts& counts,
                    const std::string& w_prefix, int64_t first, int threads = 1, const ref::Vec& scores = {}) {
  const ref::Vec xv = group_floats(c, X, counts);
  const ref::Vec m = over_chunks(c, b, xv, counts, w_prefix, first, c.hidden, threads,
                                 [&](const ref::Vec& x, const ref::Counts& n, const ExpertWeightSlice& w, int64_t r0) {
                                   return ref::swiglu_magnitude(x, n, c.hidden, c.ffn, weight_view(w.w1, 0),
                                                                weight_view(w.w3, 0), weight_view(w.w2, 0), threads,
                                                                scores_from(scores, r0));
                                 });
  return from_floats(m, ElemType::f32, {int64_t(xv.size()) / std::max<int64_t>(c.hidden, 1), c.hidden});
}

Tensor routed_swiglu_scale(const Case& c, const RankBoard& b, int rank, int ranks) {
  const ref::Counts counts = ref_counts(b.at("expert_counts"));
  return swiglu_scale(c, b, b.at("expert_input"), counts, "", int64_t(rank) * (c.num_experts / ranks), 1,
                      hidden_scores(c, b, "expert_"));
}

/// Where a SwiGLU runs: its input rows, their groups, and whose weights.
struct SwigluSite {
  std::string input, w_prefix, mid;
  std::function<ref::Counts(const RankBoard&)> counts_of;
  std::function<int64_t(const Case&, int rank, int ranks)> first_expert;
};

const SwigluSite& routed_site() {
  static const SwigluSite s{"expert_input", "", "expert_",
                            [](const RankBoard& b) { return ref_counts(b.at("expert_counts")); },
                            [](const Case& c, int rank, int ranks) { return int64_t(rank) * (c.num_experts / ranks); }};
  return s;
}

const SwigluSite& shared_site() {
  static const SwigluSite s{"x", "shared_", "shared_", [](const RankBoard& b) { return ref::Counts{b.at("x").shape[0]}; },
                            [](const Case&, int, int) { return int64_t(0); }};
  return s;
}

/// The intermediates of a SwiGLU as checked outputs (issue 11: an extra
/// rounding inside the activation hid under the GEMM tolerance): h13 against
/// the reference up to the rounding an fp32 accumulation allows (class
/// rounding: mostly bitwise in bf16/fp16, so a wrong input or result
/// rounding under experts.compute_dtype fails too), and H against the
/// activation the reference computes from the fast h13 itself, up to one
/// act rounding (from the reference's h13, with the room a correct h13 may
/// take, where `check` has no h13 of the implementation's).
std::vector<OutputSpec> swiglu_mid_outputs(const SwigluSite& site, Coords co) {
  const SwigluSite* st = &site;
  // h13's half-width: how far a correct fp32 GEMM's h13 may land
  const auto h13_halfwidth = [st](const Case& c, const RankBoard& b, int rank, int ranks) {
    const ref::Counts counts = st->counts_of(b);
    const ref::Vec xv = group_floats(c, b.at(st->input), counts);
    const ref::Act a = mid_act(c, swiglu_conventions(c, st->mid));
    return over_chunks(c, b, xv, counts, st->w_prefix, st->first_expert(c, rank, ranks), 2 * c.ffn, 1,
                       [&](const ref::Vec& x, const ref::Counts& n, const ExpertWeightSlice& w, int64_t) {
                         return ref::swiglu_h13_halfwidth(a, x, n, c.hidden, c.ffn, weight_view(w.w1, 0),
                                                          weight_view(w.w3, 0));
                       });
  };
  OutputSpec h13(site.mid + "h13", CompareClass::rounding, co, nullptr,
                 [h13_halfwidth](const Case& c, const RankBoard& b, int rank, int ranks) {
                   const ref::Vec hw = h13_halfwidth(c, b, rank, ranks);
                   return from_floats(hw, ElemType::f32, {int64_t(hw.size()) / (2 * c.ffn), 2 * c.ffn});
                 });
  OutputSpec hidden(site.mid + "hidden", CompareClass::rounding, co, nullptr);
  hidden.from_fast = [st, h13_halfwidth](const Case& c, const RankBoard& b, int rank, int ranks, bool own_inputs,
                                         Tensor& scale) {
    const Tensor& h13 = b.at(st->mid + "h13");
    const int64_t rows = h13.shape[0], F = c.ffn;
    const SwigluConventions conv = swiglu_conventions(c, st->mid);
    ref::Vec half;
    const ref::Vec scores = hidden_scores(c, b, st->mid);
    const ref::Vec hv = to_floats(h13);
    const ref::Vec H =
        ref::swiglu_hidden(mid_act(c, conv), hv, rows, F, half, ref_rounding(conv), scores_from(scores, 0));
    if (!own_inputs) {
      // The reference's h13 stands for the implementation's, which may be
      // any rounding its half-width allows: H of h1 and h3 each at either
      // end too, each with its own half-width.
      const ref::Vec w = h13_halfwidth(c, b, rank, ranks);
      for (int s1 = -1; s1 <= 1; ++s1)
        for (int s3 = -1; s3 <= 1; ++s3) {
          if (s1 == 0 && s3 == 0) continue;
          ref::Vec moved = hv, moved_half;
          for (size_t i = 0; i < moved.size() && i < w.size(); ++i)
            moved[i] += float(((i / size_t(F)) % 2 == 0 ? s1 : s3)) * w[i];
          const ref::Vec Hm = ref::swiglu_hidden(mid_act(c, conv), moved, rows, F, moved_half, ref_rounding(conv),
                                                 scores_from(scores, 0));
          for (size_t i = 0; i < half.size(); ++i)
            half[i] = std::max(half[i], std::fabs(Hm[i] - H[i]) + moved_half[i]);
        }
    }
    scale = from_floats(half, ElemType::f32, {rows, F});
    return from_floats(H, h13.type, {rows, F});
  };
  hidden.from_fast_label = "ref on fast h13";
  return {h13, hidden};
}

/// The SwiGLU output `o` of `site` also judged on the implementation's own
/// H (OutputSpec::on_own): Y = round(H W2^T) from the H it wrote, up to the
/// rounding an fp32 accumulation allows (ref::swiglu_output_on_hidden).
OutputSpec judged_on_own_hidden(OutputSpec o, const SwigluSite& site) {
  const SwigluSite* st = &site;
  o.on_own_input = site.mid + "hidden";
  o.on_own = [st](const Case& c, const RankBoard& b, int rank, int ranks, Tensor& scale) {
    const ref::Counts counts = st->counts_of(b);
    const int64_t D = c.hidden, F = c.ffn;
    int64_t rows = 0;
    for (int64_t n : counts) rows += n;
    const Tensor& H = b.at(st->mid + "hidden");
    if (H.shape.size() != 2 || H.shape[0] < rows || H.shape[1] != F) return Tensor{};
    ref::Vec hv = to_floats(H);
    hv.resize(size_t(rows * F));
    const SwigluConventions conv = swiglu_conventions(c, st->mid);
    // each row: [Y (D) | its half-width (D)], split below
    const ref::Vec both = over_chunks(
        c, b, hv, counts, st->w_prefix, st->first_expert(c, rank, ranks), 2 * D, 1,
        [&](const ref::Vec& h, const ref::Counts& n, const ExpertWeightSlice& w, int64_t) {
          ref::Vec half;
          const ref::Vec y = ref::swiglu_output_on_hidden(ref_act(c.dtype), mid_act(c, conv), h, n, D, F,
                                                          weight_view(w.w2, 0), half);
          ref::Vec rowwise(y.size() * 2);
          for (size_t r = 0; r < y.size() / size_t(D); ++r) {
            std::copy_n(y.begin() + r * D, D, rowwise.begin() + r * 2 * D);
            std::copy_n(half.begin() + r * D, D, rowwise.begin() + r * 2 * D + D);
          }
          return rowwise;
        },
        F);
    ref::Vec Y(size_t(rows * D)), half(size_t(rows * D));
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(both.begin() + r * 2 * D, D, Y.begin() + r * D);
      std::copy_n(both.begin() + r * 2 * D + D, D, half.begin() + r * D);
    }
    scale = from_floats(half, ElemType::f32, {rows, D});
    return from_floats(Y, act_elem(c.dtype), {rows, D});
  };
  return o;
}

/// |v| elementwise, as an f32 error scale.
ref::Vec abs_of(const Tensor& t) {
  ref::Vec v = to_floats(t);
  for (float& x : v) x = std::fabs(x);
  return v;
}

/// Error scale of the shared expert's output on x.
ref::Vec shared_scale(const Case& c, const RankBoard& b) {
  const Tensor& x = b.at("x");
  if (c.shared.kind == SharedKind::swiglu) return to_floats(swiglu_scale(c, b, x, {x.shape[0]}, "shared_", 0));
  return abs_of(x);
}

/// The SwiGLU error scales of every rank's rows rows[q] (grouped by
/// counts[q] over all E experts), expert by expert across the ranks: each
/// expert's weights are decoded (or, streamed, generated) once for all
/// ranks' rows, not once per rank. The experts go in chunks of about 256 MiB
/// of gathered fp32 rows (and of streamed weights).
std::vector<ref::Vec> swiglu_scales_all_ranks(const Case& c, const RankBoard& weights, const std::vector<Tensor>& rows,
                                              const std::vector<ref::Counts>& counts, int threads,
                                              const std::vector<ref::Vec>& scores) {
  const size_t R = rows.size();
  const int64_t D = c.hidden, E = c.num_experts;
  std::vector<std::vector<int64_t>> at(R, std::vector<int64_t>(size_t(E) + 1, 0));  // first row of (q, e)
  int64_t total = 0;
  for (size_t q = 0; q < R; ++q) {
    for (int64_t e = 0; e < E; ++e) at[q][size_t(e) + 1] = at[q][size_t(e)] + counts[q][size_t(e)];
    total += at[q][size_t(E)];
  }
  std::vector<ref::Vec> out(R);
  for (size_t q = 0; q < R; ++q) out[q].assign(size_t(at[q][size_t(E)] * D), 0.f);
  const double per_expert_bytes = double(total) / double(E) * double(D) * sizeof(float);
  const int64_t max_step = std::max<int64_t>(1, int64_t(double(256 << 20) / std::max(per_expert_bytes, 1.0)));
  auto block = [&](size_t q, int64_t e) {  // rank q's rows of expert e
    const Tensor& t = rows[q];
    const int64_t n = at[q][size_t(e) + 1] - at[q][size_t(e)];
    return t.view(t.type, {n, D}, t.offset_bytes + size_t(at[q][size_t(e)] * D) * elem_bytes(t.type));
  };
  for_weight_chunks(
      c, weights, "", 0, E, threads,
      [&](int64_t j0, int64_t m, const ExpertWeightSlice& w) {
        ref::Vec x, s;  // the rows, and their hidden scores where there are
        ref::Counts n(size_t(m), 0);
        for (int64_t e = j0; e < j0 + m; ++e)
          for (size_t q = 0; q < R; ++q) {
            const ref::Vec v = to_floats(block(q, e));
            x.insert(x.end(), v.begin(), v.end());
            n[size_t(e - j0)] += counts[q][size_t(e)];
            if (!scores[q].empty())
              s.insert(s.end(), scores[q].begin() + at[q][size_t(e)], scores[q].begin() + at[q][size_t(e) + 1]);
          }
        const ref::Vec mag = ref::swiglu_magnitude(x, n, D, c.ffn, weight_view(w.w1, 0), weight_view(w.w3, 0),
                                                   weight_view(w.w2, 0), threads, scores_from(s, 0));
        size_t pos = 0;
        for (int64_t e = j0; e < j0 + m; ++e)
          for (size_t q = 0; q < R; ++q) {
            const size_t len = size_t((at[q][size_t(e) + 1] - at[q][size_t(e)]) * D);
            std::copy(mag.begin() + pos, mag.begin() + pos + len, out[q].begin() + at[q][size_t(e)] * D);
            pos += len;
          }
      },
      max_step);
  return out;
}

}  // namespace

std::vector<Tensor> combined_magnitudes(const Case& c, const std::vector<RankBoard>& ranks, int threads) {
  // Rows of each rank's own dispatch (all E experts), as the experts see them:
  // their scale is |row| itself where the experts are exact.
  // Under FP8 dispatch the experts see the dequantised rows (docs/contract.md §16).
  const size_t R = ranks.size();
  std::vector<Tensor> rows(R);
  for (size_t q = 0; q < R; ++q)
    rows[q] = c.fp8() ? fp8_rows_dequantised(c, ranks[q], "routed_input") : ranks[q].at("routed_input");
  if (c.experts.kind == ExpertKind::swiglu && R > 0) {
    std::vector<ref::Counts> counts(R);
    for (size_t q = 0; q < R; ++q) counts[q] = ref_counts(ranks[q].at("counts"));
    std::vector<ref::Vec> hs(R);
    for (size_t q = 0; q < R; ++q) hs[q] = hidden_scores(c, ranks[q], "expert_");
    std::vector<ref::Vec> scales = swiglu_scales_all_ranks(c, ranks[0], rows, counts, threads, hs);
    for (size_t q = 0; q < R; ++q) {
      const int64_t n = int64_t(scales[q].size()) / std::max<int64_t>(c.hidden, 1);
      rows[q] = from_floats(scales[q], ElemType::f32, {n, c.hidden});
      scales[q] = ref::Vec{};
    }
  }
  std::vector<Tensor> out(R);
  for (size_t q = 0; q < R; ++q) {
    const RankBoard& b = ranks[q];
    const Tensor& x = b.at("x");
    const bool shared = c.shared.kind != SharedKind::none;
    const ref::Vec sh = shared ? shared_scale(c, b) : ref::Vec{};
    ref::Vec init = c.combine.buffer == OutBuffer::fresh && shared && c.shared.order == SharedOrder::init_with_shared
                        ? sh
                        : combine_init(c, b);
    for (float& v : init) v = std::fabs(v);
    out[q] = from_floats(ref::combine_magnitude(combine_spec(c), rows_of(rows[q]),
                                                rows[q].type == ElemType::f32 ? ref::Act::fp32 : ref_act(c.dtype),
                                                ref_ids(b.at("token_sorted")), to_floats(b.at("score_sorted")), init,
                                                sh, x.shape[0], c.hidden, threads),
                         ElemType::f32, x.shape);
    rows[q] = Tensor{};
  }
  return out;
}

void ref_swiglu(RefCtx& r, const std::string& in, const std::function<ref::Counts(const RankBoard&)>& counts_of,
                const std::string& w_prefix, int64_t expert0_per_rank, const std::string& out, const std::string& mid) {
  const Case& c = r.c;
  const int64_t D = c.hidden, F = c.ffn;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    const RankBoard& b = r.in.ranks[q];
    const ref::Counts counts = counts_of(b);
    const Tensor& X = b.at(in);
    const ref::Vec xv = group_floats(c, X, counts);
    const int64_t rows = int64_t(xv.size()) / std::max<int64_t>(D, 1);
    const SwigluConventions conv = swiglu_conventions(c, mid);
    const ref::Vec scores = hidden_scores(c, b, mid);
    // Y, h13 and (with scales) their error scales: the one chunk's trace as
    // it is (held weights), else each chunk's rows put in place.
    ref::SwigluTrace all;
    auto place = [&](std::vector<float>& dst, const std::vector<float>& src, int64_t width, int64_t r0) {
      if (src.empty()) return;  // an error scale not asked for
      if (dst.empty()) dst.assign(size_t(rows * width), 0.f);
      std::copy(src.begin(), src.end(), dst.begin() + r0 * width);
    };
    for_weight_chunks(c, b, w_prefix, int64_t(q) * expert0_per_rank, int64_t(counts.size()), r.threads,
                      [&](int64_t j0, int64_t m, const ExpertWeightSlice& w) {
                        const auto [r0, n] = chunk_rows(counts.data(), j0, m);
                        ref::SwigluTrace tr = ref::swiglu_experts_traced(
                            ref_act(c.dtype), ref::Vec(xv.begin() + r0 * D, xv.begin() + (r0 + n) * D),
                            ref::Counts(counts.begin() + j0, counts.begin() + j0 + m), D, F, weight_view(w.w1, 0),
                            weight_view(w.w3, 0), weight_view(w.w2, 0), ref_rounding(conv),
                            conv.compute == ComputeDtype::bf16 ? ref::Compute::bf16 : ref::Compute::act, r.threads,
                            r.wants_scales(), scores_from(scores, r0));
                        if (m == int64_t(counts.size())) {
                          all = std::move(tr);
                          return;
                        }
                        place(all.Y, tr.Y, D, r0);
                        place(all.h13, tr.h13, 2 * F, r0);
                        place(all.magnitude, tr.magnitude, D, r0);
                        place(all.h13_halfwidth, tr.h13_halfwidth, 2 * F, r0);
                      });
    r.out.ranks[q][out] = from_floats(all.Y, X.type, {rows, D});
    r.out.ranks[q][mid + "h13"] = from_floats(all.h13, mid_type(c, conv), {rows, 2 * F});
    if (r.wants_scales()) {  // the error scales of Y and h13, from the same GEMMs (swiglu_mid_outputs)
      r.scales->ranks[q][out] = from_floats(all.magnitude, ElemType::f32, {rows, D});
      r.scales->ranks[q][mid + "h13"] = from_floats(all.h13_halfwidth, ElemType::f32, {rows, 2 * F});
    }
  }
}

/// Reference of every routed SwiGLU variant: rank q's experts are the block
/// [q*E_l, (q+1)*E_l) over the padded groups of expert_input.
void ref_routed_swiglu(RefCtx& r) {
  const int64_t E_l = r.c.num_experts / int64_t(r.in.ranks.size());
  ref_swiglu(r, "expert_input", [](const RankBoard& b) { return ref_counts(b.at("expert_counts")); }, "", E_l,
             "expert_output", "expert_");
}

namespace {

// One descriptor per stage variant (docs/architecture.md idea 4); register_local_stages
// lists them in slot order.

Stage router_logits_fp32() {
  Stage s;
  s.slot = "router_logits";
  s.variant = "gemm_fp32";
  s.summary = "logits = float(x) * float(Wg)^T, fp32 accumulation (docs/contract.md §1)";
  s.applies = [](const Case& c) {
    return Decision{c.router.gate_dtype == GateDtype::fp32, "router.gate_dtype: act"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x", "wg"});
  // The error scale is the sum of |terms| (an fp32 sum of D products lands
  // in an order of its own: cuBLAS's on an H200 erred 4.9e-5 at D = 7168,
  // twice the bound against |r| alone).
  s.outputs = {{"logits", CompareClass::logits, Coords::token_expert, nullptr,
                [](const Case& c, const RankBoard& b, int, int) {
                  const Tensor& x = b.at("x");
                  return from_floats(
                      ref::gemm_magnitude(to_floats(x), to_floats(b.at("wg")), x.shape[0], c.hidden, c.num_experts),
                      ElemType::f32, {x.shape[0], c.num_experts});
                }}};
  s.fast = [](FastCtx& ctx) {
    const Tensor& x = ctx.input("x");
    Tensor& l = ctx.output("logits", ElemType::f32, {x.shape[0], ctx.c.num_experts});
    router_logits(ctx.exec, ctx.c.dtype, x.data(), ctx.input("wg").data(), x.shape[0], ctx.c.hidden,
                  ctx.c.num_experts, l.as<float>());
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const Tensor& x = r.in.at("x", int(q));
      r.out.ranks[q]["logits"] = from_floats(
          ref::router_logits(to_floats(x), to_floats(r.in.at("wg", int(q))), x.shape[0], r.c.hidden, r.c.num_experts),
          ElemType::f32, {x.shape[0], r.c.num_experts});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

// docs/contract.md §14 router.gate_dtype act (torchtitan on CPU, where
// autocast(float32) is ignored): each logit rounded to act. The fast
// logit must be an act rounding of a value within the fp32 accumulation
// bound of the exact one (class rounding; the half-width is mostly 0), so
// a missing rounding fails where a GEMM tolerance would hide it.
Stage router_logits_act() {
  Stage s;
  s.slot = "router_logits";
  s.variant = "gemm_act";
  s.summary = "logits = round_act(x * Wg^T), then fp32 (docs/contract.md §14 router.gate_dtype: act)";
  s.applies = [](const Case& c) {
    return Decision{c.router.gate_dtype == GateDtype::act, "router.gate_dtype: fp32"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x", "wg"});
  s.outputs = {{"logits", CompareClass::rounding, Coords::token_expert, nullptr,
                [](const Case& c, const RankBoard& b, int, int) {
                  const Tensor& x = b.at("x");
                  return from_floats(ref::router_logits_halfwidth(to_floats(x), to_floats(b.at("wg")), x.shape[0],
                                                                  c.hidden, c.num_experts, ref_act(c.dtype)),
                                     ElemType::f32, {x.shape[0], c.num_experts});
                }}};
  s.fast = [](FastCtx& ctx) {
    const Tensor& x = ctx.input("x");
    Tensor& l = ctx.output("logits", ElemType::f32, {x.shape[0], ctx.c.num_experts});
    router_logits(ctx.exec, ctx.c.dtype, x.data(), ctx.input("wg").data(), x.shape[0], ctx.c.hidden,
                  ctx.c.num_experts, l.as<float>(), GateDtype::act);
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const Tensor& x = r.in.at("x", int(q));
      r.out.ranks[q]["logits"] =
          from_floats(ref::router_logits(to_floats(x), to_floats(r.in.at("wg", int(q))), x.shape[0], r.c.hidden,
                                         r.c.num_experts, ref::GateDtype::act, ref_act(r.c.dtype)),
                      ElemType::f32, {x.shape[0], r.c.num_experts});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

Stage topk_routing() {
  Stage s;
  s.slot = "routing";
  s.variant = "topk_router";
  s.summary = "scores, bias, group limit, top-k (lower id wins ties), force-LB, norm, scale, counts (docs/contract.md §1)";
  s.applies = always;
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"logits", "bias"});
  s.outputs = {{"scores", CompareClass::scores, Coords::token_expert, nullptr},
               {"ids", CompareClass::exact, Coords::token_k, nullptr},
               {"topk_scores", CompareClass::scores, Coords::token_k, nullptr},
               {"counts", CompareClass::exact, Coords::expert, nullptr}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& l = ctx.input("logits");
    const int64_t T = l.shape[0];
    Tensor& scores = ctx.output("scores", ElemType::f32, {T, c.num_experts});
    Tensor choice = Tensor::alloc(ElemType::f32, {T, c.num_experts});
    Tensor& ids = ctx.output("ids", ElemType::i32, {T, c.top_k});
    Tensor& ts = ctx.output("topk_scores", ElemType::f32, {T, c.top_k});
    Tensor& counts = ctx.output("counts", ElemType::i64, {c.num_experts});
    router_route(ctx.exec, router_config(c), l.as<float>(), ctx.input("bias").as<float>(), T, scores.as<float>(),
                 choice.as<float>(), ids.as<int32_t>(), ts.as<float>(), counts.as<int64_t>());
  };
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    const ref::RouterSpec spec = ref_router_spec(c);
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const Tensor& l = r.in.at("logits", int(q));
      const int64_t T = l.shape[0];
      const ref::RouterOut o = ref::route(spec, to_floats(l), to_floats(r.in.at("bias", int(q))), T);
      RankBoard& out = r.out.ranks[q];
      out["scores"] = from_floats(o.scores, ElemType::f32, {T, c.num_experts});
      out["choice"] = from_floats(o.choice, ElemType::f32, {T, c.num_experts});
      out["ids"] = ids_tensor(o.ids, ElemType::i32, {T, c.top_k});
      out["topk_scores"] = from_floats(o.topk_scores, ElemType::f32, {T, c.top_k});
      out["counts"] = from_ints(o.counts, ElemType::i64, {c.num_experts});
    }
  };
  s.check = check_routing;
  s.backends = kHostAndDevice;
  return s;
}

Stage local_sort_gather() {
  Stage s;
  s.slot = "dispatch";
  s.variant = "local_sort_gather";
  s.summary = "stable counting sort by (expert, assignment), gather rows (docs/contract.md §2)";
  s.applies = [](const Case& c) {
    return Decision{!c.fp8(), "dispatch.dtype: fp8_e4m3 (local_sort_gather_fp8 gathers the e4m3 rows and scales)"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x", "ids", "topk_scores", "counts"});
  s.outputs = {{"routed_input", CompareClass::exact, Coords::dispatch_row, promise_always},
               {"token_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"score_sorted", CompareClass::exact, Coords::flat, nullptr},
               {"row_of", CompareClass::exact, Coords::token_k, nullptr}};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& x = ctx.input("x");
    const int64_t T = x.shape[0], N = T * c.top_k;
    Tensor perm = Tensor::alloc(ElemType::i32, {N});
    expert_sort(ctx.exec, ctx.input("ids").as<int32_t>(), N, c.num_experts, perm.as<int32_t>());
    Tensor& routed = ctx.output("routed_input", x.type, {N, c.hidden});
    Tensor& tok = ctx.output("token_sorted", ElemType::i32, {N});
    Tensor& sc = ctx.output("score_sorted", ElemType::f32, {N});
    Tensor& row_of = ctx.output("row_of", ElemType::i32, {T, c.top_k});
    dispatch_gather(ctx.exec, c.dtype,
                    c.score_before_experts == Switch::on ? k::ScoreApply::before_experts
                                                         : k::ScoreApply::after_experts,
                    x.data(), perm.as<int32_t>(), ctx.input("topk_scores").as<float>(), N, c.hidden, c.top_k,
                    routed.data(), tok.as<int32_t>(), sc.as<float>(), row_of.as<int32_t>(), c.score_multiply);
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    const Case& c = r.c;
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const RankBoard& in = r.in.ranks[q];
      const Tensor& x = in.at("x");
      const int64_t T = x.shape[0], N = T * c.top_k;
      ref::LocalDispatch d = ref::local_dispatch(
          ref_act(c.dtype),
          c.score_before_experts == Switch::on ? ref::ScoreApply::before_experts : ref::ScoreApply::after_experts,
          rows_of(x), ref_ids(in.at("ids")), to_floats(in.at("topk_scores")), T, c.hidden, c.top_k, c.num_experts,
          ref_smul(c));
      RankBoard& out = r.out.ranks[q];
      out["routed_input"] = rows_tensor(std::move(d.routed), x.type, c.hidden);
      out["token_sorted"] = ids_tensor(d.token_sorted, ElemType::i32, {N});
      out["score_sorted"] = from_floats(d.score_sorted, ElemType::f32, {N});
      out["row_of"] = ids_tensor(d.row_of, ElemType::i32, {T, c.top_k});
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

// docs/frameworks.md §6.2: the stable sort of round-robin ids depends only on
// (T*K, E, K), so it is cached under that key. The variant applies only
// with force-load-balance routing (a cached order used with top-k routing
// would silently be wrong). Each rank has its own cache, as each process
// does under mpirun: in-process ranks sharing one would make which rank
// misses first, and so the report, depend on thread scheduling.
Stage force_lb_cached_sort() {
  Stage s;
  s.slot = "dispatch";
  s.variant = "force_lb_cached_sort";
  s.summary = "force-LB only: the sort order of round-robin ids cached by (T*K, E, K), then the same gather";
  s.applies = [](const Case& c) {
    if (c.router.force_load_balance == Switch::on && c.fp8())
      return Decision{false, "dispatch.dtype: fp8_e4m3 (the cached-order gather moves activation rows)"};
    return Decision{c.router.force_load_balance == Switch::on, "router.force_load_balance: off"};
  };
  s.primary = [](const Case&) { return false; };
  s.inputs = fixed_inputs({"x", "ids", "topk_scores", "counts"});
  s.outputs = local_sort_gather().outputs;
  s.fast = [](FastCtx& ctx) {
    static std::mutex m;
    static std::map<std::tuple<int, int64_t, int, int, uint64_t>, std::vector<int32_t>> cache;
    const Case& c = ctx.c;
    const Tensor& x = ctx.input("x");
    const int64_t T = x.shape[0], N = T * c.top_k;
    std::vector<int32_t> perm;
    bool hit = false;
    {
      std::lock_guard<std::mutex> lk(m);
      // The planted faults are part of the key: an order sorted under one
      // (an unstable sort, say) must not be served to a run without it.
      auto key = std::make_tuple(ctx.rank, N, c.num_experts, c.top_k, ctx.exec.faults.bits);
      auto it = cache.find(key);
      hit = it != cache.end();
      if (!hit) {
        std::vector<int32_t> rr(static_cast<size_t>(N));
        for (int64_t a = 0; a < N; ++a) rr[size_t(a)] = int32_t(a % c.num_experts);  // (t*K + k) mod E
        std::vector<int32_t> p(static_cast<size_t>(N));
        expert_sort(ExecCtx{1, ctx.exec.faults}, rr.data(), N, c.num_experts, p.data());
        it = cache.emplace(key, std::move(p)).first;
      }
      perm = it->second;
    }
    Tensor& routed = ctx.output("routed_input", x.type, {N, c.hidden});
    Tensor& tok = ctx.output("token_sorted", ElemType::i32, {N});
    Tensor& sc = ctx.output("score_sorted", ElemType::f32, {N});
    Tensor& row_of = ctx.output("row_of", ElemType::i32, {T, c.top_k});
    dispatch_gather(ctx.exec, c.dtype,
                    c.score_before_experts == Switch::on ? k::ScoreApply::before_experts : k::ScoreApply::after_experts,
                    x.data(), perm.data(), ctx.input("topk_scores").as<float>(), N, c.hidden, c.top_k, routed.data(),
                    tok.as<int32_t>(), sc.as<float>(), row_of.as<int32_t>(), c.score_multiply);
    ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": sort order cache " + (hit ? "hit" : "miss") +
                        " for (T*K, E, K) = (" + std::to_string(N) + ", " + std::to_string(c.num_experts) + ", " +
                        std::to_string(c.top_k) + ")");
  };
  s.ref = local_sort_gather().ref;
  s.backends = kHostAndDevice;
  return s;
}

Stage identity_experts() {
  Stage s;
  s.slot = "experts";
  s.variant = "identity";
  s.summary = "Y = X (makes the whole pipeline exact)";
  s.applies = [](const Case& c) {
    return Decision{c.experts.kind == ExpertKind::identity, "experts.kind is not identity"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"expert_input", "expert_counts"});
  s.outputs = {{"expert_output", CompareClass::exact, Coords::padded_row, promise_expert_rows}};
  s.fast = [](FastCtx& ctx) {
    const Tensor& X = ctx.input("expert_input");
    const int64_t rows = group_rows(ctx.input("expert_counts"));
    Tensor& Y = ctx.output("expert_output", X.type, {rows, ctx.c.hidden});
    copy_bytes(ctx.exec, Y.data(), X.data(), Y.bytes());
  };
  s.ref_per_rank = true;
  s.ref = [](RefCtx& r) {
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      if (!r.wants(int(q))) continue;
      const ref::RowsRef X = rows_of(r.in.at("expert_input", int(q)));
      const int64_t rows = group_rows(r.in.at("expert_counts", int(q)));  // a padding tail is no expert's
      r.out.ranks[q]["expert_output"] =
          rows_tensor(ref::Bytes(X.data, X.data + size_t(rows) * X.row_bytes), r.in.at("expert_input", int(q)).type,
                      r.c.hidden);
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

/// What a routed SwiGLU stage reads from the board: the weights only where
/// they are held (streamed ones are generated by the stage itself).
std::vector<std::string> routed_swiglu_inputs(const Case& c) {
  std::vector<std::string> v = {"expert_input", "expert_counts"};
  if (!c.streams_weights()) v.insert(v.end(), {"w1", "w3", "w2"});
  if (c.score_on_hidden == Switch::on) v.push_back("score_sorted");  // hidden_scores
  return v;
}

Stage swiglu_experts(ExpertsImpl impl) {
  Stage s;
  s.slot = "experts";
  s.variant = std::string("swiglu_") + enum_name(experts_impl_table(), impl);
  s.summary = impl == ExpertsImpl::loop ? "SwiGLU, one expert at a time, row-tiled GEMMs (docs/contract.md §8)"
                                        : "SwiGLU, one work list of (expert, tile) items over the group offsets";
  s.applies = [](const Case& c) { return Decision{c.experts.kind == ExpertKind::swiglu, "experts.kind is not swiglu"}; };
  s.primary = [impl](const Case& c) { return c.experts.impl == impl; };
  s.inputs = routed_swiglu_inputs;
  s.outputs = {judged_on_own_hidden(
      {"expert_output", CompareClass::gemm, Coords::padded_row, promise_expert_rows, routed_swiglu_scale},
      routed_site())};
  for (auto& o : swiglu_mid_outputs(routed_site(), Coords::padded_row)) s.outputs.push_back(o);
  s.fast = [impl](FastCtx& ctx) {
    const Tensor& counts = ctx.input("expert_counts");
    const int E_l = int(counts.numel());
    fast_swiglu(ctx, impl, ctx.input("expert_input"), counts.as<int64_t>(), E_l, "", ctx.rank * E_l,
                "expert_output", "expert_");
  };
  s.ref = ref_routed_swiglu;
  s.ref_per_rank = true;  // ref_swiglu honours RefCtx::rank
  s.backends = kHostAndDevice;
  return s;
}

Stage swiglu_batched() {
  Stage s;
  s.slot = "experts";
  s.variant = "swiglu_batched";
  s.summary = "every local expert has c > 0 rows: fused W13 = [W1; W3] GEMM and cached W2^T (docs/contract.md §8)";
  s.applies = [](const Case& c) { return Decision{c.experts.kind == ExpertKind::swiglu, "experts.kind is not swiglu"}; };
  s.primary = [](const Case& c) { return c.experts.impl == ExpertsImpl::batched; };
  s.asked = s.primary;
  s.inputs = routed_swiglu_inputs;
  s.outputs = {judged_on_own_hidden(
      {"expert_output", CompareClass::gemm, Coords::padded_row, promise_expert_rows, routed_swiglu_scale},
      routed_site())};
  for (auto& o : swiglu_mid_outputs(routed_site(), Coords::padded_row)) s.outputs.push_back(o);
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const std::vector<int64_t> counts = to_ints(ctx.input("expert_counts"));
    const int E_l = int(counts.size());
    const int64_t cnt = uniform_count(counts);
    if (cnt == 0) {
      ctx.skip("local expert counts are not all equal and > 0");
      return;
    }
    const Tensor& X = ctx.input("expert_input");
    const int e0 = ctx.rank * E_l;
    Tensor& Y = ctx.output("expert_output", X.type, {cnt * E_l, c.hidden});
    const SwigluConventions conv = swiglu_conventions(c, "expert_");
    Tensor& h13 = ctx.output("expert_h13", mid_type(c, conv), {cnt * E_l, 2 * c.ffn});
    Tensor& H = ctx.output("expert_hidden", mid_type(c, conv), {cnt * E_l, c.ffn});
    // The cache is cold per run (and per chunk of streamed weights); its
    // reuse across versions is tested in test_ep.cpp.
    const ref::Vec scores = hidden_scores(c, ctx.in, "expert_");
    for_weight_chunks(c, ctx.in, "", e0, E_l, ctx.exec.threads, [&](int64_t j0, int64_t m, const ExpertWeightSlice& w) {
      BatchedWeightCache cache;
      const int64_t r0 = j0 * cnt;
      SwigluConventions cv = conv;
      cv.row_scale = scores_from(scores, r0);
      experts_swiglu_batched(ctx.exec, c.dtype, row_ptr(X.data(), X, r0), cnt, int(m), c.hidden, c.ffn, w.w1.data(),
                             w.w3.data(), w.w2.data(), 1, cache, row_ptr(Y.data(), Y, r0),
                             SwigluIntermediates{row_ptr(h13.data(), h13, r0), row_ptr(H.data(), H, r0)}, cv);
    });
    ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": batched over (E_l, c) = (" + std::to_string(E_l) +
                        ", " + std::to_string(cnt) + ")");
  };
  s.ref = ref_routed_swiglu;
  s.ref_per_rank = true;  // ref_swiglu honours RefCtx::rank
  s.backends = kHostAndDevice;
  return s;
}

Stage shared_identity() {
  Stage s;
  s.slot = "shared_experts";
  s.variant = "shared_identity";
  s.summary = "shared(x) = x";
  s.applies = [](const Case& c) {
    return Decision{c.shared.kind == SharedKind::identity, "shared_experts.kind is not identity"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x"});
  s.outputs = {{"shared_out", CompareClass::exact, Coords::token_col, promise_always}};
  s.fast = [](FastCtx& ctx) {
    const Tensor& x = ctx.input("x");
    Tensor& y = ctx.output("shared_out", x.type, x.shape);
    copy_bytes(ctx.exec, y.data(), x.data(), x.bytes());
  };
  s.ref = [](RefCtx& r) {
    for (size_t q = 0; q < r.in.ranks.size(); ++q) {
      const Tensor& x = r.in.at("x", int(q));
      r.out.ranks[q]["shared_out"] = from_floats(to_floats(x), x.type, x.shape);
    }
  };
  s.backends = kHostAndDevice;
  return s;
}

Stage shared_swiglu() {
  Stage s;
  s.slot = "shared_experts";
  s.variant = "shared_swiglu";
  s.summary = "one SwiGLU expert over every token";
  s.applies = [](const Case& c) {
    return Decision{c.shared.kind == SharedKind::swiglu, "shared_experts.kind is not swiglu"};
  };
  s.primary = [](const Case&) { return true; };
  s.inputs = fixed_inputs({"x", "shared_w1", "shared_w3", "shared_w2"});
  s.outputs = {judged_on_own_hidden({"shared_out", CompareClass::gemm, Coords::token_col, promise_realistic,
                                      [](const Case& c, const RankBoard& b, int, int) {
                                        return from_floats(shared_scale(c, b), ElemType::f32, b.at("x").shape);
                                      }},
                                     shared_site())};
  for (auto& o : swiglu_mid_outputs(shared_site(), Coords::token_col)) s.outputs.push_back(o);
  s.fast = [](FastCtx& ctx) {
    const Tensor& x = ctx.input("x");
    const int64_t rows = x.shape[0];
    fast_swiglu(ctx, ExpertsImpl::loop, x, &rows, 1, "shared_", 0, "shared_out", "shared_");
  };
  s.ref = [](RefCtx& r) {
    ref_swiglu(r, "x", [](const RankBoard& b) { return ref::Counts{b.at("x").shape[0]}; }, "shared_", 0, "shared_out",
               "shared_");
  };
  s.ref_per_rank = true;
  s.backends = kHostAndDevice;
  return s;
}

/// The combine's output (docs/contract.md §2): bitwise under combine.order
/// ascending; under `any`, in the rounding class with the half-width
/// ref::any_order_halfwidth gives: how far a sum of the same terms in another
/// order can land from the contract's ascending one.
OutputSpec combine_out_spec() {
  OutputSpec o{"out", CompareClass::exact, Coords::token_col, promise_combined,
               [](const Case& c, const RankBoard& b, int, int) {
                 const Tensor& x = b.at("x");
                 const ref::CombineSpec spec = combine_spec(c);
                 const ref::RowsRef rows = rows_of(b.at("routed_output"));
                 const ref::Ids tok = ref_ids(b.at("token_sorted"));
                 const ref::Vec scores = to_floats(b.at("score_sorted")), init = combine_init(c, b);
                 const ref::Vec shared =
                     spec.shared_add == ref::SharedAdd::add_after ? to_floats(b.at("shared_out")) : ref::Vec{};
                 const int64_t T = x.shape[0];
                 const ref::Vec ascending = ref::combine(spec, rows, tok, scores, init, shared, T, c.hidden);
                 const ref::AnyOrderSum sum{spec.act, spec.acc, spec.apply == ref::ScoreApply::after_experts,
                                            spec.smul};
                 return from_floats(ref::any_order_halfwidth(sum, rows, tok, scores, init, shared, ascending, T, c.hidden),
                                    ElemType::f32, x.shape);
               }};
  judged_in_any_order(o);
  return o;
}

Stage combine_out_of_place() {
  Stage s;
  s.slot = "combine";
  s.variant = "out_of_place";
  s.summary = "out = init + ordered scatter-add in ascending expert order, no atomics (docs/contract.md §2, §9)";
  s.applies = always;
  s.primary = [](const Case& c) { return c.combine.placement == CombinePlacement::out_of_place; };
  s.inputs = combine_inputs;
  s.outputs = {combine_out_spec()};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& x = ctx.input("x");
    Tensor& out = ctx.output("out", x.type, x.shape);
    // The default target starts at zeros: no init buffer to read. Any other
    // is read where the board holds it (on a device: already there).
    if (const Tensor init = combine_init_tensor(c, ctx.in); init.storage)
      combine(ctx.exec, combine_args(ctx), init.data(), out.data());
    else
      combine_from_zeros(ctx.exec, combine_args(ctx), out.data());
  };
  s.ref = ref_combine;
  s.backends = kHostAndDevice;
  return s;
}

Stage combine_in_place() {
  Stage s;
  s.slot = "combine";
  s.variant = "in_place";
  s.summary = "adds into the caller's buffer unless it overlaps any input byte range (docs/contract.md §9)";
  s.applies = always;
  s.primary = [](const Case& c) { return c.combine.placement == CombinePlacement::in_place; };
  s.inputs = combine_inputs;
  s.outputs = {combine_out_spec()};
  s.fast = [](FastCtx& ctx) {
    const Case& c = ctx.c;
    const Tensor& x = ctx.input("x");
    // An aliasing buffer is the initial value itself (x, or x's storage at
    // the offset); a fresh one is the stage's output, its start (zeros or a
    // copy of shared_out) written where the combine runs.
    const Tensor init = combine_init_tensor(c, ctx.in);
    Tensor buf = init;
    BufferStart start;
    if (c.combine.buffer == OutBuffer::fresh) {
      buf = ctx.output("out", x.type, x.shape);
      start = init.storage ? BufferStart{BufferStart::Kind::copy, init.data()} : BufferStart{BufferStart::Kind::zeros};
    }
    Tensor fallback = Tensor::alloc(x.type, x.shape);
    std::vector<ByteRange> ranges;
    std::vector<const char*> names;
    for (const auto& n : combine_inputs(c)) {
      const Tensor& t = ctx.input(n);
      ranges.push_back({t.data(), t.bytes()});
      names.push_back(ctx.in.find(n)->first.c_str());
    }
    const InPlaceResult res =
        combine_in_place(ctx.exec, combine_args(ctx), buf.data(), fallback.data(), ranges.data(), names.data(),
                         int(ranges.size()), start);
    ctx.out["out"] = res.placement == Placement::in_place ? buf : fallback;
    ctx.notes.push_back(res.placement == Placement::in_place
                            ? "in_place: taken (buffer " + std::string(enum_name(out_buffer_table(), c.combine.buffer)) +
                                  " overlaps no input)"
                            : "in_place: fell back to out_of_place (" + res.reason + ")");
  };
  s.ref = ref_combine;
  s.backends = kHostAndDevice;
  return s;
}

}  // namespace

void register_local_stages(std::vector<Stage>& reg) {
  reg.push_back(router_logits_fp32());
  reg.push_back(router_logits_act());
  reg.push_back(topk_routing());
  reg.push_back(local_sort_gather());
  reg.push_back(force_lb_cached_sort());
  reg.push_back(identity_experts());
  for (ExpertsImpl impl : {ExpertsImpl::loop, ExpertsImpl::grouped}) reg.push_back(swiglu_experts(impl));
  reg.push_back(swiglu_batched());
  reg.push_back(shared_identity());
  reg.push_back(shared_swiglu());
  reg.push_back(combine_out_of_place());
  reg.push_back(combine_in_place());
}

}  // namespace moev
