// Exact-by-construction inputs (docs/architecture.md idea 6): every value is a pure
// function of (seed, tensor stream, rank, row, column), so any rank can
// rebuild any slice without communicating.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "case.h"
#include "tensor.h"

namespace moev {

/// Counter-based hash -> uniform in [0, 1).
double hash_uniform(uint64_t seed, uint64_t stream, uint64_t rank, uint64_t row, uint64_t col);

/// The generated inputs of one rank: x (T, D) act [with combine.buffer
/// alias_x_offset its storage has combine.alias_offset extra elements after
/// it, filled with data], wg (E, D)
/// act, bias (E) fp32, w1/w3 (E, F, D), w2 (E, D, F) (not with experts.weights
/// streamed), shared_w1/w3 (1, F, D),
/// shared_w2 (1, D, F) act.
/// `globals`, when given, holds make_global_inputs(c): its tensors are put on
/// the board as they are (sharing their storage), not generated again.
std::map<std::string, Tensor> make_inputs(const Case& c, int rank, int64_t tokens,
                                          const std::map<std::string, Tensor>* globals = nullptr);

/// Routed experts [e0, e0 + n) of w1, w3 (n, F, D) and w2 (n, D, F), act:
/// the values of those experts in the whole tensors. With experts.weights
/// streamed these are the only weights there are: each stage that reads
/// them generates the few experts it works on (paths/ for_weight_chunks).
struct ExpertWeightSlice {
  Tensor w1, w3, w2;
};
/// `reuse`: a previous slice whose storage nothing else shares is written
/// over where the sizes agree (it is left empty).
ExpertWeightSlice make_expert_weights(const Case& c, int64_t e0, int64_t n, int threads = 1,
                                      ExpertWeightSlice* reuse = nullptr);
/// Experts per generated chunk when a stage streams n experts' weights:
/// about 512 MiB of them (four DeepSeek-V3 experts in bf16; an even count
/// past two), and at most a
/// third of the n, so that a small streamed case crosses chunk boundaries
/// too (its rows are then found at the offsets a large one uses).
int64_t streamed_chunk_experts(const Case& c, int64_t n);

/// The inputs every rank holds alike (wg, bias, w1/w3/w2, shared_w1/w3/w2):
/// pure functions of the seed, generated on `threads` threads with the same
/// values for any number of them. An EP run generates them once and every
/// rank's board shares them (docs/architecture.md "Scale and backends").
std::map<std::string, Tensor> make_global_inputs(const Case& c, int threads = 1);

}  // namespace moev
