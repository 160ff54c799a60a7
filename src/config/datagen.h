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
std::map<std::string, Tensor> make_inputs(const Case& c, int rank, int64_t tokens);

}  // namespace moev
