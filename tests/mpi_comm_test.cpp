// The MPI communicator's argument agreement, under `mpirun -np 2` (ctest
// mpi.np2.comm_split_mismatch): rank 0 sends 1 row to rank 1, which expects
// 2. The MPI communicator must refuse the call on both ranks before any row
// moves, naming the disagreement as the in-process communicator does
// (tests/test_ep.cpp, "inconsistent all-to-all splits ..."), and stay usable
// for the next, consistent call. Prints one line per rank; exit 0 when both
// behaved.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "comm.h"

int main(int argc, char** argv) {
  using namespace moev;
  Comm& comm = mpi_world();
  if (comm.size() != 2) {
    std::fprintf(stderr, "mpi_comm_test: run under mpirun -np 2 (this job has %d ranks)\n", comm.size());
    return 2;
  }
  const int r = comm.rank();
  if (argc > 1 && std::string(argv[1]) == "long-names") {
    // ctest mpi.np2.long_names: two collectives whose names agree in their
    // first 60 characters are still told apart (the job aborts naming both).
    const std::string name = std::string(60, 'x') + (r == 0 ? " (dispatch)" : " (combine)");
    int64_t v = 1;
    comm.allreduce_max(&v, 1, name.c_str());
    std::printf("FAIL rank %d: collectives of different names ran as one\n", r);
    mpi_finalize_if_started();
    return 1;
  }
  std::vector<float> send(4, 1.f), recv(8, 0.f);
  const std::vector<int64_t> s = {1, 1};
  const std::vector<int64_t> rr = r == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{2, 1};
  std::string err;
  try {
    comm.alltoallv(send.data(), 4, s, recv.data(), 8, rr, 4 * sizeof(float), "test a2a");
  } catch (const std::exception& e) {
    err = e.what();
  }
  const std::string want = r == 1 ? "split mismatch: rank 0 sends 1 rows to rank 1, which expects 2"
                                  : "collective test a2a on rank 0: not run on any rank: rank 1 failed the argument check";
  bool ok = err.find(want) != std::string::npos;
  for (float v : recv) ok = ok && v == 0.f;  // no row moved
  std::printf("%s rank %d: %s\n", ok ? "ok  " : "FAIL", r, err.empty() ? "(the mismatched call returned)" : err.c_str());
  // The next call, consistent, still runs.
  std::vector<float> back(2 * 4, -1.f);
  std::vector<float> mine(2 * 4, float(r + 1));
  std::string err2;
  try {
    comm.alltoallv(mine.data(), 2, {1, 1}, back.data(), 2, {1, 1}, 4 * sizeof(float), "test a2a, consistent");
  } catch (const std::exception& e) {
    err2 = e.what();
  }
  const bool ok2 = err2.empty() && back[0] == 1.f && back[4] == 2.f;
  std::printf("%s rank %d: a consistent call after it %s\n", ok2 ? "ok  " : "FAIL", r,
              err2.empty() ? (ok2 ? "moved the rows" : "moved wrong rows") : err2.c_str());
  std::fflush(stdout);
  mpi_finalize_if_started();
  return ok && ok2 ? 0 : 1;
}
