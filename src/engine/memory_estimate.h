// Peak-memory estimate of a case, checked when the case files are loaded and
// before anything is allocated (docs/architecture.md "Scale and backends"): a case that
// would not fit is refused with the estimate and the limit (exit 2), never
// killed by the OS or ended by bad_alloc halfway through.
#pragma once

#include <cstdint>
#include <string>

#include "case.h"

namespace moev {

/// A conservative upper bound, in bytes, of the memory run_case(c) holds at
/// its peak in one process (all EP ranks, as the in-process communicator
/// runs them) with `threads` host executor threads. The formula is in
/// memory_estimate.cpp; it is a double because a refused case may ask for
/// far more than 2^64 bytes.
double estimate_case_bytes(const Case& c, int threads);

/// What bounds this process's memory: physical memory, its cgroup's limit
/// (v2 memory.max, v1 memory.limit_in_bytes; 0: none), RLIMIT_AS (0:
/// unlimited), and the processes of this MPI job on this node
/// (OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS; 1 outside mpirun).
struct MemorySources {
  uint64_t physical = 0, cgroup = 0, address_space = 0;
  int local_ranks = 1;
};
MemorySources memory_sources();

/// The default limit from `s`: 80% of the smaller of physical memory and
/// the cgroup's limit, which the node's ranks share (divided among them),
/// and at most 80% of RLIMIT_AS, which caps each process alone. `origin`,
/// when given, gets which of them bounds it, for the refusal message.
uint64_t memory_limit_from(const MemorySources& s, std::string* origin = nullptr);

/// The limit used without --max-memory: memory_limit_from(memory_sources()).
uint64_t default_memory_limit();
/// Its origin, e.g. "the default: 80% of the cgroup limit 4.0 GiB, shared by
/// 2 ranks on this node".
std::string default_memory_limit_origin();

/// A memory limit and where it came from, for the refusal message.
struct MemoryLimit {
  uint64_t bytes = 0;
  std::string origin;
};
/// The limit that cases read by export and check (and fuzz --impl's
/// exports) are held to: the default until main sets the command's
/// --max-memory.
void set_command_memory_limit(const MemoryLimit& limit);
MemoryLimit command_memory_limit();

/// Parses a --max-memory value: a positive number with an optional unit,
/// B, K, M, G or T, each optionally followed by "iB" or "B" (512M, 8G,
/// 1.5GiB, 4096); units are powers of 1024, case-insensitive. Throws
/// Error(bad_input) naming `flag` for anything else.
uint64_t parse_memory_size(const std::string& text, const std::string& flag);

/// "12.3 MiB", "4.0 TiB": one decimal, the largest unit below the value.
std::string format_bytes(double bytes);

/// Throws Error(bad_input) when the estimate of `c` exceeds `limit_bytes`;
/// the message names the case and its location, the estimate and the limit
/// (`limit_origin` says where the limit came from).
/// `extra_bytes`: what the command holds beside the run (`check`: the
/// golden folder's tensors, read whole).
void check_case_memory(const Case& c, int threads, uint64_t limit_bytes, const std::string& limit_origin,
                       double extra_bytes = 0);
inline void check_case_memory(const Case& c, int threads, const MemoryLimit& limit, double extra_bytes = 0) {
  check_case_memory(c, threads, limit.bytes, limit.origin, extra_bytes);
}

/// Per-case measurement of the resident peak: reset_peak_rss() resets the
/// kernel's high-water mark (Linux >= 4.0, /proc/self/clear_refs); it
/// returns false where that is not possible, and peak_rss_bytes() is then the
/// peak of the whole process so far (getrusage ru_maxrss).
bool reset_peak_rss();
uint64_t peak_rss_bytes();

/// The report line of a case: "memory: estimated X MiB, measured peak Y MiB".
std::string memory_line(double estimated_bytes, uint64_t measured_bytes);

}  // namespace moev
