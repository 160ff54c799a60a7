// NCCL communicator (docs/architecture.md idea 3, issue 12 item 4), built in CUDA builds.
// One process per rank, one GPU per process. The token rows of an
// all-to-all-v move on the GPU as grouped ncclSend/ncclRecv; the host
// Communicator (the MPI world) broadcasts NCCL's unique id, agrees on every
// all-to-all's arguments before any row moves (the same verdicts as the
// local and MPI communicators), and carries the host-memory all-to-all of
// metadata (the count exchange). All-reduce and all-gather of host values
// run as NCCL collectives staged through device memory.
//
// Every NCCL collective is enqueued on the communicator's own stream and
// polled: cudaStreamQuery for completion, ncclCommGetAsyncError for an error
// raised by a peer or the network. A watchdog thread holds the deadline over
// the whole call, NCCL's own blocking steps included (connection set-up in
// ncclGroupEnd, ncclCommInitRank waiting for its peers): past it the rank and
// collective are printed, the communicator is aborted (ncclCommAbort, which
// NCCL lets another thread call to end a call that cannot finish) and the
// process exits 3, which makes mpirun end the job, as the MPI communicator
// does.
//
// NCCL is loaded with dlopen when the first communicator is made, like
// cuBLAS (kernels/cuda_exec.cu): every moeverify process need not map it.
//
// On a single GPU: NCCL refuses two ranks of one communicator on one device
// since 2.5 (ncclCommInitRank fails with ncclInvalidUsage, "Duplicate GPU
// detected"; NVIDIA/nccl#231, #418). So in-process ranks that share a GPU
// use the local Communicator with device-to-device copies instead, and an
// NCCL communicator on one GPU has one rank (tests/gpu_check.cpp runs that).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>

#include "comm.h"
#include "error.h"

namespace moev {
namespace {

/// The NCCL entry points moeverify uses, from libnccl.so.2.
struct Nccl {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

const Nccl& nccl() {
  static const Nccl n = [] {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) runtime_error(std::string("communicator nccl: cannot load libnccl.so.2 (") + dlerror() + ")");
    Nccl r;
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f) runtime_error(std::string("communicator nccl: libnccl.so.2 lacks ") + name);
    };
    sym(r.get_unique_id, "ncclGetUniqueId");
    sym(r.init_rank, "ncclCommInitRank");
    sym(r.destroy, "ncclCommDestroy");
    sym(r.abort, "ncclCommAbort");
    sym(r.async_error, "ncclCommGetAsyncError");
    sym(r.group_start, "ncclGroupStart");
    sym(r.group_end, "ncclGroupEnd");
    sym(r.send, "ncclSend");
    sym(r.recv, "ncclRecv");
    sym(r.all_reduce, "ncclAllReduce");
    sym(r.all_gather, "ncclAllGather");
    sym(r.error_string, "ncclGetErrorString");
    return r;
  }();
  return n;
}

std::string host_name() {
  char h[256] = {0};
  if (gethostname(h, sizeof(h) - 1) != 0) return "?";
  return h;
}

