// In-process communicator: ranks are threads. A collective runs in three
// steps under one protocol:
//   1. post: each rank publishes its pointers and arguments in the hub;
//   2. meet (bounded by the timeout): every rank has posted; each rank now
//      checks *every* rank's arguments (first: that all are in the same
//      collective, by name), so all ranks reach the same verdict from the
//      same data without a further exchange. A rank whose peers have all
//      either arrived or left (Comm::leave) waits no longer: the ones that
//      left will never come;
//   3. either all copy from the peers' buffers, or none does and all throw;
//      in both cases they meet once more (drain) before returning, so no rank
//      frees or reuses a buffer, or reposts, while a peer may still read it.
// The drain waits without a deadline: every rank has passed step 2, and
// between the two meetings a rank only checks and copies, so each arrives.
#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>

#include "comm.h"
#include "error.h"

namespace moev {

// ---- shared verdict logic (comm.h, comm_detail) ---------------------------
namespace comm_detail {
namespace {

std::string describe(int rank, const A2aVerdict& v) {
  const std::string a = std::to_string(v.a), b = std::to_string(v.b);
  switch (A2aFault(v.fault)) {
    case A2aFault::none: return "no fault";
    case A2aFault::list_length:
      return "split lists have " + a + " (send) and " + b + " (receive) entries; one per rank expected";
    case A2aFault::negative_split: return "negative split " + a + " for rank " + std::to_string(v.peer);
    case A2aFault::send_overflow:
      return "send splits sum to " + a + " rows but the send buffer holds " + b + " rows";
    case A2aFault::recv_overflow:
      return "receive splits sum to " + a + " rows but the receive buffer holds " + b + " rows";
    case A2aFault::split_mismatch:
      return "split mismatch: rank " + std::to_string(v.peer) + " sends " + a + " rows to rank " +
             std::to_string(rank) + ", which expects " + b;
    case A2aFault::row_bytes: return "row size " + a + " bytes differs from rank 0's " + b + " bytes";
    case A2aFault::count_overflow: return "split or offset " + a + " exceeds MPI's int counts";
  }
  return "fault " + std::to_string(v.fault);
}

}  // namespace

A2aVerdict check_own_a2a(int R, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows,
                         int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes) {
  A2aVerdict v;
  v.row_bytes = int64_t(row_bytes);
  if (int(send_rows.size()) != R || int(recv_rows.size()) != R) {
    v.fault = int64_t(A2aFault::list_length);
    v.a = int64_t(send_rows.size());
    v.b = int64_t(recv_rows.size());
    return v;
  }
  int64_t send_sum = 0, recv_sum = 0;
  for (int q = 0; q < R; ++q) {
    for (int64_t s : {send_rows[size_t(q)], recv_rows[size_t(q)]})
      if (s < 0) {
        v.fault = int64_t(A2aFault::negative_split);
        v.a = s;
        v.peer = q;
        return v;
      }
    send_sum += send_rows[size_t(q)];
    recv_sum += recv_rows[size_t(q)];
  }
  if (send_sum > send_capacity_rows) {
    v.fault = int64_t(A2aFault::send_overflow);
    v.a = send_sum;
    v.b = send_capacity_rows;
  } else if (recv_sum > recv_capacity_rows) {
    v.fault = int64_t(A2aFault::recv_overflow);
    v.a = recv_sum;
    v.b = recv_capacity_rows;
  }
  return v;
}

void check_row_bytes(std::vector<A2aVerdict>& all) {
  for (auto& v : all)
    if (v.fault == 0 && v.row_bytes != all[0].row_bytes) {
      v.fault = int64_t(A2aFault::row_bytes);
      v.a = v.row_bytes;
      v.b = all[0].row_bytes;
    }
}

int64_t mpi_count_overflow(const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                           size_t row_bytes) {
  int64_t so = 0, ro = 0;
  for (size_t p = 0; p < send_rows.size() && p < recv_rows.size(); ++p) {
    for (int64_t v : {send_rows[p], recv_rows[p], so, ro})
      if (v > INT_MAX) return v;
    so += send_rows[p];
    ro += recv_rows[p];
  }
  return row_bytes > size_t(INT_MAX) ? int64_t(row_bytes) : -1;
}

std::vector<A2aVerdict> a2a_verdicts(const std::vector<A2aArgs>& args) {
  const int R = int(args.size());
  std::vector<A2aVerdict> all(static_cast<size_t>(R));
  for (int p = 0; p < R; ++p) {
    const A2aArgs& a = args[size_t(p)];
    all[size_t(p)] = check_own_a2a(R, a.send_capacity_rows, a.send_rows, a.recv_capacity_rows, a.recv_rows, a.row_bytes);
  }
  for (int q = 0; q < R; ++q) {  // q receives from every clean sender p
    A2aVerdict& v = all[size_t(q)];
    if (v.fault != 0) continue;
    for (int p = 0; p < R; ++p) {
      const std::vector<int64_t>& ps = args[size_t(p)].send_rows;
      if (int(ps.size()) != R) continue;  // p itself is faulty
      const int64_t sent = ps[size_t(q)], expected = args[size_t(q)].recv_rows[size_t(p)];
      if (sent != expected) {
        v.fault = int64_t(A2aFault::split_mismatch);
        v.a = sent;
        v.b = expected;
        v.peer = p;
        break;
      }
    }
  }
  check_row_bytes(all);
  return all;
}

std::string a2a_failure(const char* what, int rank, const std::vector<A2aVerdict>& all) {
  int first = -1, faulty = 0;
  for (size_t p = 0; p < all.size(); ++p)
    if (all[p].fault != 0) {
      if (first < 0) first = int(p);
      ++faulty;
    }
  if (first < 0) return "";
  const std::string head = std::string("collective ") + what + " on rank " + std::to_string(rank) + ": ";
  if (all[size_t(rank)].fault != 0) return head + describe(rank, all[size_t(rank)]) + "; no rank exchanged any row";
  // The faulty rank reports the detail; the others only point at it.
  return head + "not run on any rank: rank " + std::to_string(first) + " failed the argument check" +
         (faulty > 1 ? " (and " + std::to_string(faulty - 1) + " more rank(s))" : "");
}

}  // namespace comm_detail

namespace {

using comm_detail::A2aFault;
using comm_detail::A2aVerdict;

/// What one rank publishes for a collective.
struct Post {
  const char* what = "";  // the collective's name: the same on every rank
  const void* ptr = nullptr;
  comm_detail::A2aArgs a2a;  // all-to-all-v
  size_t width = 0;  // bytes (all-gather), elements (reduce)
};

struct Hub {
  int R;
  std::chrono::milliseconds timeout;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::string failure;  // a rank failed outside a collective, or a collective timed out
  std::vector<Post> post;
  std::vector<char> left;  // left[r]: rank r returned and joins no further collective
  int left_count = 0;
  DeviceCopy device_copy;  // set: alltoallv rows are device buffers, moved with it
};

class LocalComm final : public Comm {
 public:
  LocalComm(std::shared_ptr<Hub> h, int r) : hub_(std::move(h)), r_(r) {}
  int rank() const override { return r_; }
  int size() const override { return hub_->R; }
  bool device_buffers() const override { return bool(hub_->device_copy); }

