// MPI communicator: one process per rank, host buffers (Debian's OpenMPI is
// not CUDA-aware). Split consistency is checked with an all-to-all of the send
// counts before every exchange; a mismatch is agreed on by all ranks (an
// all-reduce) so that every rank throws instead of some hanging.
#include <cstdlib>
#include <cstring>

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

#if defined(MOEVERIFY_HAVE_MPI)
namespace {

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
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void alltoallv(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                 const std::vector<int64_t>& recv_rows, size_t row_bytes, const char* what) override {
    std::vector<int64_t> peer_send(size_t(size_), 0);
    check(MPI_Alltoall(send_rows.data(), 1, MPI_INT64_T, peer_send.data(), 1, MPI_INT64_T, MPI_COMM_WORLD), what);
    int64_t bad = -1;
    for (int p = 0; p < size_; ++p)
      if (peer_send[size_t(p)] != recv_rows[size_t(p)]) bad = p;
    int64_t any_bad = bad;
    check(MPI_Allreduce(MPI_IN_PLACE, &any_bad, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD), what);
    if (any_bad >= 0)
      runtime_error(std::string("collective ") + what + " on rank " + std::to_string(rank_) + ": split mismatch" +
                    (bad >= 0 ? ": rank " + std::to_string(bad) + " sends " + std::to_string(peer_send[size_t(bad)]) +
                                    " rows, this rank expects " + std::to_string(recv_rows[size_t(bad)])
                              : " on another rank"));
    MPI_Datatype row;
    check(MPI_Type_contiguous(int(row_bytes ? row_bytes : 1), MPI_BYTE, &row), what);
    MPI_Type_commit(&row);
    std::vector<int> sc(static_cast<size_t>(size_)), sd(static_cast<size_t>(size_)), rc(static_cast<size_t>(size_)), rd(static_cast<size_t>(size_));
    int64_t so = 0, ro = 0;
    for (int p = 0; p < size_; ++p) {
      sc[size_t(p)] = int(send_rows[size_t(p)]);
      sd[size_t(p)] = int(so);
      rc[size_t(p)] = int(recv_rows[size_t(p)]);
      rd[size_t(p)] = int(ro);
      so += send_rows[size_t(p)];
      ro += recv_rows[size_t(p)];
    }
    static char dummy[1];
    check(MPI_Alltoallv(so ? send : dummy, sc.data(), sd.data(), row, ro ? recv : dummy, rc.data(), rd.data(), row,
                        MPI_COMM_WORLD),
          what);
    MPI_Type_free(&row);
  }
  void allreduce_max(int64_t* v, int n, const char* what) override {
    check(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD), what);
  }
  void allreduce_sum(int64_t* v, int n, const char* what) override {
    check(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD), what);
  }
  void allgather(const void* send, size_t bytes, void* recv, const char* what) override {
    static char dummy[1];
    check(MPI_Allgather(bytes ? send : dummy, int(bytes), MPI_BYTE, bytes ? recv : dummy, int(bytes), MPI_BYTE,
                        MPI_COMM_WORLD),
          what);
  }
  void barrier(const char* what) override { check(MPI_Barrier(MPI_COMM_WORLD), what); }
  // Failures are agreed on by the all-reduce after every stage (runner.cpp).
  void abort(const std::string&) override {}

 private:
  int rank_ = 0, size_ = 1;
};

MpiComm* g_world = nullptr;

}  // namespace

Comm& mpi_world() {
  if (!g_world) g_world = new MpiComm();
  return *g_world;
}

void mpi_finalize_if_started() {
  if (!g_world) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}
#else
Comm& mpi_world() {
  bad_input("launched under mpirun, but this moeverify was built without MPI (configure with -DMOEVERIFY_MPI=ON)");
}
void mpi_finalize_if_started() {}
#endif

}  // namespace moev
