// A verification case: one set of structs filled from YAML files and `--set`
// overrides (docs/architecture.md "Configuration"). Every mode is an enum with one string
// table shared by YAML and the CLI.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/bodies.h"
#include "../kernels/capacity_host.h"
#include "backend.h"
#include "diff.h"
#include "dtype.h"
#include "../kernels/moe_host.h"
#include "../kernels/sp_host.h"

namespace moev {

enum class DataMode { exact, realistic };
/// Backend (where the fast path runs): core/backend.h.
enum class ExpertKind { identity, swiglu };
enum class SharedKind { none, identity, swiglu };
enum class SharedOrder { add_after, init_with_shared };
enum class CombinePlacement { out_of_place, in_place };
enum class OutBuffer { fresh, alias_x, alias_x_offset };
/// The order of a token's fp32 additions in the combine (docs/contract.md §2):
/// `ascending` expert id, or `any` (GPU atomics: judged within a bound).
enum class CombineOrder { ascending, any };
enum class Switch { off, on };
enum class EmptyGroups { zero, pad };           // docs/contract.md §4: TE (0 rows) or torchao (A rows)
enum class PermuteMode { auto_, generic, equal_count };
enum class EqualSplitPolicy { off, force, adaptive };  // docs/frameworks.md §5.2
enum class DispatchDtype { act, fp8_e4m3 };
/// How the dispatch backward sums a token's K row gradients (docs/contract.md
/// §13, §14): as the forward combine (`combine.accumulate`), or its own mode.
enum class GradAccumulate { as_combine, per_add, fp32_accumulate };            // docs/contract.md §16: rows sent as they are, or FP8 with block scales
/// Where the routed experts' weights live (docs/architecture.md "Scale and backends"):
/// `held` as whole (E, F, D) tensors on the board, `streamed` generated a
/// few experts at a time by each stage that reads them, `auto` streamed past
/// kStreamWeightBytes.
enum class WeightStorage { auto_, held, streamed };

template <class E>
using EnumTable = std::vector<std::pair<const char*, E>>;

const EnumTable<DType>& dtype_table();
const EnumTable<DataMode>& data_mode_table();
const EnumTable<Backend>& backend_table();
const EnumTable<k::ScoreFunc>& score_table();
const EnumTable<ExpertKind>& expert_kind_table();
const EnumTable<ExpertsImpl>& experts_impl_table();
const EnumTable<SharedKind>& shared_kind_table();
const EnumTable<SharedOrder>& shared_order_table();
const EnumTable<k::Accumulate>& accumulate_table();
const EnumTable<GradAccumulate>& grad_accumulate_table();
const EnumTable<CombinePlacement>& placement_table();
const EnumTable<OutBuffer>& out_buffer_table();
const EnumTable<CombineOrder>& combine_order_table();
const EnumTable<Switch>& switch_table();
const EnumTable<EmptyGroups>& empty_groups_table();
const EnumTable<PermuteMode>& permute_table();
const EnumTable<EqualSplitPolicy>& equal_split_table();
// Framework conventions (docs/contract.md §14, docs/frameworks.md §8, §9)
const EnumTable<GateDtype>& gate_dtype_table();
const EnumTable<k::ScoreMultiply>& score_multiply_table();
const EnumTable<k::SiluRounding>& experts_rounding_table();
const EnumTable<ComputeDtype>& compute_dtype_table();
const EnumTable<WeightStorage>& weight_storage_table();
const EnumTable<SpPadding>& sp_padding_table();  // docs/contract.md §10
const EnumTable<CapacityPolicy>& capacity_policy_table();  // docs/contract.md §11
// FP8 dispatch (docs/contract.md §16)
const EnumTable<DispatchDtype>& dispatch_dtype_table();
const EnumTable<k::Fp8Scale>& fp8_scale_table();
const EnumTable<k::Fp8Quotient>& fp8_quotient_table();

template <class E>
const char* enum_name(const EnumTable<E>& t, E v) {
  for (const auto& [n, e] : t)
    if (e == v) return n;
  return "?";
}

/// Tolerance and CompareClass: core/diff.h.
const EnumTable<CompareClass>& compare_class_table();

struct Case {
  std::string name;
  std::string source;  // "file:line" of the case entry
  // shape
  int64_t tokens = 16, hidden = 32, ffn = 64;
  int num_experts = 8, top_k = 2;
  DType dtype = DType::fp32;
  uint64_t seed = 1;
  DataMode data = DataMode::exact;
  Backend backend = Backend::host;
  struct Router {
    k::ScoreFunc score = k::ScoreFunc::softmax;
    Switch bias = Switch::off;
    int groups = 1, limited_groups = 1;
    Switch force_load_balance = Switch::off;
    Switch route_norm = Switch::off;
    float route_scale = 1.f;
    int hot_expert = -1;  // >= 0: +1 selection bias on this expert (it enters every top-k)
    GateDtype gate_dtype = GateDtype::fp32;  // docs/contract.md §14: logits rounded to act under `act`
    // docs/contract.md §14 router.score_dtype: scores, their normalisation and
    // scaling (and unbiased group scores) held in act under `act`
    GateDtype score_dtype = GateDtype::fp32;
  } router;
  struct Experts {
    ExpertKind kind = ExpertKind::identity;
    ExpertsImpl impl = ExpertsImpl::loop;
    // docs/contract.md §14: `torchtitan` rounds silu(h1) to act before the product
    // (routed and shared experts); `bf16` runs the routed experts' GEMMs in bf16.
    k::SiluRounding rounding = k::SiluRounding::fused;
    ComputeDtype compute_dtype = ComputeDtype::act;
    WeightStorage weights = WeightStorage::auto_;
    // docs/contract.md §14: W1 and W3 as one GEMM [W1; W3] (Megatron's
    // linear_fc1), so that autograd forms dX in one GEMM over 2F
    Switch w13_fused = Switch::off;
  } experts;
  struct Shared {
    SharedKind kind = SharedKind::none;
    SharedOrder order = SharedOrder::add_after;
  } shared;
  Switch score_before_experts = Switch::off;
  // docs/contract.md §14 score_on_hidden: the score multiplies the SwiGLU
  // hidden H before the down projection (Megatron-Core's per_token_scale);
  // the combine then adds the expert outputs as they are.
  Switch score_on_hidden = Switch::off;
  k::ScoreMultiply score_multiply = k::ScoreMultiply::fp32;  // docs/contract.md §14: score rounded to act under `act`
  struct Combine {
    k::Accumulate accumulate = k::Accumulate::per_add;
    CombinePlacement placement = CombinePlacement::out_of_place;
    OutBuffer buffer = OutBuffer::fresh;
    int64_t alias_offset = 1;  // elements between x and the aliasing view
    CombineOrder order = CombineOrder::ascending;
  } combine;
  /// A case's override of a class of the tolerance table: only the parts set
  /// replace the table's (0 is a valid override: bitwise for that part).
  struct ToleranceOverride {
    std::optional<double> rtol, atol;
  };
  std::map<CompareClass, ToleranceOverride> tolerance_override;
  // expert parallelism (docs/contract.md §3, §4, §7)
  int ep = 1;                            // R ranks; experts are split in contiguous blocks of E/R
  std::vector<int64_t> tokens_per_rank;  // empty: every rank has `tokens` (or a draw, below)
  int64_t tokens_uniform_lo = -1, tokens_uniform_hi = -1;  // >= 0: T_r ~ uniform[lo, hi] from the seed
  int64_t align = 1;                     // A: expert group sizes padded to a multiple of A
  EmptyGroups empty_groups = EmptyGroups::zero;
  PermuteMode permute = PermuteMode::auto_;
  // equal-split all-to-all (docs/contract.md §5): pad every chunk to M* = max split
  struct EqualSplit {
    EqualSplitPolicy policy = EqualSplitPolicy::off;
    double threshold = 0.10;  // adaptive: pad only when the padding overhead <= threshold
  } equal_split;
  // sequence parallel (docs/contract.md §10): each EP rank's T = batch * seq_len
  // tokens are shared by `sp` SP ranks. SP ranks are a separate axis from the
  // EP ranks (docs/frameworks.md §10: the TP axis); one EP rank's board holds its SP
  // ranks' shards stacked (kernels/sp_host.h "SP layout").
  int sp = 1;
  int64_t batch = 1;    // B; L = T / B
  int64_t seq_len = 0;  // L: shape.seq_len gives tokens = B*L; the loader stores tokens / B (0 in a Case built in code)
  SpPadding sp_padding = SpPadding::virtual_;
  Switch backward = Switch::off;
  GradAccumulate grad_accumulate = GradAccumulate::as_combine;  // docs/contract.md §14
  /// The accumulate mode of the dispatch backward's scatter-add.
  k::Accumulate dispatch_grad_accumulate() const;
  // MoE layer entries (docs/contract.md §12): `layers` pipelines, entry l with router
  // weights of its own; `layer` is the entry a pipeline runs (set by the
  // runner, not a key; 0 keeps the single-layer inputs).
  int layers = 1;
  int layer = 0;
  // capacity and token dropping (docs/contract.md §11): factor 0 is dropless.
  struct Capacity {
    double factor = 0;
    CapacityPolicy policy = CapacityPolicy::probs;
    Switch pad_to_capacity = Switch::off;
  } capacity;
  // FP8 dispatch (docs/contract.md §16): the token rows quantised per token in
  // blocks of `block` channels before the all-to-all, each row's scales moved
  // with it; the experts take the dequantised rows. act: no quantisation.
  struct Dispatch {
    DispatchDtype dtype = DispatchDtype::act;
    k::Fp8Scale scale = k::Fp8Scale::fp32;
    int64_t block = 128;
    k::Fp8Quotient quotient = k::Fp8Quotient::reciprocal;
    double amax_clamp = 1e-4;
  } dispatch;
  bool fp8() const { return dispatch.dtype == DispatchDtype::fp8_e4m3; }

