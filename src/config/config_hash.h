// A 64-bit fingerprint of a resolved case: under mpirun every rank must run
// the same configuration, and the ranks compare this hash before each case
// (comm.h mpi_agree_on_case) instead of failing later in confusing ways (an
// INCORRECT from a different seed, an MPI error from a different hidden size).
#pragma once

#include <cstdint>

#include "case.h"

namespace moev {

/// FNV-1a (64-bit) over every field of `c` that affects results: name, shape,
/// dtype, seed, data mode, router, experts, shared experts, combine (alias
/// offset included), tolerance overrides, EP settings (tokens_per_rank,
/// uniform token draw, align, empty groups, permute), equal-split policy and
/// threshold, plus summary(). Not the source location: the same case read
/// from copies of a file at different paths is the same case.
uint64_t config_hash(const Case& c);
/// config_hash(c) combined with the planted faults of the run.
uint64_t config_hash(const Case& c, const FaultSet& faults);

}  // namespace moev
