// In-process communicator: ranks are threads; a collective posts each rank's
// pointers, meets at a barrier, reads the peers' buffers directly, and meets
// again so that no buffer is reused while a peer still reads it.
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "comm.h"
#include "error.h"

namespace moev {
namespace {

struct Hub {
  int R;
  std::chrono::milliseconds timeout;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::string failure;  // set by a rank that found the collective's arguments inconsistent
  std::vector<const void*> ptr;
  std::vector<std::vector<int64_t>> meta;
  std::vector<size_t> width;
};

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<Hub> h, int r) : hub_(std::move(h)), r_(r) {}
  int rank() const override { return r_; }
  int size() const override { return hub_->R; }

  void alltoallv(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                 const std::vector<int64_t>& recv_rows, size_t row_bytes, const char* what) override {
    const int R = hub_->R;
    if (int(send_rows.size()) != R || int(recv_rows.size()) != R)
      fail(what, "split lists must have one entry per rank");
    post(send, send_rows, row_bytes);
    meet(what);
    for (int p = 0; p < R; ++p) {
      if (hub_->meta[size_t(p)][size_t(r_)] != recv_rows[size_t(p)] || hub_->width[size_t(p)] != row_bytes)
        fail(what, "split mismatch: rank " + std::to_string(p) + " sends " +
                       std::to_string(hub_->meta[size_t(p)][size_t(r_)]) + " rows to rank " + std::to_string(r_) +
                       ", which expects " + std::to_string(recv_rows[size_t(p)]));
    }
    uint8_t* out = static_cast<uint8_t*>(recv);
    for (int p = 0; p < R; ++p) {
      int64_t src_row = 0;
      for (int q = 0; q < r_; ++q) src_row += hub_->meta[size_t(p)][size_t(q)];
      const size_t n = size_t(recv_rows[size_t(p)]) * row_bytes;
      if (n) std::memcpy(out, static_cast<const uint8_t*>(hub_->ptr[size_t(p)]) + size_t(src_row) * row_bytes, n);
      out += n;
    }
    meet(what);
  }

  void allreduce_max(int64_t* v, int n, const char* what) override { reduce(v, n, what, true); }
  void allreduce_sum(int64_t* v, int n, const char* what) override { reduce(v, n, what, false); }

  void allgather(const void* send, size_t bytes, void* recv, const char* what) override {
    post(send, {}, bytes);
    meet(what);
    for (int p = 0; p < hub_->R; ++p) {
      if (hub_->width[size_t(p)] != bytes) fail(what, "ranks contribute different sizes");
      if (bytes) std::memcpy(static_cast<uint8_t*>(recv) + size_t(p) * bytes, hub_->ptr[size_t(p)], bytes);
    }
    meet(what);
  }

  void barrier(const char* what) override { meet(what); }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lk(hub_->m);
      if (hub_->failure.empty()) hub_->failure = "rank " + std::to_string(r_) + " failed: " + why;
    }
    hub_->cv.notify_all();
  }

 private:
  void post(const void* p, std::vector<int64_t> meta, size_t width) {
    std::lock_guard<std::mutex> lk(hub_->m);
    hub_->ptr[size_t(r_)] = p;
    hub_->meta[size_t(r_)] = std::move(meta);
    hub_->width[size_t(r_)] = width;
  }

  void reduce(int64_t* v, int n, const char* what, bool is_max) {
    std::vector<int64_t> mine(v, v + n);
    post(mine.data(), {}, size_t(n));
    meet(what);
    for (int p = 0; p < hub_->R; ++p) {
      if (hub_->width[size_t(p)] != size_t(n)) fail(what, "ranks reduce different lengths");
      const int64_t* o = static_cast<const int64_t*>(hub_->ptr[size_t(p)]);
      for (int i = 0; i < n; ++i) v[i] = p == 0 ? o[i] : is_max ? std::max(v[i], o[i]) : v[i] + o[i];
    }
    meet(what);
  }

  [[noreturn]] void fail(const char* what, const std::string& msg) {
    const std::string full = std::string("collective ") + what + " on rank " + std::to_string(r_) + ": " + msg;
    {
      std::lock_guard<std::mutex> lk(hub_->m);
      if (hub_->failure.empty()) hub_->failure = full;
    }
    hub_->cv.notify_all();
    runtime_error(full);
  }

  void meet(const char* what) {
    std::unique_lock<std::mutex> lk(hub_->m);
    if (!hub_->failure.empty()) runtime_error(hub_->failure);
    const uint64_t gen = hub_->generation;
    if (++hub_->arrived == hub_->R) {
      hub_->arrived = 0;
      ++hub_->generation;
      hub_->cv.notify_all();
      return;
    }
    const bool ok = hub_->cv.wait_for(lk, hub_->timeout,
                                      [&] { return hub_->generation != gen || !hub_->failure.empty(); });
    if (!hub_->failure.empty() && hub_->generation == gen) {
      --hub_->arrived;
      runtime_error(hub_->failure);
    }
    if (!ok) {
      const int arrived = hub_->arrived;
      hub_->failure = std::string("collective ") + what + " timed out after " +
                      std::to_string(hub_->timeout.count()) + " ms on rank " + std::to_string(r_) + ": only " +
                      std::to_string(arrived) + " of " + std::to_string(hub_->R) + " ranks arrived (a hang)";
      hub_->cv.notify_all();
      runtime_error(hub_->failure);
    }
  }

  std::shared_ptr<Hub> hub_;
  int r_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_local_comms(int R, std::chrono::milliseconds timeout) {
  auto hub = std::make_shared<Hub>();
  hub->R = R;
  hub->timeout = timeout;
  hub->ptr.resize(size_t(R));
  hub->meta.resize(size_t(R));
  hub->width.resize(size_t(R));
  std::vector<std::unique_ptr<Comm>> v;
  for (int r = 0; r < R; ++r) v.push_back(std::make_unique<LocalComm>(hub, r));
  return v;
}

}  // namespace moev
