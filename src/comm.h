// The Communicator (DESIGN.md idea 3): rank code talks to peers only through
// this interface and never asks which implementation it runs on.
//   local: R ranks as threads of one process (default; tests and fuzzing)
//   mpi:   one process per rank under mpirun (host buffers)
// Every collective checks its arguments across ranks where it can (split
// consistency, CONTRACT §3 A2) and fails loudly instead of hanging; the local
// implementation times out with the rank and collective named.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moev {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// All-to-all-v of rows: send_rows[q] rows go to rank q (send buffer in
  /// destination order), recv_rows[p] rows arrive from rank p (receive buffer
  /// in source order). Throws when send_rows of p to q != recv_rows of q from p.
  virtual void alltoallv(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                         const std::vector<int64_t>& recv_rows, size_t row_bytes, const char* what) = 0;
  virtual void allreduce_max(int64_t* v, int n, const char* what) = 0;
  virtual void allreduce_sum(int64_t* v, int n, const char* what) = 0;
  /// Every rank contributes `bytes`; recv holds size() blocks in rank order.
  virtual void allgather(const void* send, size_t bytes, void* recv, const char* what) = 0;
  virtual void barrier(const char* what) = 0;
  /// Called when this rank's code failed outside a collective: peers blocked
  /// in (or entering) a collective fail with `why` instead of waiting.
  virtual void abort(const std::string& why) = 0;
};

/// R in-process ranks. make_local_comms(R)[r] is rank r's endpoint; each
/// must be used from its own thread. A collective that not every rank joins
/// within `timeout` throws on the ranks that did.
std::vector<std::unique_ptr<Comm>> make_local_comms(int R, std::chrono::milliseconds timeout);

/// Whether this process was started by mpirun with more than one rank.
bool launched_under_mpi();
/// The MPI world as a Comm (initialises MPI on first use). Throws when this
/// build has no MPI.
Comm& mpi_world();
void mpi_finalize_if_started();

}  // namespace moev
