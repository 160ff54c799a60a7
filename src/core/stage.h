// The board and stage descriptor types (docs/architecture.md idea 4): what the registry
// (paths/), the runner (engine/), the reports (report/) and the commands
// (cli/) share. A stage variant is a Stage: its inputs, its outputs with their
// comparison class, its fast function (FastCtx, one rank) and its reference
// (RefCtx, every rank); a Check is one comparison's report line. The
// functions that fill these in, and FastCtx's buffer and exchange helpers
// (which need the device and the communicator), are in paths/registry.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend.h"
#include "diff.h"
#include "exec.h"
#include "tensor.h"

namespace moev {

struct Case;
class Comm;

using RankBoard = std::map<std::string, Tensor>;

/// Named tensors of every rank (index = EP rank).
struct Board {
  std::vector<RankBoard> ranks;
  const Tensor& at(const std::string& name, int rank) const;
  bool has(const std::string& name, int rank = 0) const;
};

/// How a mismatch index is named in a report.
enum class Coords {
  flat,          // [i]
  token_col,     // (token, col) of a (T, D) tensor
  token_expert,  // (token, expert) of a (T, E) tensor
  token_k,       // (token, k) of a (T, K) tensor
  expert,        // (expert) of an (E) vector
  expert_col,    // (expert, col) of an (E, D) weight gradient
  dispatch_row,  // (expert, slot, token, col) of a rank's expert-sorted rows; needs counts, token_sorted
  rank_major_row,  // (source rank, expert, slot, col) of received rows; needs recv_counts
  expert_row,    // (expert, slot, col) of expert-major rows; needs expert_counts_real
  padded_row,    // (expert, slot, col) of padded expert groups; needs expert_counts
};

/// Data promises: data movement of x is never all zero (x has no zero in
/// either data mode; tail SP pad rows are the exception, see promise_always);
/// GEMM outputs are promised only for realistic data, since
/// exact-mode integer weights may cancel on tiny shapes.
using Promise = std::function<bool(const Case&, const RankBoard&)>;

/// The error scale of an output (docs/contract.md §15): per element, the sum of the
/// absolute values of the terms behind it, computed by the reference from the
/// stage's inputs on one rank; an f32 tensor with the output's element count.
using Magnitude = std::function<Tensor(const Case&, const RankBoard& inputs, int rank, int ranks)>;

struct OutputSpec {
  OutputSpec(std::string n, CompareClass c, Coords co, Promise p, Magnitude m = {})
      : name(std::move(n)), cls(c), coords(co), promised(std::move(p)), magnitude(std::move(m)) {}
  std::string name;
  CompareClass cls = CompareClass::exact;
  Coords coords = Coords::flat;
  /// Whether the case promises non-zero data here: then two all-zero tensors
  /// with elements are NOT_VERIFIED, not PASSED. Empty: no promise.
  Promise promised;
  /// Tolerance classes: the bound is atol + rtol * max(|ref|, magnitude).
  /// Empty: atol + rtol * |ref|.
  Magnitude magnitude;
  /// When set, `check` (docs/contract.md §15) takes the error scale from
  /// this instead, told whether the implementation wrote the board's
  /// `own_input` itself: where it did not, the board holds the reference's
  /// value in its place, and the scale also allows what the
  /// implementation's own may differ by (router_bwd's scores).
  std::string own_input;
  std::function<Tensor(const Case&, const RankBoard&, int rank, int ranks, bool own)> magnitude_own;
  /// When set, this output is checked against what the reference derives
  /// from the variant's own other outputs (the SwiGLU activation from the
  /// fast GEMM outputs), not against the reference stage; it writes the
  /// per-element error scale. Such outputs are not compared across variants.
  /// `own_inputs` false: the board holds the reference's values of those
  /// outputs (`check` of an implementation that wrote the derived output but
  /// not what it derives from), and the scale then also allows what a
  /// correct implementation's own values of them may differ by.
  std::function<Tensor(const Case&, const RankBoard& fast_merged, int rank, int ranks, bool own_inputs, Tensor& scale)>
      from_fast;
  std::string from_fast_label;
  /// When set, `check` (docs/contract.md §15) judges this output a second
  /// time where the implementation wrote `on_own_input` too: against what
  /// the reference computes from that input of its own (class rounding, the
  /// half-width written into `scale`; "judged on its X"), so that a rounding
  /// point between the two, which the tolerance against the reference
  /// hides, fails. An empty tensor: nothing to judge (the input has too
  /// few rows, which its own check reports).
  std::string on_own_input;
  std::function<Tensor(const Case&, const RankBoard& merged, int rank, int ranks, Tensor& scale)> on_own;
  /// When set, the class of this output in a case, in place of `cls`: set
  /// only for a sum judged over any order of its additions
  /// (judged_in_any_order, src/paths/stages.h), whose bound the report names.
  std::function<CompareClass(const Case&)> cls_for;
  CompareClass class_in(const Case& c) const { return cls_for ? cls_for(c) : cls; }
};

/// How FastCtx::output provides a buffer. `fresh`: newly allocated and
/// poisoned on every call (the runner: no vacuous pass). `reuse`: an output
/// already on the board under that name, type and shape is handed back as
/// it is, neither reallocated nor poisoned; `moeverify bench` times repeated
/// calls this way, so that it measures the fast path, not the allocator.
enum class OutputBuffers : uint8_t { fresh, reuse };

/// What a fast function sees for one rank.
struct FastCtx {
  const Case& c;
  int rank = 0, ranks = 1;
  ExecCtx exec;
  Comm* comm = nullptr;
  const RankBoard& in;
  RankBoard& out;
  std::vector<std::string>& notes;  // shown under the stage in the report
  std::string* skipped = nullptr;   // set by skip()
  OutputBuffers buffers = OutputBuffers::fresh;