  void alltoallv(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows, void* recv,
                 int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes,
                 const char* what) override {
    exchange(send, send_capacity_rows, send_rows, recv, recv_capacity_rows, recv_rows, row_bytes, what, false);
  }
  void alltoallv_device(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows,
                        void* recv, int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows,
                        size_t row_bytes, const char* what) override {
    if (!hub_->device_copy) Comm::alltoallv_device(send, send_capacity_rows, send_rows, recv, recv_capacity_rows,
                                                   recv_rows, row_bytes, what);
    exchange(send, send_capacity_rows, send_rows, recv, recv_capacity_rows, recv_rows, row_bytes, what, true);
  }

  void allreduce_max(int64_t* v, int n, const char* what) override { reduce(v, n, what, Op::max); }
  void allreduce_sum(int64_t* v, int n, const char* what) override { reduce(v, n, what, Op::sum); }

  void allgather(const void* send, size_t bytes, void* recv, const char* what) override {
    Post mine;
    mine.ptr = send;
    mine.width = bytes;
    post(std::move(mine), what);
    meet(what);
    check_same_width(what, "ranks contribute different sizes", " bytes");
    for (int p = 0; p < hub_->R; ++p)
      if (bytes) std::memcpy(static_cast<uint8_t*>(recv) + size_t(p) * bytes, hub_->post[size_t(p)].ptr, bytes);
    drain();
  }