  int local_experts() const { return num_experts / ep; }
  /// Bytes of the routed experts' w1, w3 and w2 in the activation dtype.
  double routed_weight_bytes() const;
  /// Whether the routed experts' weights are streamed (experts.weights).
  bool streams_weights() const;
  int64_t tokens_on(int rank) const;
  std::string summary() const;
};

/// The tolerance of class `cls` for case `c`: the table's row for the case's
/// activation dtype (core/diff.h default_tolerance), bf16 for GEMM-like
/// classes under experts.compute_dtype bf16, and the case's overrides.
Tolerance tolerance_for(const Case& c, CompareClass cls);

/// At most this many cases per file after sweep expansion: a sweep's size is
/// checked before it is expanded, so a 10^8-case sweep is refused, not grown.
constexpr size_t kMaxCasesPerFile = 10000;
/// experts.weights auto streams the routed SwiGLU weights past this many bytes.
constexpr double kStreamWeightBytes = double(int64_t(4) << 30);
/// Case files larger than this are refused before they are parsed.
constexpr size_t kMaxCaseFileBytes = size_t(16) << 20;
/// A case name (before the sweep suffix) has at most this many characters.
constexpr size_t kMaxCaseNameChars = 200;

/// Why the case key `key` changes nothing in `c` ("combine.buffer is fresh;
/// ..."), or "" where it may. Only rules that hold for every stage: a key
/// named here is read by no stage, input draw or estimate of the case
/// (tests/inert_keys.sh runs each rule's pair of values).
std::string key_without_effect(const std::string& key, const Case& c);

/// What loading a case file has to say besides its cases, each with the
/// name of the case it is about (a sweep's base name for a whole entry).
struct LoadNotes {
  /// A case valid alone but not with the overrides (`--set ep=4` beside a
  /// case's own four-entry tokens_per_rank, a top_k above its experts):
  /// left out, with why.
  std::vector<std::pair<std::string, std::string>> left_out;
  /// "FILE:LINE:COL: KEY has no effect in case NAME: why", for each key the
  /// file writes that changes none of the cases it applies to
  /// (`combine.alias_offset` beside `combine.buffer: fresh`); none for a
  /// file the fuzz wrote (first line `# moeverify fuzz`), whose cases hold
  /// each draw's keys whole.
  std::vector<std::pair<std::string, std::string>> no_effect;
  /// A key the file writes (in the case, under defaults:, or swept) that an
  /// override sets to another value: the caller names those a profile's
  /// fixed keys replace (a --set is the user's own).
  struct Replaced {
    std::string entry, key, where, written, value;  // where: "FILE:LINE:COL"
  };
  std::vector<Replaced> replaced;
};
/// What left a case out: "--set does not fit it", or the profile's fixed
/// keys (with --set beside them where `sets`).
std::string left_out_cause(bool profile, bool sets);
/// The LoadNotes::replaced of the keys `fixed` (a profile's fixed keys) in the
/// entries `selects` keeps, one line per place and value written:
/// "FILE:LINE:COL: KEY: V is replaced by W, which profile P fixes (case A)",
/// or "(N cases: A, B, ...)" for a key under defaults:.
std::vector<std::string> replaced_notes(const LoadNotes& notes, const std::string& profile,
                                        const std::set<std::string>& fixed,
                                        const std::function<bool(const std::string&)>& selects);
/// "case NAME left out (CAUSE): WHY" for a LoadNotes::left_out entry.
std::string left_out_note(const std::pair<std::string, std::string>& left_out,
                          const std::string& cause = "--set does not fit it");

/// Loads every case of a YAML file (sweeps expanded). `overrides` are
/// "path=value" strings from `--set`, applied on top of each case. Throws
/// Error(bad_input) with one line "file:line:column: what is wrong; what would
/// be valid" for every malformed input: YAML syntax, a second document,
/// complex or duplicate keys (also a dotted key against its nested form),
/// unknown keys, out-of-range values, unclosed quotes, control bytes,
/// oversized files and sweeps.
/// With `notes`, a case that the overrides do not fit is left out and named
/// there (the file is refused only when they fit none of its cases), and so
/// is each key without effect.
std::vector<Case> load_cases(const std::string& path, const std::vector<std::string>& overrides,
                             LoadNotes* notes = nullptr);
/// The same for the text of a case file (a golden manifest's case); `path`
/// names it in messages.
std::vector<Case> load_cases_text(const std::string& text, const std::string& path,
                                  const std::vector<std::string>& overrides, LoadNotes* notes = nullptr);

/// A user-supplied value made safe to echo in a one-line message: control
/// bytes and bytes that are not well-formed UTF-8 of a printable character
/// are written as \xNN (a NUL cannot cut the line,
/// a newline cannot split it), and more than `max_chars` characters are cut
/// with "..." (a 1 MiB value is not echoed whole).
std::string printable(const std::string& s, size_t max_chars = 80);

/// The member of `valid` nearest to `name` by edit distance (the first in
/// order on a tie; empty when `valid` is), for a "did you mean" in an error.
std::string nearest_name(const std::string& name, const std::set<std::string>& valid);

/// " (did you mean X?)" where X in `valid` is a near miss of `name` (a typo,
/// not another word: edit distance 1 for names under 5 characters, else at
/// most 2, and under half the name's length); "" otherwise.
std::string did_you_mean(const std::string& name, const std::set<std::string>& valid);

/// Every settable key with its type and valid values, for `moeverify validate --keys`
/// and the README.
std::vector<std::pair<std::string, std::string>> case_keys();

}  // namespace moev
