// The default memory limit (issue 21 item 2): what the process can actually
// get, not physical memory alone. The cgroup's limit and physical memory are
// the node's, shared by the MPI ranks on it; RLIMIT_AS caps each process.
// The command-line side (a refusal naming the bound) is tests/out_of_memory.sh.
#include <catch2/catch.hpp>

#include <sys/resource.h>

#include <cstdlib>
#include <string>

#include "memory_estimate.h"

using namespace moev;

namespace {
constexpr uint64_t GiB = uint64_t(1) << 30;
}

TEST_CASE("the default memory limit is 80% of the tightest bound, the node's shared among its ranks",
          "[cpu][memory_limit]") {
  std::string origin;
  MemorySources s;
  s.physical = 10 * GiB;
  CHECK(memory_limit_from(s, &origin) == 8 * GiB);
  CHECK(origin == "the default: 80% of physical memory 10.0 GiB");

  s.cgroup = 5 * GiB;  // a container's limit below the machine's memory
  CHECK(memory_limit_from(s, &origin) == 4 * GiB);
  CHECK(origin == "the default: 80% of the cgroup limit 5.0 GiB");
  s.cgroup = 20 * GiB;  // above physical memory: physical memory bounds
  CHECK(memory_limit_from(s, &origin) == 8 * GiB);
  CHECK(origin.find("physical memory") != std::string::npos);

  s.cgroup = 5 * GiB;
  s.local_ranks = 4;  // four ranks of the job on this node share it
  CHECK(memory_limit_from(s, &origin) == GiB);
  CHECK(origin == "the default: 80% of the cgroup limit 5.0 GiB, shared by 4 ranks on this node");

  s.address_space = 5 * GiB / 2;  // per process, never divided: 2 GiB > 1 GiB, the share bounds
  CHECK(memory_limit_from(s, &origin) == GiB);
  s.address_space = GiB;  // 0.8 GiB < 1 GiB: ulimit -v bounds
  CHECK(memory_limit_from(s, &origin) == uint64_t(0.8 * double(GiB)));
  CHECK(origin == "the default: 80% of the address-space limit (ulimit -v) 1.0 GiB");
}

TEST_CASE("memory_sources reads RLIMIT_AS and the ranks on this node", "[cpu][memory_limit]") {
  const MemorySources base = memory_sources();
  CHECK(base.physical > (uint64_t(64) << 20));
  CHECK(default_memory_limit() > 0);

  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_AS, &old) == 0);
  rlimit lower = old;
  lower.rlim_cur = 1024 * GiB;  // far above this process's use; restored below
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer reserves tens of TiB of address space for its shadow
  // memory: under a 1 TiB limit its own next mapping fails and it aborts.
  WARN("RLIMIT_AS part skipped: AddressSanitizer build (the normal build runs it)");
  const bool can_lower = false;
#else
  const bool can_lower = old.rlim_max == RLIM_INFINITY || old.rlim_max >= lower.rlim_cur;
#endif
  if (can_lower) {
    REQUIRE(setrlimit(RLIMIT_AS, &lower) == 0);
    const MemorySources s = memory_sources();
    setrlimit(RLIMIT_AS, &old);
    CHECK(s.address_space == 1024 * GiB);
  }

  const char* had = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const std::string saved = had ? had : "";
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  const MemorySources s = memory_sources();
  if (had) setenv("OMPI_COMM_WORLD_LOCAL_SIZE", saved.c_str(), 1);
  else unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  CHECK(s.local_ranks == 3);
  std::string origin;
  CHECK(memory_limit_from(s, &origin) <= memory_limit_from(base) / 3 + 1);
  CHECK(origin.find("shared by 3 ranks on this node") != std::string::npos);
}