  void barrier(const char* what) override {
    post(Post{}, what);
    meet(what);
    drain();  // the peers read this rank's post (its name) until here
  }

  void leave() override {
    {
      std::lock_guard<std::mutex> lk(hub_->m);
      if (!hub_->left[size_t(r_)]) {
        hub_->left[size_t(r_)] = 1;
        ++hub_->left_count;
      }
    }
    hub_->cv.notify_all();
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lk(hub_->m);
      if (hub_->failure.empty()) hub_->failure = "rank " + std::to_string(r_) + " failed: " + why;
    }
    hub_->cv.notify_all();
  }

 private:
  enum class Op { max, sum };

  void post(Post p, const char* what) {
    p.what = what;
    std::lock_guard<std::mutex> lk(hub_->m);
    hub_->post[size_t(r_)] = std::move(p);
  }

  /// After meet: every rank's post is like rank 0's (same(p)), or every rank
  /// throws alike with describe(p) of the first that is not. The message is
  /// read from the posts before drain(): past it a peer may post its next
  /// collective.
  template <class Same, class Describe>
  void require_alike(const char* what, Same same, Describe describe) {
    for (int p = 1; p < hub_->R; ++p)
      if (!same(hub_->post[size_t(p)], hub_->post[0])) {
        const std::string msg = describe(p);
        drain();
        fail_agreed(what, msg);
      }
  }

  /// Ranks that met in collectives of different names disagree on the
  /// program's order: all throw alike, nothing moves.
  void check_same_collective(const char* what) {
    require_alike(
        what, [](const Post& a, const Post& b) { return std::strcmp(a.what, b.what) == 0; },
        [&](int p) {
          return "the ranks are in different collectives (rank 0: " + std::string(hub_->post[0].what) + ", rank " +
                 std::to_string(p) + ": " + hub_->post[size_t(p)].what + "); nothing was exchanged";
        });
  }

  /// The ranks that left, as "0, 2 and 3".
  std::string left_ranks() const {
    std::vector<int> l;
    for (int p = 0; p < hub_->R; ++p)
      if (hub_->left[size_t(p)]) l.push_back(p);
    std::string s;
    for (size_t i = 0; i < l.size(); ++i)
      s += (i == 0 ? "" : i + 1 == l.size() ? " and " : ", ") + std::to_string(l[i]);
    return s;
  }

  void check_same_width(const char* what, const char* differ, const char* unit) {
    require_alike(
        what, [](const Post& a, const Post& b) { return a.width == b.width; },
        [&](int p) {
          return std::string(differ) + " (rank " + std::to_string(p) + ": " +
                 std::to_string(hub_->post[size_t(p)].width) + unit + ", rank 0: " +
                 std::to_string(hub_->post[0].width) + unit + ")";
        });
  }

  void reduce(int64_t* v, int n, const char* what, Op op) {
    std::vector<int64_t> mine(v, v + std::max(n, 0));
    Post pst;
    pst.ptr = mine.data();
    pst.width = size_t(std::max(n, 0));
    post(std::move(pst), what);
    meet(what);
    check_same_width(what, "ranks reduce different lengths", "");
    for (int p = 0; p < hub_->R; ++p) {
      const int64_t* o = static_cast<const int64_t*>(hub_->post[size_t(p)].ptr);
      for (int i = 0; i < n; ++i) v[i] = p == 0 ? o[i] : op == Op::max ? std::max(v[i], o[i]) : v[i] + o[i];
    }
    drain();
  }

  /// A verdict every rank reached alike: each throws it, no hub state changes.
  [[noreturn]] void fail_agreed(const char* what, const std::string& msg) {
    runtime_error(std::string("collective ") + what + " on rank " + std::to_string(r_) + ": " + msg);
  }

