// The Communicator (docs/architecture.md idea 3): rank code talks to peers only through
// this interface and never asks which implementation it runs on.
//   local: R ranks as threads of one process (default; tests and fuzzing)
//   mpi:   one process per rank under mpirun (host buffers)
//   nccl:  one process and one GPU per rank under mpirun with --backend cuda
//          (token rows in device buffers; metadata over mpi)
// Every collective checks its arguments on every rank (split consistency,
// docs/contract.md §3 A2, and the splits against the real buffer sizes), and all
// ranks agree on the verdict before any data moves: either every rank copies
// or none does, and no rank leaves a collective while a peer may still read
// its buffers. A collective that does not complete in time fails with the
// rank and collective named: the local implementation throws, the MPI one
// prints and aborts the job (a stopped or dead process cannot be waited out).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace moev {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// All-to-all-v of rows of `row_bytes`: send_rows[q] rows go to rank q
  /// (send buffer in destination order), recv_rows[p] rows arrive from rank p
  /// (receive buffer in source order). The buffers hold send_capacity_rows and
  /// recv_capacity_rows rows. Throws on every rank, before any row moves, when
  /// on any rank a split list does not have one entry per rank, a split is
  /// negative, the splits overrun a buffer (sum(send_rows) > send capacity,
  /// sum(recv_rows) > recv capacity), send_rows of p to q != recv_rows of q
  /// from p, or the row sizes differ. The message names the collective, the
  /// rank at fault and the sizes.
  virtual void alltoallv(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows,
                         void* recv, int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows,
                         size_t row_bytes, const char* what) = 0;
  /// Whether alltoallv_device exists (the local Communicator made with a
  /// device copy, the NCCL one): the token rows then move device to device. Otherwise a
  /// device backend stages them through host memory. Every other collective,
  /// and alltoallv, takes host memory.
  virtual bool device_buffers() const { return false; }
  /// alltoallv with send and recv device addresses of the case's device:
  /// the same checks, the rows moved on the device. Only where
  /// device_buffers() (std::logic_error otherwise).
  virtual void alltoallv_device(const void* /*send*/, int64_t /*send_capacity_rows*/,
                                const std::vector<int64_t>& /*send_rows*/, void* /*recv*/,
                                int64_t /*recv_capacity_rows*/, const std::vector<int64_t>& /*recv_rows*/,
                                size_t /*row_bytes*/, const char* what) {
    throw std::logic_error(std::string(what) + ": this Communicator moves host buffers only");
  }
  virtual void allreduce_max(int64_t* v, int n, const char* what) = 0;
  virtual void allreduce_sum(int64_t* v, int n, const char* what) = 0;
  /// Every rank contributes `bytes`; recv holds size() blocks in rank order.
  virtual void allgather(const void* send, size_t bytes, void* recv, const char* what) = 0;
  virtual void barrier(const char* what) = 0;
  /// Called when this rank's code failed outside a collective: peers blocked
  /// in (or entering) a collective fail with `why` instead of waiting (local),
  /// or the failure is printed at once with the rank (MPI, where peers waiting
  /// for this rank reach their deadline).
  virtual void abort(const std::string& why) = 0;
  /// Called when this rank's code returned: it joins no further collective.
  /// Local: a peer waiting in a collective that every other rank has left
  /// fails at once, naming the collective and the ranks that left, instead
  /// of waiting out the timeout (ranks that disagree on which collectives
  /// run, e.g. on a branch decided per rank). MPI and NCCL: nothing (a peer
  /// left behind reaches its deadline).
  virtual void leave() {}
};

/// Copies `bytes` bytes from src to dst on one device (no overlap).
using DeviceCopy = std::function<void(void* dst, const void* src, size_t bytes)>;

/// R in-process ranks. make_local_comms(R)[r] is rank r's endpoint; each
/// must be used from its own thread. A collective that not every rank joins
/// within `timeout` throws on the ranks that did; so does one that every
/// other rank has left (leave()) without joining, at once, and a meeting of
/// ranks in collectives of different names (`what`: every rank passes the
/// same name to the same collective). With `device_copy`, the
/// ranks are threads on one device with alltoallv_device: each receiver
/// copies its rows from the senders' device buffers with it.
std::vector<std::unique_ptr<Comm>> make_local_comms(int R, std::chrono::milliseconds timeout,
                                                    DeviceCopy device_copy = {});