void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) runtime_error(what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

/// Calls on_expiry(what) when a call armed with arm(what) is not disarmed
/// within the timeout. One call at a time.
class Watchdog {
 public:
  Watchdog(std::chrono::milliseconds timeout, std::function<void(const std::string&, double)> on_expiry)
      : timeout_(timeout), on_expiry_(std::move(on_expiry)), thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm(std::string what) {
    std::lock_guard<std::mutex> lk(m_);
    what_ = std::move(what);
    since_ = std::chrono::steady_clock::now();
    armed_ = true;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lk(m_);
    armed_ = false;
    cv_.notify_all();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(m_);
    while (!stop_) {
      if (!armed_) {
        cv_.wait(lk);
        continue;
      }
      cv_.wait_until(lk, since_ + timeout_);
      // Against the call armed now: the one whose deadline was waited for
      // may have left, and another begun, while this thread woke up.
      if (armed_ && !stop_ && std::chrono::steady_clock::now() >= since_ + timeout_)
        on_expiry_(what_, std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count());
    }
  }

  std::chrono::milliseconds timeout_;
  std::function<void(const std::string&, double)> on_expiry_;
  std::mutex m_;
  std::condition_variable cv_;
  bool armed_ = false, stop_ = false;
  std::string what_;
  std::chrono::steady_clock::time_point since_;
  std::thread thread_;  // last: it starts once the rest is built
};

/// Disarms the watchdog when a collective leaves, normally or by a throw.
struct Armed {
  Watchdog& w;
  Armed(Watchdog& wd, std::string what) : w(wd) { w.arm(std::move(what)); }
  ~Armed() { w.disarm(); }
};

class NcclComm final : public Comm {
 public:
  NcclComm(Comm& host, int device, std::chrono::milliseconds timeout)
      : host_(host), device_(device), watchdog_(timeout, [this](const std::string& what, double secs) {
          expire(what, "not complete after " + std::to_string(secs) +
                           " s (--collective-timeout): a peer rank is stopped, dead, or failed outside the "
                           "collective");
        }) {
    // Every rank must reach ncclCommInitRank, or none: a rank that cannot
    // load NCCL or take its GPU says so before its peers would wait there.
    std::string why;
    try {
      nccl();
      cuda_check(cudaSetDevice(device_), "communicator nccl: cudaSetDevice(" + std::to_string(device_) + ")");
    } catch (const std::exception& e) {
      why = e.what();
    }
    int64_t failed = why.empty() ? 0 : 1;
    host_.allreduce_max(&failed, 1, "NCCL start-up agreement");
    if (failed) runtime_error(why.empty() ? "communicator nccl: another rank could not load NCCL or take its GPU" : why);
    const Nccl& n = nccl();
    ncclUniqueId id{};
    if (host_.rank() == 0) check(n.get_unique_id(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> all(static_cast<size_t>(host_.size()));
    host_.allgather(&id, sizeof(id), all.data(), "NCCL unique id broadcast");
    {
      Armed a(watchdog_, "ncclCommInitRank");
      check(n.init_rank(&comm_, host_.size(), all[0], host_.rank()), "ncclCommInitRank");
    }
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "communicator nccl: cudaStreamCreate");
  }
  ~NcclComm() override {
    if (comm_) nccl().destroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
    if (scratch_) cudaFree(scratch_);
  }

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  bool device_buffers() const override { return true; }

  /// Host memory (the count exchange): the host Communicator moves it.
  void alltoallv(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows, void* recv,
                 int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes,
                 const char* what) override {
    host_.alltoallv(send, send_capacity_rows, send_rows, recv, recv_capacity_rows, recv_rows, row_bytes, what);
  }

  void alltoallv_device(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows,
                        void* recv, int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows,
                        size_t row_bytes, const char* what) override {
    agree({send_rows, recv_rows, send_capacity_rows, recv_capacity_rows, row_bytes}, what);
    const Nccl& n = nccl();
    bind();
    Armed a(watchdog_, what);
    // The rows were written by device calls, each complete on return
    // (kernels/device.h); the NCCL stream does not wait for the default one.
    // Every peer gets a send and a receive, zero-row ones included: a rank
    // never skips a peer that might post to it.
    check(n.group_start(), what);
    size_t so = 0, ro = 0;
    for (int p = 0; p < size(); ++p) {
      const size_t sb = size_t(send_rows[size_t(p)]) * row_bytes, rb = size_t(recv_rows[size_t(p)]) * row_bytes;
      check(n.send(static_cast<const uint8_t*>(send) + so, sb, ncclUint8, p, comm_, stream_), what);
      check(n.recv(static_cast<uint8_t*>(recv) + ro, rb, ncclUint8, p, comm_, stream_), what);
      so += sb;
      ro += rb;
    }
    check(n.group_end(), what);
    wait(what, "ncclSend/ncclRecv");
  }

  void allreduce_max(int64_t* v, int n, const char* what) override { reduce(v, n, ncclMax, what); }
  void allreduce_sum(int64_t* v, int n, const char* what) override { reduce(v, n, ncclSum, what); }

  void allgather(const void* send, size_t bytes, void* recv, const char* what) override {
    if (bytes == 0) return;
    bind();
    Armed a(watchdog_, what);
    uint8_t* d = static_cast<uint8_t*>(device_scratch(bytes * size_t(size() + 1)));
    cuda_check(cudaMemcpyAsync(d, send, bytes, cudaMemcpyHostToDevice, stream_), what);
    check(nccl().all_gather(d, d + bytes, bytes, ncclUint8, comm_, stream_), what);
    cuda_check(cudaMemcpyAsync(recv, d + bytes, bytes * size_t(size()), cudaMemcpyDeviceToHost, stream_), what);
    wait(what, "ncclAllGather");
  }

  void barrier(const char* what) override {
    int64_t one = 1;
    reduce(&one, 1, ncclSum, what);
  }

  void abort(const std::string& why) override { host_.abort(why); }

 private:
  /// Every rank's arguments through the host Communicator, every rank's
  /// verdict computed alike on every rank: all throw the same failure, or
  /// all move rows. Fixed-size records (lists cut or padded to R entries,
  /// their real lengths kept) so that one all-gather carries them.
  void agree(const comm_detail::A2aArgs& mine, const char* what) {
    const size_t R = size_t(size()), rec = 5 + 2 * R;
    std::vector<int64_t> out(rec, 0), all(rec * R);
    out[0] = mine.send_capacity_rows;
    out[1] = mine.recv_capacity_rows;
    out[2] = int64_t(mine.row_bytes);
    out[3] = int64_t(mine.send_rows.size());
    out[4] = int64_t(mine.recv_rows.size());
    for (size_t q = 0; q < R && q < mine.send_rows.size(); ++q) out[5 + q] = mine.send_rows[q];
    for (size_t q = 0; q < R && q < mine.recv_rows.size(); ++q) out[5 + R + q] = mine.recv_rows[q];
    host_.allgather(out.data(), rec * sizeof(int64_t), all.data(), what);
    std::vector<comm_detail::A2aArgs> args(R);
    for (size_t p = 0; p < R; ++p) {
      const int64_t* r = all.data() + p * rec;
      comm_detail::A2aArgs& a = args[p];
      a.send_capacity_rows = r[0];
      a.recv_capacity_rows = r[1];
      a.row_bytes = size_t(r[2]);
      a.send_rows.assign(size_t(r[3]), 0);
      a.recv_rows.assign(size_t(r[4]), 0);
      for (size_t q = 0; q < R && q < a.send_rows.size(); ++q) a.send_rows[q] = r[5 + q];
      for (size_t q = 0; q < R && q < a.recv_rows.size(); ++q) a.recv_rows[q] = r[5 + R + q];
    }
    const std::string failure = comm_detail::a2a_failure(what, rank(), comm_detail::a2a_verdicts(args));
    if (!failure.empty()) runtime_error(failure);
  }

  void reduce(int64_t* v, int n, ncclRedOp_t op, const char* what) {
    if (n <= 0) return;
    bind();
    Armed a(watchdog_, what);
    const size_t bytes = size_t(n) * sizeof(int64_t);
    void* d = device_scratch(bytes);
    cuda_check(cudaMemcpyAsync(d, v, bytes, cudaMemcpyHostToDevice, stream_), what);
    check(nccl().all_reduce(d, d, size_t(n), ncclInt64, op, comm_, stream_), what);
    cuda_check(cudaMemcpyAsync(v, d, bytes, cudaMemcpyDeviceToHost, stream_), what);
    wait(what, "ncclAllReduce");
  }

  /// Host threads other than the one that made the communicator may call
  /// it: the CUDA device is per thread.
  void bind() { cuda_check(cudaSetDevice(device_), "communicator nccl: cudaSetDevice"); }

  void* device_scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      if (scratch_) cudaFree(scratch_);
      scratch_ = nullptr;
      cuda_check(cudaMalloc(&scratch_, bytes), "communicator nccl: cudaMalloc");
      scratch_bytes_ = bytes;
    }
    return scratch_;
  }

  void check(ncclResult_t r, const char* what) {
    if (r != ncclSuccess && r != ncclInProgress)
      runtime_error(std::string("collective ") + what + " on rank " + std::to_string(rank()) + ": NCCL " +
                    nccl().error_string(r));
  }

  /// Polls the stream until the enqueued work is done; an asynchronous
  /// NCCL error ends the communicator and the process (the watchdog holds
  /// the deadline).
  void wait(const char* what, const char* call) {
    for (long polls = 0;; ++polls) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) cuda_check(q, std::string("collective ") + what + " (" + call + ")");
      ncclResult_t async = ncclSuccess;
      nccl().async_error(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        expire(std::string(what) + " (" + call + ")", std::string("NCCL ") + nccl().error_string(async));
      if (polls < 2000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  /// Names this rank and the call on stderr, aborts the communicator and
  /// ends the process: the peers cannot be brought back into lockstep.
  [[noreturn]] void expire(const std::string& what, const std::string& why) {
    std::fprintf(stderr, "moeverify: rank %d (%s, pid %d, CUDA device %d): collective %s: %s; "
                 "aborting the NCCL communicator and the job\n",
                 host_.rank(), host_name().c_str(), int(getpid()), device_, what.c_str(), why.c_str());
    std::fflush(stderr);
    if (comm_) nccl().abort(comm_);
    std::_Exit(3);
  }

  Comm& host_;
  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  Watchdog watchdog_;  // last: its thread stops before the rest goes
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(Comm& host, int device, std::chrono::milliseconds timeout) {
  return std::make_unique<NcclComm>(host, device, timeout);
}

namespace {
std::unique_ptr<Comm> g_nccl;
}  // namespace

Comm& nccl_world(int device, std::chrono::milliseconds timeout) {
  if (!g_nccl) g_nccl = make_nccl_comm(mpi_world(), device, timeout);
  return *g_nccl;
}

void nccl_finalize_if_started() { g_nccl.reset(); }

}  // namespace moev