  /// Step 2: bounded; throws (on every waiting rank) on a failure or timeout.
  void meet(const char* what) {
    std::unique_lock<std::mutex> lk(hub_->m);
    if (!hub_->failure.empty()) runtime_error(hub_->failure);
    const uint64_t gen = hub_->generation;
    if (++hub_->arrived == hub_->R) {
      hub_->arrived = 0;
      ++hub_->generation;
      hub_->cv.notify_all();
      lk.unlock();  // the posts stay put until drain(), which locks
      check_same_collective(what);
      return;
    }
    auto deserted = [&] { return hub_->arrived + hub_->left_count == hub_->R; };
    const bool ok = hub_->cv.wait_for(lk, hub_->timeout, [&] {
      return hub_->generation != gen || !hub_->failure.empty() || deserted();
    });
    if (hub_->generation != gen) {  // everyone arrived (a failure set since concerns later collectives)
      lk.unlock();
      check_same_collective(what);
      return;
    }
    if (hub_->failure.empty() && deserted()) {
      hub_->failure = std::string("collective ") + what + " on rank " + std::to_string(r_) + ": rank(s) " +
                      left_ranks() + " returned without joining it (the ranks disagree on which collectives run)";
      hub_->cv.notify_all();
    }
    --hub_->arrived;  // leaving unmatched: this rank no longer counts as arrived
    if (!hub_->failure.empty()) runtime_error(hub_->failure);
    if (!ok) {
      hub_->failure = std::string("collective ") + what + " timed out after " +
                      std::to_string(hub_->timeout.count()) + " ms on rank " + std::to_string(r_) + ": only " +
                      std::to_string(hub_->arrived + 1) + " of " + std::to_string(hub_->R) +
                      " ranks arrived (a hang)";
      hub_->cv.notify_all();
      runtime_error(hub_->failure);
    }
  }

  /// Step 3's meeting: every rank has passed meet() for this collective and
  /// arrives here after a bounded amount of work, so this waits without a
  /// deadline and ignores failures: leaving early would free or repost a
  /// buffer that a peer may still read.
  void drain() {
    std::unique_lock<std::mutex> lk(hub_->m);
    const uint64_t gen = hub_->generation;
    if (++hub_->arrived == hub_->R) {
      hub_->arrived = 0;
      ++hub_->generation;
      hub_->cv.notify_all();
      return;
    }
    hub_->cv.wait(lk, [&] { return hub_->generation != gen; });
  }

  /// The all-to-all-v rendezvous: every rank posts its arguments, all check
  /// them alike, then each receiver copies its rows from the senders'
  /// buffers (with the device copy when on_device).
  void exchange(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows, void* recv,
                int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes, const char* what,
                bool on_device) {
    const int R = hub_->R;
    Post mine;
    mine.ptr = send;
    mine.a2a = {send_rows, recv_rows, send_capacity_rows, recv_capacity_rows, row_bytes};
    post(std::move(mine), what);
    meet(what);
    // Every rank's verdict, computed identically on every rank.
    std::vector<comm_detail::A2aArgs> args;
    for (int p = 0; p < R; ++p) args.push_back(hub_->post[size_t(p)].a2a);
    const std::vector<A2aVerdict> all = comm_detail::a2a_verdicts(args);
    const std::string failure = comm_detail::a2a_failure(what, r_, all);
    if (!failure.empty()) {
      drain();
      runtime_error(failure);
    }
    uint8_t* out = static_cast<uint8_t*>(recv);
    try {
      for (int p = 0; p < R; ++p) {
        const Post& pp = hub_->post[size_t(p)];
        int64_t src_row = 0;
        for (int q = 0; q < r_; ++q) src_row += pp.a2a.send_rows[size_t(q)];
        const size_t n = size_t(recv_rows[size_t(p)]) * row_bytes;
        const uint8_t* from = static_cast<const uint8_t*>(pp.ptr) + size_t(src_row) * row_bytes;
        if (n && on_device) hub_->device_copy(out, from, n);
        else if (n) std::memcpy(out, from, n);
        out += n;
      }
    } catch (...) {  // a failed device copy: the peers wait in drain() for this rank
      drain();
      throw;
    }
    drain();
  }

  std::shared_ptr<Hub> hub_;
  int r_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_local_comms(int R, std::chrono::milliseconds timeout,
                                                    DeviceCopy device_copy) {
  auto hub = std::make_shared<Hub>();
  hub->R = R;
  hub->device_copy = std::move(device_copy);
  hub->timeout = timeout;
  hub->post.resize(size_t(R));
  hub->left.resize(size_t(R));
  std::vector<std::unique_ptr<Comm>> v;
  for (int r = 0; r < R; ++r) v.push_back(std::make_unique<LocalComm>(hub, r));
  return v;
}

}  // namespace moev
