// Internal to the stage registry: helpers shared by the stage variant files.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "../kernels/ep_host.h"
#include "../reference/reference.h"
#include "registry.h"

namespace moev {

/// A token's scatter-add sum `o` (the combine's out, dispatch_bwd's grad_x):
/// bitwise under combine.order ascending, in the rounding class under `any`
/// (docs/contract.md §2), its magnitude function then giving the any-order
/// half-width. The only setter of OutputSpec::cls_for.
void judged_in_any_order(OutputSpec& o);

ref::Act ref_act(DType d);
/// Experts [first, ...) of an (E, ...) weight tensor as the reference reads
/// them: in place, in the tensor's own type, decoded one expert at a time.
ref::WeightView weight_view(const Tensor& w, int64_t first);
ref::Ids ref_ids(const Tensor& t);
ref::Counts ref_counts(const Tensor& t);
Tensor ids_tensor(const ref::Ids& v, ElemType t, std::vector<int64_t> shape);
/// A (rows, D) activation tensor as the reference reads it: its bytes, in place.
ref::RowsRef rows_of(const Tensor& t);
/// The reference's rows as a (rows, cols) tensor of type t, taking over the
/// bytes (no copy).
Tensor rows_tensor(ref::Bytes&& b, ElemType t, int64_t cols);
RouterConfig router_config(const Case& c);
/// The reference router's spec for the case (docs/contract.md §1).
ref::RouterSpec ref_router_spec(const Case& c);
/// The type the router's scores are held in (router.score_dtype, docs/contract.md §14).
k::ScoreHeld score_held(const Case& c);
/// The reference's SP padding mode of the case (docs/contract.md §10).
ref::SpPadding ref_padding(const Case& c);
/// Initial value of the combine's scatter target for this rank (docs/contract.md §2, §9).
std::vector<float> combine_init(const Case& c, const RankBoard& in);
/// Whether that target is all zeros (a fresh buffer, no shared output to
/// start from): the out-of-place combine then reads no target rows.
bool combine_starts_at_zeros(const Case& c);
/// The same initial value as the board tensor that holds it (x's type and
/// shape: x, a view of x's storage at the alias offset, or shared_out), which
/// the fast combines read in place of a copy; no storage when it is all zeros.
Tensor combine_init_tensor(const Case& c, const RankBoard& in);

/// c when every entry equals the same c > 0, else 0 (the equal-count
/// precondition of docs/contract.md §7 and of the batched experts, §8).
int64_t uniform_count(const std::vector<int64_t>& v);

/// dst[i] = src[map[i]] (zero row where map[i] < 0) for the rows of a board
/// tensor of any row type: activation rows, e4m3 rows, fp32 block-scale rows
/// (docs/contract.md §16), each of its own width (shape[1]).
void move_rows(const ExecCtx& ex, const Tensor& src, const int64_t* map, int64_t n, Tensor& dst);
/// The equal-count transpose (docs/contract.md §7) of all of src's rows.
void move_rows_equal_count(const ExecCtx& ex, const Tensor& src, EqualCountMap m, Tensor& dst);

/// Routing comparison with near-tie handling (docs/contract.md §1, last paragraph).
void check_routing(CheckCtx& ctx);

/// The backends of a variant whose fast function runs every body and
/// primitive through the entry points of kernels/ (so on the device of a
/// mirror) and writes each output on one side only (kernels/device.h).
inline const std::vector<Backend> kHostAndDevice = {Backend::host, Backend::cuda};

/// A primary stage variant with fixed inputs that applies where `applies` says.
Stage make_stage(const std::string& slot, const std::string& variant, const std::string& summary,
                 std::function<Decision(const Case&)> applies, std::vector<std::string> inputs,
                 std::vector<OutputSpec> outputs, std::function<void(FastCtx&)> fast, std::function<void(RefCtx&)> ref);

/// score_on_hidden (docs/contract.md §14): the score of each routed expert
/// row, which is its dispatch row (ep 1, align 1: case_validate.cpp), or with
/// a capacity the capacity stage's row (its score_sorted, 0 for a filler),
/// rounded to act first under score_multiply act; the forward's and the
/// backward's experts read the same.
ref::Vec routed_row_scores(const Case& c, const RankBoard& b);

void register_local_stages(std::vector<Stage>& reg);
void register_ep_stages(std::vector<Stage>& reg);
void register_sp_stages(std::vector<Stage>& reg);  // docs/contract.md §10
void register_capacity_stages(std::vector<Stage>& reg);  // docs/contract.md §11
/// The capacity reference of one rank: `in` holds the dispatch outputs
/// (routed_input, token_sorted, score_sorted, row_of, counts), `out` gets
/// their capacity-limited versions under the same names. `keep` (one flag per
/// dispatch row) overrides which rows are kept (see ref::capacity_dispatch).
void capacity_reference(const Case& c, const RankBoard& in, RankBoard& out, const std::vector<uint8_t>* keep = nullptr);
/// The capacity groups of one rank's dispatch (docs/contract.md §11): one
/// group at sp = 1; with sp > 1 one per SP rank, tail pad rows in none.
ref::CapacityGroups capacity_groups_of(const Case& c, const RankBoard& in);
void register_backward_stages(std::vector<Stage>& reg);  // docs/contract.md §13
void register_fp8_stages(std::vector<Stage>& reg);       // docs/contract.md §16

}  // namespace moev
