// MPI communicator: one process per rank, host buffers (Debian's OpenMPI is
// not CUDA-aware).
//  - Every collective is non-blocking (MPI_I*) and polled with MPI_Test
//    against a deadline (--collective-timeout): a peer that is stopped, dead,
//    or stuck elsewhere makes the waiting ranks print their rank and
//    collective on stderr and MPI_Abort the job, instead of hanging forever.
//  - An all-to-all-v first exchanges the send counts (split consistency) and
//    all-gathers every rank's verdict on its arguments (splits against the
//    buffer capacities included), so every rank throws the same failure, or
//    every rank moves data; no rank's buffer is overrun.
//  - Ranks that reach different collectives (a branch taken per rank) end
//    the job at once, both names printed: MPI matches collectives by order,
//    not kind, so what such a pair moved is garbage (the arrival notices
//    carry each collective's name).
//  - MPI_COMM_WORLD uses MPI_ERRORS_RETURN: MPI errors become moeverify
//    errors with the collective named, not an abort inside the library.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm.h"
#include "error.h"

#if defined(MOEVERIFY_HAVE_MPI)
#include <mpi.h>
#endif

namespace moev {

bool launched_under_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* s = std::getenv(v);
    if (s && std::atoi(s) > 1) return true;
  }
  return false;
}

int launched_rank() {
  if (!launched_under_mpi()) return 0;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

namespace {

std::chrono::milliseconds g_timeout{30000};

}  // namespace

void set_mpi_collective_timeout(std::chrono::milliseconds timeout) { g_timeout = timeout; }

#if defined(MOEVERIFY_HAVE_MPI)
namespace {

using comm_detail::A2aFault;
using comm_detail::A2aVerdict;
static_assert(sizeof(A2aVerdict) == 5 * sizeof(int64_t), "A2aVerdict is all-gathered as 5 int64");

// Stand-ins for the buffers of a rank that sends or receives nothing (an
// empty tensor's data() may be null). They must be two different addresses:
// Open MPI's libnbc takes a send buffer equal to the receive buffer for
// MPI_IN_PLACE, and in 4.1 its in-place all-to-all-v returns at once for a
// rank with no rows without reserving the collective's tag, so that rank's
// next nonblocking collectives carry other tags than its peers' and never
// match them (issue 21: a zero-token rank hung the job at "overload max").
char g_no_send[1], g_no_recv[1];
void* const kNoSend = g_no_send;
void* const kNoRecv = g_no_recv;

std::string host_name() {
  char h[256] = {0};
  if (gethostname(h, sizeof(h) - 1) != 0) return "?";
  return h;
}

/// "1.5 s": a duration for a message.
std::string fmt_seconds(std::chrono::steady_clock::duration d) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.3g s", std::chrono::duration<double>(d).count());
  return b;
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    runtime_error(std::string("MPI ") + what + ": " + std::string(msg, size_t(len)));
  }
}

