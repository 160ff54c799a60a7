// The registry of path descriptors (docs/architecture.md idea 4). A pipeline is
// an ordered list of slots (router_logits, routing, dispatch, ...); each slot
// has registered variants, each with its reference function, fast function,
// inputs, outputs with their comparison class, and when it applies. For every
// case the runner runs every applicable variant of a slot against the
// reference fed the same inputs (stage isolation), and feeds the primary
// variant's outputs to the next slot. It never branches on a variant's name.
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "case.h"
#include "stage.h"  // core/: Board, Stage, OutputSpec, FastCtx, RefCtx, Check, ...

namespace moev {

/// Promises (OutputSpec::promised) of the registered outputs.
bool promise_always(const Case& c, const RankBoard& b);
bool promise_realistic(const Case& c, const RankBoard& b);
bool promise_combined(const Case& c, const RankBoard& b);
/// Expert outputs: promised when the rank holds real (non-padding) rows that
/// are not all zero.
bool promise_expert_rows(const Case& c, const RankBoard& b);

/// The error scale of the combined output `out` of each rank, from the
/// reference chain's board of the ranks (their dispatch, scores, weights and
/// combine init): what the end-to-end and EP-invariance checks scale by.
/// The SwiGLU rows of every rank are scaled expert by expert across the
/// ranks (each expert's weights read once); `threads` threads take blocks
/// of rows and tokens (the result does not depend on it).
std::vector<Tensor> combined_magnitudes(const Case& c, const std::vector<RankBoard>& chain, int threads);
/// The slot after which every input of combined_magnitude is on the chain
/// board: the runner computes the end-to-end error scale there.
const std::string& magnitude_slot(const Case& c);
/// FP8 dispatch (docs/contract.md §16). The first slot where an FP8 case
/// departs from the same case under act dispatch: the runner's act chain
/// (the end-to-end check against unquantised rows) starts there.
const std::string& fp8_first_slot();
/// The rows `rows`_q / `rows`_scale of a board dequantised as the experts take
/// them (round_act(float(q) * s)), by the reference.
Tensor fp8_rows_dequantised(const Case& c, const RankBoard& b, const std::string& rows);
/// The FP8 term of the end-to-end bound of one rank's combined output (T, D):
/// the largest change of out that quantising the rows can cause, computed by
/// the reference from the act chain's board after its dispatch (x, routed
/// rows, counts, scores, weights), docs/contract.md §16 "End to end".
Tensor fp8_error_bound(const Case& c, const RankBoard& act_chain);
/// Capacity (docs/contract.md §11) on one rank's dispatch `in`, keeping the
/// assignments that `kept` (a capacity stage's token_sorted and counts) kept
/// rather than deciding anew: the act chain of an FP8 case follows the FP8
/// chain where that chain took the fast path's kept rows at a near-tie
/// (docs/contract.md §16 "With capacity"). Writes the stage's outputs to `out`.
void capacity_with_kept(const Case& c, const RankBoard& in, const RankBoard& kept, RankBoard& out);

/// Tensors the pipeline hands to the checks after it (end to end, EP and SP
/// invariance): the streaming runner never drops them.
const std::set<std::string>& pipeline_results();

/// An output the runner checks end to end besides `out` (the fast pipeline's
/// against the reference chain's): the backward's gradients. `scale` names
/// the chain tensor holding its error scale ("" for none).
std::vector<EndToEndOutput> backward_end_to_end(const Case& c);

/// Why the gradients a case asks for (backward: on) cannot be checked, or ""
/// when they can: such a case is NOT_SUPPORTED as a whole.
std::string backward_unsupported(const Case& c);

/// Whether variant `s` runs on a device (its backends list cuda).
bool has_device_form(const Stage& s);

/// A fixed input list for Stage::inputs.
std::function<std::vector<std::string>(const Case&)> fixed_inputs(std::vector<std::string> names);

const std::vector<std::string>& slot_order();
const std::vector<Stage>& registry();

/// Name of element i of tensor `name` in MoE coordinates, using the board of
/// the rank for dispatch rows.
CoordFn coords_for(Coords kind, const Tensor& t, const RankBoard& board, int rank, int ranks);

}  // namespace moev