  const Tensor& input(const std::string& name) const;
  /// A poisoned (0xFF) output registered under `name` (see OutputBuffers).
  Tensor& output(const std::string& name, ElemType t, std::vector<int64_t> shape);
  /// The variant does not apply to this data (a precondition on received
  /// counts, say); every rank must agree. It is reported as not taken.
  void skip(const std::string& reason) { *skipped = reason; }
  /// The token all-to-all-v of rows (in: send_rows[q] rows to rank q; out:
  /// recv_rows[p] rows from rank p, every row of `out`). On a device backend
  /// whose Communicator moves device buffers, the device copies go and the
  /// result is written back (write-through); otherwise it moves host rows.
  void exchange_rows(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                     const std::vector<int64_t>& recv_rows, const char* what);
};

/// What a reference function sees: every rank's inputs (global view).
struct RefCtx {
  const Case& c;
  const Board& in;
  Board& out;
  /// >= 0: only this rank's outputs are wanted (Stage::ref_per_rank); -1: every rank's.
  int rank = -1;
  /// Threads a reference may use over independent ranks (RunOptions::threads).
  int threads = 1;
  /// When set, a reference that derives an output's error scale from the
  /// GEMMs it runs anyway (the magnitude of a gemm output, the half-width of
  /// a rounding one) writes it here under the output's name, rank by rank;
  /// the runner then uses it in place of OutputSpec::magnitude. Null (the
  /// reference chain, `moeverify check`): values only.
  Board* scales = nullptr;
  bool wants(int q) const { return rank < 0 || rank == q; }
  bool wants_scales() const { return scales != nullptr; }
};

struct Decision {
  bool applies = true;
  std::string reason;  // why it does not apply (or why it was chosen)
};

/// How a check in the logits, gemm and end_to_end classes opens the clause
/// of its note that states its bound and the largest share of it used (up
/// to the next "; "); the summary report, which gives the case's largest
/// share, leaves that clause out.
inline constexpr const char* kScaledBoundNote = "bound atol + rtol * max(|ref|, sum of |terms|)";
/// The same for the `rounding` class: the element's own rounding half-width.
inline constexpr const char* kRoundingBoundNote = "bound atol + rtol * the element's rounding half-width";
/// ... and of an output whose additions may come in any order (combine.order: any).
inline constexpr const char* kAnyOrderBoundNote =
    "bound: the half-width any order of a token's additions can reach (combine.order: any, docs/contract.md §2)";

/// How check's routing ids note opens: how the ids were judged. Alone (no
/// tie, near-tie or strict rule after it), the summary report leaves it out.
inline constexpr const char* kSelectionNote = "ids judged as a selection per token on the ";

/// A check's tensor "name@rank" split into its name and rank; -1 where it
/// names no rank (a rank has at most 6 digits).
inline std::pair<std::string, int> split_tensor_rank(const std::string& tensor) {
  const size_t at = tensor.rfind('@');
  const bool ranked = at != std::string::npos && at + 1 < tensor.size() && tensor.size() - at <= 7 &&
                      tensor.find_first_not_of("0123456789", at + 1) == std::string::npos;
  if (!ranked) return {tensor, -1};
  return {tensor.substr(0, at), std::stoi(tensor.substr(at + 1))};
}

/// A report line about one comparison.
struct Check {
  std::string slot, variant, tensor, against = "reference";
  CompareClass cls = CompareClass::exact;
  Tolerance tol;
  Outcome outcome = Outcome::PASSED;
  DiffResult diff;
  std::string note;
  /// Set when an outside implementation's tensor has another number of rows
  /// than the reference's (docs/contract.md §15: rows are part of the verdict): the row
  /// counts, and per segment of the counts tensor that groups the rows
  /// (`segments_of`, e.g. "counts" per expert) the reference's and, where the
  /// implementation wrote that counts tensor, its own.
  struct Rows {
    int64_t expected = -1, actual = -1;
    std::string segments_of;
    std::vector<int64_t> expected_segments, actual_segments;
  } rows;
  /// check only: the earlier stage whose wrong rows this failure follows
  /// from (the same row count off on the same rank); "" for a first cause.
  std::string consequence_of;
  /// check only: INCORRECT because the tensor was not written (on some rank).
  bool absent = false;
};

struct CheckCtx {
  const Case& c;
  const Board& fast;   // this variant's outputs merged over its inputs
  const Board& ref;    // the reference outputs on the same inputs
  std::vector<Check>& checks;
  /// Set by a custom check when the reference chain must adopt the fast
  /// outputs of this slot (routing near-ties), with the reason.
  std::string adopt_fast_reason;
};

struct Stage {
  std::string slot, variant, summary;
  std::function<Decision(const Case&)> applies;
  /// Optional: whether the variant appears in a case's report at all. A
  /// variant of a mode a case does not use (the FP8 twins under act dispatch,
  /// docs/contract.md §16) is left out, so that the reports of the cases
  /// before the mode existed stay as they were. Empty: always listed.
  std::function<bool(const Case&)> listed;
  std::function<bool(const Case&)> primary;  // feeds the next slot
  /// Optional: whether the case names this variant itself (permute:
  /// equal_count, experts.impl: batched), not as a default it may fall back
  /// from. Such a variant that skips at run time (its precondition unmet on
  /// this data) is said in a case note, a passing summary included.
  std::function<bool(const Case&)> asked;
  /// Board tensors read; they must be unchanged after the fast function.
  std::function<std::vector<std::string>(const Case&)> inputs;
  std::vector<OutputSpec> outputs;
  std::function<void(FastCtx&)> fast;
  std::function<void(RefCtx&)> ref;
  /// The reference computes one rank's outputs when RefCtx::rank says so:
  /// the runner then runs it rank by rank and keeps one rank's reference rows
  /// at a time (a row stage's reference is as large as its output).
  bool ref_per_rank = false;
  /// Optional: replaces the per-output comparison (used by routing).
  std::function<void(CheckCtx&)> check;
  /// Optional: given one rank's reference chain outputs of this stage and the
  /// fast outputs (checked against the reference on the same inputs), a
  /// reason for the chain to continue from the fast outputs instead, or "".
  /// For decisions that a near-tie of tolerance-class inputs may flip
  /// (capacity's kept rows under scores that differ in the last bits).
  std::function<std::string(const Case&, const RankBoard& chain, const RankBoard& fast)> chain_adopt;
  /// The backends whose executor implements `fast` (`moeverify list`). A case
  /// on another backend whose primary pipeline needs this variant is
  /// NOT_SUPPORTED; where it is not primary it is reported not taken.
  std::vector<Backend> backends = {Backend::host};
};

struct EndToEndOutput {
  OutputSpec spec;
  std::string scale;
};

}  // namespace moev