class MpiComm final : public Comm {
 public:
  MpiComm() {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) check(MPI_Init(nullptr, nullptr), "MPI_Init");
    check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    if (const char* v = std::getenv("MOEVERIFY_TEST_STOP_AT")) {
      long long r = -1, k = -1;
      char where[16] = {0};
      const int n = std::sscanf(v, "%lld:%lld:%15s", &r, &k, where);
      if (n >= 2 && r == rank_) {
        stall_at_ = k;
        stall_inside_ = n == 3 && std::strcmp(where, "inside") == 0;
      }
    }
    beats_.resize(size_t(size_));
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post_beat_recv(p);
  }
  /// Finalize must not meet receives still posted; a beat still on its way
  /// out is left to complete on its own.
  void cancel_beats() {
    for (Beat& b : beats_) {
      if (b.recv != MPI_REQUEST_NULL) {
        MPI_Cancel(&b.recv);
        MPI_Wait(&b.recv, MPI_STATUS_IGNORE);
      }
      if (b.send != MPI_REQUEST_NULL) MPI_Request_free(&b.send);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void alltoallv(const void* send, int64_t send_capacity_rows, const std::vector<int64_t>& send_rows, void* recv,
                 int64_t recv_capacity_rows, const std::vector<int64_t>& recv_rows, size_t row_bytes,
                 const char* what) override {
    const size_t R = size_t(size_);
    A2aVerdict mine = comm_detail::check_own_a2a(size_, send_capacity_rows, send_rows, recv_capacity_rows, recv_rows,
                                                 row_bytes);
    // Split consistency: what every peer sends to this rank.
    std::vector<int64_t> my_send(R, 0), peer_send(R, 0);
    if (send_rows.size() == R) my_send = send_rows;
    MPI_Request req;
    check(MPI_Ialltoall(my_send.data(), 1, MPI_INT64_T, peer_send.data(), 1, MPI_INT64_T, MPI_COMM_WORLD, &req), what);
    wait(req, what, "MPI_Ialltoall of the splits");
    std::vector<int> sc(R), sd(R), rc(R), rd(R);
    if (mine.fault == 0) {
      for (size_t p = 0; p < R; ++p)
        if (peer_send[p] != recv_rows[p]) {
          mine.fault = int64_t(A2aFault::split_mismatch);
          mine.a = peer_send[p];
          mine.b = recv_rows[p];
          mine.peer = int64_t(p);
          break;
        }
    }
    if (mine.fault == 0) {  // MPI counts and displacements are int (in rows)
      const int64_t big = comm_detail::mpi_count_overflow(send_rows, recv_rows, row_bytes);
      if (big >= 0) {
        mine.fault = int64_t(A2aFault::count_overflow);
        mine.a = big;
      } else {
        int64_t so = 0, ro = 0;
        for (size_t p = 0; p < R; ++p) {
          sc[p] = int(send_rows[p]);
          sd[p] = int(so);
          rc[p] = int(recv_rows[p]);
          rd[p] = int(ro);
          so += send_rows[p];
          ro += recv_rows[p];
        }
      }
    }
    // Every rank's verdict, so that all throw alike or none does.
    std::vector<A2aVerdict> all(R);
    check(MPI_Iallgather(&mine, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, MPI_COMM_WORLD, &req), what);
    wait(req, what, "MPI_Iallgather of the argument checks");
    comm_detail::check_row_bytes(all);
    const std::string failure = comm_detail::a2a_failure(what, rank_, all);
    if (!failure.empty()) {
      agreed_failure_ = true;
      runtime_error(failure);
    }
    if (row_bytes == 0) return;  // nothing to move
    MPI_Datatype row;
    check(MPI_Type_contiguous(int(row_bytes), MPI_BYTE, &row), what);
    check(MPI_Type_commit(&row), what);
    int64_t so = 0, ro = 0;
    for (size_t p = 0; p < R; ++p) {
      so += send_rows[p];
      ro += recv_rows[p];
    }
    const int rcode = MPI_Ialltoallv(so ? send : kNoSend, sc.data(), sd.data(), row, ro ? recv : kNoRecv, rc.data(),
                                     rd.data(), row, MPI_COMM_WORLD, &req);
    if (rcode == MPI_SUCCESS) wait(req, what, "MPI_Ialltoallv");
    MPI_Type_free(&row);
    check(rcode, what);
  }

  void allreduce_max(int64_t* v, int n, const char* what) override { reduce(v, n, MPI_MAX, what); }
  void allreduce_sum(int64_t* v, int n, const char* what) override { reduce(v, n, MPI_SUM, what); }

  void allgather(const void* send, size_t bytes, void* recv, const char* what) override {
    if (bytes > size_t(INT_MAX)) runtime_error(std::string("collective ") + what + ": " + std::to_string(bytes) +
                                               " bytes per rank exceed MPI's int counts");
    MPI_Request req;
    check(MPI_Iallgather(bytes ? send : kNoSend, int(bytes), MPI_BYTE, bytes ? recv : kNoRecv, int(bytes), MPI_BYTE,
                         MPI_COMM_WORLD, &req),
          what);
    wait(req, what, "MPI_Iallgather");
  }

  void barrier(const char* what) override {
    MPI_Request req;
    check(MPI_Ibarrier(MPI_COMM_WORLD, &req), what);
    wait(req, what, "MPI_Ibarrier");
  }

  /// A collective that every rank failed alike needs no word here: the
  /// report carries it. Any other failure is printed at once, because the
  /// peers may wait for this rank in a collective until their deadline and
  /// abort the job before any report is printed.
  void abort(const std::string& why) override {
    if (agreed_failure_) {
      agreed_failure_ = false;
      return;
    }
    std::fprintf(stderr, "moeverify: rank %d (%s, pid %d): failed outside a collective: %s\n", rank_,
                 host_name().c_str(), int(getpid()), why.c_str());
    std::fflush(stderr);
  }

 private:
  void reduce(int64_t* v, int n, MPI_Op op, const char* what) {
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, op, MPI_COMM_WORLD, &req), what);
    wait(req, what, "MPI_Iallreduce");
  }

  /// Arrival notices: on reaching the wait of its k-th collective, a rank
  /// sends k and the collective's name to every peer (tag kArriveTag) and
  /// posts a receive from each. Messages between two ranks do not overtake
  /// one another, so the k-th receive from peer p completes exactly when p
  /// has reached its k-th collective. A rank that times out names the peers
  /// whose notice has not come: the ones that never reached the collective
  /// (stopped, dead, or still at an earlier step), in the same line as its
  /// own wait. A notice of another name means the ranks disagree on which
  /// collectives run: MPI may have matched two different collectives, and
  /// what they moved is not to be used (abort_if_disagreeing).
  struct Notice {
    int64_t k = 0;
    uint64_t name_hash = 0;  // FNV-1a of the whole name: names alike in their first 55 characters still differ
    char name[56] = {0};     // the name's first 55 characters, to print
    bool cut = false;        // the name is longer
  };
  static uint64_t fnv1a(const char* s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; ++s) h = (h ^ uint8_t(*s)) * 1099511628211ull;
    return h;
  }
  struct Arrivals {
    Notice sent;
    std::vector<Notice> got;
    std::vector<MPI_Request> reqs;  // receives of the peers, then sends
    std::vector<int> peer;          // the peer of each receive
  };
  static constexpr int kArriveTag = 7321;

  void announce(Arrivals& a, const char* what) {
    a.sent.k = ++collectives_;
    std::strncpy(a.sent.name, what, sizeof a.sent.name - 1);
    a.sent.name_hash = fnv1a(what);
    a.sent.cut = std::strlen(what) >= sizeof a.sent.name;
    if (a.sent.k == stall_at_ && !stall_inside_) std::raise(SIGSTOP);  // the test hook below
    a.got.assign(size_t(size_), Notice{});
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      a.reqs.emplace_back();
      a.peer.push_back(p);
      check(MPI_Irecv(&a.got[size_t(p)], int(sizeof(Notice)), MPI_BYTE, p, kArriveTag, MPI_COMM_WORLD,
                      &a.reqs.back()),
            what);
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      a.reqs.emplace_back();
      check(MPI_Isend(&a.sent, int(sizeof(Notice)), MPI_BYTE, p, kArriveTag, MPI_COMM_WORLD, &a.reqs.back()), what);
    }
    if (a.sent.k == stall_at_ && stall_inside_) std::raise(SIGSTOP);  // inside: the peers have its notice
  }

  /// Heartbeats: a rank waiting inside its k-th collective sends k to every
  /// peer (tag kBeatTag) every beat interval, and keeps one receive posted
  /// per peer. A rank that times out can then tell, among the peers whose
  /// arrival notice came, the live ones (still waiting: a recent beat of
  /// collective k or later) from the silent ones (stopped or dead inside the
  /// collective), and names the silent ones.
  struct Beat {
    int64_t in = 0, out = 0;  // receive and send buffers
    MPI_Request recv = MPI_REQUEST_NULL, send = MPI_REQUEST_NULL;
    int64_t last = 0;  // the highest collective number heard from this peer
    std::chrono::steady_clock::time_point at{};  // when a beat of `last` came
  };
  static constexpr int kBeatTag = 7322;

  void post_beat_recv(int p) {
    Beat& b = beats_[size_t(p)];
    check(MPI_Irecv(&b.in, 1, MPI_INT64_T, p, kBeatTag, MPI_COMM_WORLD, &b.recv), "heartbeat");
  }

  /// Takes every beat that has come, then sends collective k's beat to each
  /// peer whose previous beat has left (a slow peer skips a beat, never
  /// queues them).
  void beat(int64_t k, bool send) {
    const auto now = std::chrono::steady_clock::now();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      Beat& b = beats_[size_t(p)];
      for (int done = 1; done;) {
        check(MPI_Test(&b.recv, &done, MPI_STATUS_IGNORE), "heartbeat");
        if (!done) break;
        if (b.in >= b.last) {
          b.last = b.in;
          b.at = now;
        }
        post_beat_recv(p);
      }
      if (!send) continue;
      int free = 1;
      if (b.send != MPI_REQUEST_NULL) check(MPI_Test(&b.send, &free, MPI_STATUS_IGNORE), "heartbeat");
      if (!free) continue;
      b.out = k;
      check(MPI_Isend(&b.out, 1, MPI_INT64_T, p, kBeatTag, MPI_COMM_WORLD, &b.send), "heartbeat");
    }
  }

  /// The peers that reached collective k (arrival notice in, per `a`) but
  /// sent no beat of k or later within `quiet`: "1, 3".
  std::string silent_peers(Arrivals& a, int64_t k, std::chrono::steady_clock::duration quiet) {
    beat(k, false);
    const auto now = std::chrono::steady_clock::now();
    std::string out;
    for (size_t i = 0; i < a.peer.size(); ++i) {
      int arrived = 0;
      check(MPI_Test(&a.reqs[i], &arrived, MPI_STATUS_IGNORE), "heartbeat");
      const Beat& b = beats_[size_t(a.peer[i])];
      if (arrived && (b.last < k || now - b.at > quiet)) out += (out.empty() ? "" : ", ") + std::to_string(a.peer[i]);
    }
    return out;
  }

  /// The peers whose notice of this collective has not arrived, as "1, 3".
  std::string missing_peers(Arrivals& a, const char* what) {
    std::string out;
    for (size_t i = 0; i < a.peer.size(); ++i) {
      int done = 0;
      check(MPI_Test(&a.reqs[i], &done, MPI_STATUS_IGNORE), what);
      if (!done) out += (out.empty() ? "" : ", ") + std::to_string(a.peer[i]);
    }
    return out;
  }

  /// Waits for the peers' notices of this collective until `until` (each
  /// one has come when the collective completed), and when one names
  /// another collective, prints both names and aborts the job: the ranks
  /// have left lockstep, and the collective may have matched another one's
  /// buffers (a stage's all-to-all against the board exchange's all-gather),
  /// so nothing it moved can be used.
  void abort_if_disagreeing(Arrivals& a, const char* what, const char* call,
                            std::chrono::steady_clock::time_point until) {
    for (;;) {
      bool all = true;
      for (size_t i = 0; i < a.peer.size(); ++i) {  // the receives (a completed one tests as done again)
        int in = 0;
        if (MPI_Test(&a.reqs[i], &in, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
        all = all && in;
        const Notice& n = a.got[size_t(a.peer[i])];
        if (!in || n.name_hash == a.sent.name_hash) continue;
        std::fprintf(stderr,
                     "moeverify: rank %d (%s, pid %d): collective %s (%s, number %lld): rank %d reached its "
                     "collective number %lld as %.55s%s; the ranks disagree on which collectives run; aborting the "
                     "job\n",
                     rank_, host_name().c_str(), int(getpid()), what, call, (long long)a.sent.k, a.peer[i],
                     (long long)n.k, n.name, n.cut ? "..." : "");
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
        std::_Exit(3);
      }
      if (all || std::chrono::steady_clock::now() >= until) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  /// Polls `req`, then this collective's arrival notices, until they
  /// complete; past the deadline, names this rank, the collective and the
  /// peers that never reached it on stderr and aborts the whole job (a
  /// collective cannot be cancelled, so there is no way back into lockstep
  /// with the peers).
  void wait(MPI_Request& req, const char* what, const char* call) {
    Arrivals a;
    announce(a, what);
    const auto t0 = std::chrono::steady_clock::now();
    // A beat every eighth of the deadline (at least 10 ms apart), the first
    // one an interval in: collectives between running ranks never beat.
    const auto interval = std::max<std::chrono::steady_clock::duration>(g_timeout / 8, std::chrono::milliseconds(10));
    auto next_beat = t0 + interval;
    bool collective_done = false;
    for (long polls = 0;; ++polls) {
      int done = 0;
      if (!collective_done) {
        const int rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) abort_if_disagreeing(a, what, call, t0 + g_timeout);  // the likelier cause
        check(rc, what);
      }
      collective_done = collective_done || done;
      if (collective_done) {  // every peer entered it: their notices are on the way
        int all = 0;
        check(MPI_Testall(int(a.reqs.size()), a.reqs.data(), &all, MPI_STATUSES_IGNORE), what);
        if (all) {
          abort_if_disagreeing(a, what, call, t0);
          return;
        }
      }
      const auto waited = std::chrono::steady_clock::now() - t0;
      if (waited > g_timeout) {
        const std::string missing = missing_peers(a, what);
        const auto quiet = std::max<std::chrono::steady_clock::duration>(g_timeout / 2, 3 * interval);
        const std::string silent = silent_peers(a, a.sent.k, quiet);
        std::string why;
        if (!missing.empty())
          why = "rank(s) " + missing + " never reached it: stopped, dead, or stuck at an earlier step";
        if (!silent.empty())
          why += (why.empty() ? "" : "; ") + ("rank(s) " + silent + " reached it, then fell silent (no heartbeat for " +
                                             fmt_seconds(quiet) + "): stopped or dead inside it");
        if (why.empty()) why = "every peer rank reached it and is still waiting in it";
        std::fprintf(stderr,
                     "moeverify: rank %d (%s, pid %d): collective %s (%s, number %lld) not complete after %.3g s "
                     "(--collective-timeout); %s; aborting the job\n",
                     rank_, host_name().c_str(), int(getpid()), what, call, (long long)a.sent.k,
                     std::chrono::duration<double>(waited).count(), why.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
        std::_Exit(3);
      }
      if (t0 + waited >= next_beat) {
        beat(a.sent.k, true);
        next_beat = t0 + waited + interval;
      }
      // Spin briefly (collectives between running ranks finish in
      // microseconds), then yield the core: ranks may be oversubscribed, so
      // the spin is bounded in polls and in time.
      if (polls < 2000 && waited < std::chrono::milliseconds(2)) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  int rank_ = 0, size_ = 1;
  /// Test hook (tests/mpi_faults.sh): MOEVERIFY_TEST_STOP_AT="R:K" stops rank
  /// R with SIGSTOP on reaching its K-th collective, before its notices, so
  /// that the peers' timeout line must name it as never reaching it;
  /// "R:K:inside" stops it after its notices, inside the exchange, so that
  /// the line must name it as fallen silent.
  int64_t stall_at_ = -1;
  bool stall_inside_ = false;  // "R:K:inside": after its notices, inside the exchange
  std::vector<Beat> beats_;     // per peer (this rank's entry unused)
  int64_t collectives_ = 0;  // collectives this rank has reached (arrival notices)
  bool agreed_failure_ = false;
};

MpiComm* g_world = nullptr;

/// Every rank's string, in rank order (two all-gathers: lengths, then text).
std::vector<std::string> allgather_strings(Comm& w, const std::string& s, const char* what) {
  const size_t R = size_t(w.size());
  std::vector<int64_t> len(R);
  const int64_t mine = int64_t(s.size());
  w.allgather(&mine, sizeof(mine), len.data(), what);
  const size_t mx = size_t(*std::max_element(len.begin(), len.end()));
  std::string padded = s;
  padded.resize(mx, '\0');
  std::vector<char> all(mx * R + 1);
  w.allgather(padded.data(), mx, all.data(), what);
  std::vector<std::string> out;
  for (size_t p = 0; p < R; ++p) out.emplace_back(all.data() + p * mx, size_t(len[p]));
  return out;
}

/// "rank 1" or "ranks 0 2 3".
std::string ranks_str(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? " " : "") + std::to_string(ranks[i]);
  return s;
}

/// Ranks grouped by value, groups ordered by their lowest rank.
template <class T>
std::vector<std::pair<T, std::vector<int>>> group_ranks(const std::vector<T>& v) {
  std::vector<std::pair<T, std::vector<int>>> g;
  for (size_t p = 0; p < v.size(); ++p) {
    auto it = std::find_if(g.begin(), g.end(), [&](const auto& e) { return e.first == v[p]; });
    if (it == g.end()) g.push_back({v[p], {int(p)}});
    else it->second.push_back(int(p));
  }
  return g;
}

std::vector<std::string> split_words(const std::string& s) {
  std::vector<std::string> w;
  std::string cur;
  for (char ch : s) {
    if (ch == ' ') {
      if (!cur.empty()) w.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) w.push_back(cur);
  return w;
}

const char* const kSameInputs = "give every rank the same case files, --set, --case and --fault";

}  // namespace

Comm& mpi_world() {
  if (!g_world) g_world = new MpiComm();
  return *g_world;
}

void mpi_agree_on_case_count(int64_t num_cases) {
  Comm& w = mpi_world();
  std::vector<int64_t> all(size_t(w.size()));
  w.allgather(&num_cases, sizeof(num_cases), all.data(), "case count agreement");
  const auto groups = group_ranks(all);
  if (groups.size() == 1) return;
  std::string msg = "ranks disagree on the number of cases to run:";
  for (const auto& [n, ranks] : groups) msg += " " + ranks_str(ranks) + ": " + std::to_string(n) + ";";
  bad_input(msg + " " + kSameInputs);
}

void mpi_agree_on_case(const std::string& case_name, uint64_t config_hash, const std::string& summary) {
  Comm& w = mpi_world();
  std::vector<uint64_t> all(size_t(w.size()));
  w.allgather(&config_hash, sizeof(config_hash), all.data(), "case configuration agreement");
  const auto groups = group_ranks(all);
  if (groups.size() == 1) return;
  const std::vector<std::string> names = allgather_strings(w, case_name, "case configuration agreement");
  const std::vector<std::string> sums = allgather_strings(w, summary, "case configuration agreement");
  // Each group against the first (the one holding rank 0), by summary words.
  const int r0 = groups[0].second[0];
  const std::vector<std::string> words0 = split_words(sums[size_t(r0)]);
  std::string msg = "ranks disagree on the configuration of case '" + names[size_t(r0)] + "':";
  for (size_t g = 0; g < groups.size(); ++g) {
    const int r = groups[g].second[0];
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(groups[g].first));
    msg += " " + ranks_str(groups[g].second) + ": config hash " + hex;
    if (g == 0) {
      msg += ";";
      continue;
    }
    if (names[size_t(r)] != names[size_t(r0)]) msg += ", case '" + names[size_t(r)] + "'";
    const std::vector<std::string> words = split_words(sums[size_t(r)]);
    std::string mine, theirs;
    for (const auto& x : words)
      if (std::find(words0.begin(), words0.end(), x) == words0.end()) mine += " " + x;
    for (const auto& x : words0)
      if (std::find(words.begin(), words.end(), x) == words.end()) theirs += " " + x;
    if (!mine.empty() || !theirs.empty())
      msg += ", differs in" + (mine.empty() ? std::string(" (none)") : mine) + " (rank " + std::to_string(r0) +
             ":" + (theirs.empty() ? std::string(" (none)") : theirs) + ")";
    else if (names[size_t(r)] == names[size_t(r0)])
      msg += ", differs in a setting the summary omits (tolerance, router.hot_expert, tokens_per_rank, "
             "combine.alias_offset, equal_split.threshold, or --fault)";
    msg += ";";
  }
  bad_input(msg + " " + kSameInputs);
}

void mpi_finalize_if_started() {
  if (!g_world) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return;
  g_world->barrier("finalize");  // under the deadline: MPI_Finalize itself would wait forever for a stopped peer
  g_world->cancel_beats();
  MPI_Finalize();
}
#else
Comm& mpi_world() {
  bad_input("launched under mpirun, but this moeverify was built without MPI (configure with -DMOEVERIFY_MPI=ON)");
}
void mpi_agree_on_case_count(int64_t) { mpi_world(); }
void mpi_agree_on_case(const std::string&, uint64_t, const std::string&) { mpi_world(); }
void mpi_finalize_if_started() {}
#endif

#if !defined(MOEVERIFY_HAVE_CUDA)
Comm& nccl_world(int, std::chrono::milliseconds) {
  runtime_error("communicator nccl: this moeverify was built without CUDA");
}
void nccl_finalize_if_started() {}
#endif

}  // namespace moev
