#include <cuda_runtime.h>

#include <stdexcept>
#include <vector>

#include "bodies.h"
#include "cuda_exec.h"

namespace moev::cuda {
namespace {

#define MOEV_CUDA_CHECK(expr)                                                                   \
  do {                                                                                          \
    const cudaError_t e_ = (expr);                                                              \
    if (e_ != cudaSuccess)                                                                      \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorName(e_) + " (" +        \
                               cudaGetErrorString(e_) + ")");                                   \
  } while (0)

template <class Body>
__global__ void items_kernel(Body body, int64_t n) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) body(i, int(threadIdx.x), int(blockDim.x));
}

template <class Body>
void launch(const Body& body, int64_t n) {
  if (n == 0) return;
  const unsigned blocks = unsigned(n < 65535 ? n : 65535);
  items_kernel<<<blocks, 128>>>(body, n);
  MOEV_CUDA_CHECK(cudaGetLastError());
  MOEV_CUDA_CHECK(cudaDeviceSynchronize());
}

/// A device copy of a host buffer, copied back on request; freed on scope exit.
struct Staged {
  void* d = nullptr;
  size_t bytes = 0;
  Staged(const void* host, size_t n) : bytes(n) {
    if (n == 0) return;
    MOEV_CUDA_CHECK(cudaMalloc(&d, n));
    if (host) MOEV_CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
  }
  ~Staged() { if (d) cudaFree(d); }
  void back(void* host) const { if (bytes) MOEV_CUDA_CHECK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost)); }
  template <class T> T* as() const { return static_cast<T*>(d); }
};

}  // namespace

DeviceStatus probe() {
  DeviceStatus s;
  int n = 0;  // left unwritten on error
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    s.message = e != cudaSuccess ? std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e) : "no CUDA device";
    cudaGetLastError();
    return s;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  s.count = n;
  s.message = p.name;
  return s;
}

void dispatch_gather(DType dt, k::ScoreApply apply, const void* x, int64_t T, const int32_t* perm,
                     const float* topk_scores, int64_t N, int64_t D, int K, void* routed, int32_t* token_sorted,
                     float* score_sorted, int32_t* row_of, k::ScoreMultiply smul) {
  dispatch_dtype(dt, [&](auto tag) {
    using T_ = decltype(tag);
    Staged dx(x, size_t(T * D) * sizeof(T_)), dp(perm, size_t(N) * 4), ds(topk_scores, size_t(N) * 4);
    Staged dr(nullptr, size_t(N * D) * sizeof(T_)), dt_(nullptr, size_t(N) * 4), dss(nullptr, size_t(N) * 4),
        drow(nullptr, size_t(N) * 4);
    launch(k::GatherBody<T_>{dx.as<T_>(), dp.as<int32_t>(), ds.as<float>(), dr.as<T_>(), dt_.as<int32_t>(),
                             dss.as<float>(), drow.as<int32_t>(), D, K, apply, smul},
           N);
    dr.back(routed);
    dt_.back(token_sorted);
    dss.back(score_sorted);
    drow.back(row_of);
  });
}

void combine(const CombineArgs& a, int64_t N, const void* init, void* out) {
  dispatch_dtype(a.dt, [&](auto tag) {
    using T_ = decltype(tag);
    const size_t td = size_t(a.T * a.D) * sizeof(T_);
    Staged dro(a.routed_out, size_t(N * a.D) * sizeof(T_)), ds(a.score_sorted, size_t(N) * 4),
        drow(a.row_of, size_t(a.T * a.K) * 4), dinit(init, td),
        dsh(a.shared, a.shared_add == k::SharedAdd::add_after ? td : 0), dout(nullptr, td);
    launch(k::CombineBody<T_>{dro.as<T_>(), ds.as<float>(), drow.as<int32_t>(), dinit.as<T_>(), dsh.as<T_>(),
                              dout.as<T_>(), a.D, a.K, a.apply, a.acc, a.shared_add, k::CombineOrder::ascending_row,
                              a.smul},
           a.T);
    dout.back(out);
  });
}

}  // namespace moev::cuda