/// Communicator nccl (CUDA builds; src/comm/comm_nccl.cpp): this process's
/// rank of `host` (the MPI world) on CUDA device `device`. alltoallv_device
/// moves rows as grouped ncclSend/ncclRecv on the device, every peer posted,
/// zero-row ones too; allreduce and allgather are NCCL collectives staged
/// through device memory; alltoallv of host metadata goes through `host`,
/// which also broadcasts the unique id and agrees on each all-to-all's
/// arguments before any row moves. Each NCCL collective is polled against
/// `timeout` with ncclCommGetAsyncError; past it (or on an asynchronous
/// error) the rank and collective are printed, ncclCommAbort ends the
/// communicator and the process exits 3. Throws when NCCL (libnccl.so.2,
/// loaded on first use) cannot be loaded or initialised.
std::unique_ptr<Comm> make_nccl_comm(Comm& host, int device, std::chrono::milliseconds timeout);

/// The process's NCCL communicator over mpi_world() on CUDA device `device`,
/// made on the first call (later calls return it; the arguments must not
/// change). nccl_finalize_if_started() destroys it; call it before
/// mpi_finalize_if_started(). Builds without CUDA: the call throws.
Comm& nccl_world(int device, std::chrono::milliseconds timeout);
void nccl_finalize_if_started();

/// Whether this process was started by mpirun with more than one rank.
bool launched_under_mpi();
/// This process's rank as the launcher's environment gives it, before MPI
/// is initialised (0 outside mpirun): for what every rank would print alike.
int launched_rank();
/// The MPI world as a Comm (initialises MPI on first use, with
/// MPI_ERRORS_RETURN so that moeverify reports MPI errors itself). Throws
/// when this build has no MPI.
Comm& mpi_world();
/// Deadline of every MPI collective (default 30 s): a collective not complete
/// by then prints the rank and collective on stderr and aborts the job
/// (MPI_Abort, exit status 3). May be called before mpi_world().
void set_mpi_collective_timeout(std::chrono::milliseconds timeout);
/// Under mpirun every rank must run the same cases with the same settings.
/// Throws Error(bad_input) on every rank alike, naming the ranks that differ,
/// when the ranks have different numbers of cases to run ...
void mpi_agree_on_case_count(int64_t num_cases);
/// ... or a different configuration for the next case (`config_hash` covers
/// every field that affects results; `summary` is shown for each group).
void mpi_agree_on_case(const std::string& case_name, uint64_t config_hash, const std::string& summary);
void mpi_finalize_if_started();

// ---- shared by the implementations ----------------------------------------
namespace comm_detail {

/// One rank's verdict on an all-to-all-v, in plain numbers so that it can be
/// all-gathered (MPI) or read from shared memory (local): every rank derives
/// the same outcome from all ranks' verdicts.
enum class A2aFault : int64_t {
  none = 0,
  list_length,      // a: send list entries, b: recv list entries (R expected)
  negative_split,   // a: the split, peer: the rank it is for
  send_overflow,    // a: sum(send_rows), b: send capacity (rows)
  recv_overflow,    // a: sum(recv_rows), b: recv capacity (rows)
  split_mismatch,   // peer sends a rows to this rank, which expects b
  row_bytes,        // a: this rank's row size, b: rank 0's
  count_overflow,   // a: a split or offset too large for MPI's int counts
};
struct A2aVerdict {
  int64_t fault = 0;  // A2aFault
  int64_t a = 0, b = 0, peer = -1;
  int64_t row_bytes = 0;  // this rank's row size (compared across ranks)
};

/// One rank's all-to-all-v arguments (what every rank checks of every rank).
struct A2aArgs {
  std::vector<int64_t> send_rows, recv_rows;
  int64_t send_capacity_rows = 0, recv_capacity_rows = 0;
  size_t row_bytes = 0;
};
/// Every rank's verdict from every rank's arguments: its own checks, then
/// whether each clean sender's split to it matches what it expects, then the
/// row sizes against rank 0's. Identical on every rank given the same input.
std::vector<A2aVerdict> a2a_verdicts(const std::vector<A2aArgs>& all);

/// This rank's own arguments: list lengths, negative splits, capacities.
A2aVerdict check_own_a2a(int R, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows,
                         int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes);
/// Marks, on every rank whose verdict is still clean, a row size that
/// differs from rank 0's.
void check_row_bytes(std::vector<A2aVerdict>& all);
/// MPI's counts and displacements are int (in rows, one row a derived type
/// of row_bytes): the first split, offset or row size past INT_MAX, or -1
/// when every one fits. The MPI communicator refuses the exchange on it.
int64_t mpi_count_overflow(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                           size_t row_bytes);
/// "" when every rank's verdict is clean; else the message that rank `rank`
/// throws: its own fault, or the first faulty rank's.
std::string a2a_failure(const char* what, int rank, const std::vector<A2aVerdict>& all);

}  // namespace comm_detail
}  // namespace moev
