// Inside the engine (not for the CLI): the pieces runner.cpp assembles into
// run_case. pipeline.cpp runs one layer entry's stages against the reference
// (run_pipeline); runner.cpp compares one output (make_check);
// invariance.cpp holds the properties that compare two fast runs
// (check_ep_invariance, check_sp_invariance); board_exchange.cpp moves the
// ranks' boards between MPI processes; each_rank spreads per-rank work.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "parallel_errors.h"
#include "runner.h"

namespace moev {

/// How many ranks each_rank runs at once on `threads` threads; each then
/// gets threads / that many for its own work.
inline int ranks_side_by_side(int threads, int R) { return std::max(1, std::min(threads, R)); }

/// fn(r) for r = 0..R-1 on up to `threads` threads (the ranks' reference,
/// comparison and hashing work of one stage, which is independent per rank),
/// taken in the order `order` when given. The first exception thrown is
/// rethrown here, after every rank is done.
template <class Fn>
void each_rank(int R, int threads, Fn fn, const std::vector<int>& order = {}) {
  ParallelErrors errors;
#pragma omp parallel for schedule(dynamic, 1) num_threads(ranks_side_by_side(threads, R)) if (threads > 1 && R > 1)
  for (int k = 0; k < R; ++k) {
    const int r = order.empty() ? k : order[size_t(k)];
    errors.run(r, [&] { fn(r); });
  }
  errors.rethrow();
}

/// One output of a stage variant (`f`) against its reference (`r`): the
/// class's tolerance (or `tol`), the error scale `scale` (or a `precomputed`
/// one), rows masked out by `mask`, the data promise and the MoE
/// coordinates of mismatches from the rank's board `fb`; hints on an
/// INCORRECT verdict (hints.h).
Check make_check(const Case& c, const std::string& slot, const std::string& variant, const OutputSpec& o,
                 const Tensor* f, const Tensor* r, const RankBoard& fb, int rank, int ranks, const std::string& against,
                 const Tensor* scale = nullptr, const Tensor* precomputed = nullptr, const Tolerance* tol = nullptr,
                 const std::vector<uint8_t>* mask = nullptr);

/// The pipeline of one layer entry on R ranks with the given inputs: every
/// slot's applicable variants against the reference, the primary feeding the
/// next slot, and the end-to-end reference chain. `fast` ends holding every
/// primary output, `chain_out` (when given) the chain's integer metadata.
/// Returns false when a stage had no variant to feed the next one (the case
/// is then ERROR and stops there). An allocation that fails is rethrown
/// named by the stage variant (or the phase) that asked for it.
bool run_pipeline(const Case& c, const RunOptions& opt, const std::vector<RankBoard>& inputs, bool use_mpi,
                  CaseReport& rep, Board& fast, Board* chain_out = nullptr);

/// EP invariance (docs/contract.md §3): each rank's output (and gradients)
/// equal an EP = 1 run on that rank's tokens (invariance.cpp).
void check_ep_invariance(const Case& c, const RunOptions& opt, const std::vector<RankBoard>& inputs,
                         const std::map<std::string, Tensor>& globals, const Board& fast, const Board& chain,
                         CaseReport& rep);

}  // namespace moev
