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
/// act, bias (E) fp32, w1/w3 (E, F, D), w2 (E, D, F), shared_w1/w3 (1, F, D),
/// shared_w2 (1, D, F) act.
/// `globals`, when given, holds make_global_inputs(c): its tensors are put on
/// the board as they are (sharing their storage), not generated again.
std::map<std::string, Tensor> make_inputs(const Case& c, int rank, int64_t tokens,
                                          const std::map<std::string, Tensor>* globals = nullptr);

/// The inputs every rank holds alike (wg, bias, w1/w3/w2, shared_w1/w3/w2):
/// pure functions of the seed, generated on `threads` threads with the same
/// values for any number of them. An EP run generates them once and every
/// rank's board shares them (docs/architecture.md "Scale and backends").
std::map<std::string, Tensor> make_global_inputs(const Case& c, int threads = 1);

}  // namespace moev
