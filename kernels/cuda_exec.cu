#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bodies.h"
#include "cuda_exec.h"
#include "gemm_plan.h"
#include "host_exec.h"

namespace moev::cuda {
namespace {

#define MOEV_CUDA_CHECK(expr)                                                                   \
  do {                                                                                          \
    const cudaError_t e_ = (expr);                                                              \
    if (e_ != cudaSuccess)                                                                      \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorName(e_) + " (" +        \
                               cudaGetErrorString(e_) + ")");                                   \
  } while (0)

// Item = a group of `lanes` threads, lane = thread within it: a block of
// blockDim.x threads holds blockDim.x / lanes items at a time, so a row
// body whose rows need one warp runs four rows per 128-thread block.
template <class Body>
__global__ void items_kernel(Body body, int64_t n, int lanes) {
  const int per_block = int(blockDim.x) / lanes;
  const int lane = int(threadIdx.x) % lanes;
  for (int64_t i = int64_t(blockIdx.x) * per_block + int(threadIdx.x) / lanes; i < n;
       i += int64_t(gridDim.x) * per_block)
    body(i, lane, lanes);
}

// A thread-per-item body (host_exec.h kThreadPerItem): item = thread, lane 0 of 1.
template <class Body>
__global__ void thread_items_kernel(Body body, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    body(i, 0, 1);
}

// The combine with its row pieces staged in shared memory (CudaDevice::body
// under MOEVERIFY_CUDA_COMBINE_STAGED=on): items and lanes as items_kernel,
// each thread with k::CombineBody::kStagedPieces pieces of shared memory; a
// token whose rows are aligned goes through the body's lane_staged (cp.async
// copies of the next step's pieces in flight while the current step's are
// added; the same bits), another through the body itself.
template <class T, int W>
__global__ void combine_staged_kernel(k::CombineBody<T, W> b, int64_t n, int lanes) {
  static_assert(W * sizeof(T) == 16, "a staged piece is 16 bytes");
  extern __shared__ __align__(16) k::Piece staged[];  // cp.async's 16-byte copies need 16-byte slots
  k::Piece* area = staged + threadIdx.x * k::CombineBody<T, W>::kStagedPieces;
  const int per_block = int(blockDim.x) / lanes;
  const int lane = int(threadIdx.x) % lanes;
  for (int64_t t = int64_t(blockIdx.x) * per_block + int(threadIdx.x) / lanes; t < n;
       t += int64_t(gridDim.x) * per_block) {
    const int64_t first = int64_t(lane) * W;
    if (!b.pieces_aligned(t, first)) {
      b(t, lane, lanes);
      continue;
    }
    int32_t rows[k::kMaxTopK];
    const int nr = b.sorted_rows(t, rows);
    b.lane_staged(t, rows, nr, first, int64_t(lanes) * W, area);
  }
}

// Device work goes on the calling host thread's own stream
// (cudaStreamPerThread): in-process EP ranks are threads, each with its own
// stream. Every call waits for its work before it returns (kernels/device.h).
inline cudaStream_t thread_stream() { return cudaStreamPerThread; }

/// Multiprocessors of the calling thread's current GPU (a process uses one).
int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    cudaGetDevice(&dev);
    return cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0 ? v : 1;
  }();
  return n;
}

/// The launch of items [0, n) at `lanes` threads an item (items_kernel and
/// combine_staged_kernel): blocks of 128 threads (of `lanes` where that is
/// more), at most 65,535 of them (the kernels stride over the rest).
struct ItemsGrid {
  unsigned blocks, threads;
};
inline ItemsGrid items_grid(int64_t n, int lanes) {
  const int threads = lanes >= 128 ? lanes : lanes * (128 / lanes);
  const int64_t blocks = (n + threads / lanes - 1) / (threads / lanes);
  return {unsigned(blocks < 65535 ? blocks : 65535), unsigned(threads)};
}

/// Enqueues body over items [0, n) on the calling thread's stream, `lanes`
/// threads an item (a multiple of 32, or a divisor of 128), without waiting.
template <class Body>
void enqueue(const Body& body, int64_t n, int lanes = 128) {
  if (n == 0) return;
  if constexpr (thread_per_item<Body>::value) {
    // A thread's item is a long serial chain (the router: K scans over E
    // experts), so the items are spread over every SM first: blocks of one
    // warp until the SMs hold two blocks each, then 128 threads.
    const int threads = n >= 128 * 2 * int64_t(sm_count()) ? 128 : 32;
    const int64_t blocks = (n + threads - 1) / threads;
    thread_items_kernel<<<unsigned(blocks < 65535 ? blocks : 65535), unsigned(threads), 0, thread_stream()>>>(body, n);
  } else {
    const ItemsGrid g = items_grid(n, lanes);
    items_kernel<<<g.blocks, g.threads, 0, thread_stream()>>>(body, n, lanes);
  }
  MOEV_CUDA_CHECK(cudaGetLastError());
}

/// enqueue, then wait for it (the staged entry points below).
template <class Body>
void launch(const Body& body, int64_t n, int lanes = 128) {
  enqueue(body, n, lanes);
  MOEV_CUDA_CHECK(cudaStreamSynchronize(thread_stream()));
}

/// Lanes for the row-moving bodies: by the row's bytes (k::row_lanes).
template <class T> int lanes_of(const k::GatherBody<T>& b) { return k::row_lanes(b.D * int64_t(sizeof(T))); }
template <class T> int lanes_of(const k::ScatterRowsBody<T>& b) { return k::row_lanes(b.D * int64_t(sizeof(T))); }
/// The value of environment variable `name`, one of `valid` (the first when
/// it is unset), for the executor's timing knobs; any other value is an
/// error that names the valid ones.
std::string env_choice(const char* name, std::initializer_list<const char*> valid) {
  const char* v = std::getenv(name);
  if (!v) return *valid.begin();
  std::string list;
  for (const char* c : valid) {
    if (std::string(v) == c) return v;
    list += std::string(list.empty() ? "" : ", ") + c;
  }
  throw std::runtime_error(std::string(name) + "=" + v + ": valid are " + list);
}

/// Threads a token for the combine: the row's pieces (k::row_lanes) up to
/// two warps. A lane then walks 14 pieces of a DeepSeek-V3 row (D = 7168,
/// bf16), so a token's row list and scores, read before its first piece, are
/// paid once for more loads: on an H200 (2026-11-27, one rank, T = 4096,
/// K = 8) the combine ran at 57% of a device copy with 64 threads a token
/// and 52% with 256. MOEVERIFY_CUDA_COMBINE_LANES (32, 64, 128 or 256)
/// overrides the cap, for timing the choice on another GPU (the kit's
/// KIT_COMBINE_AB; the output's bits do not depend on it).
int combine_lanes_cap() {
  static const int cap = std::stoi(env_choice("MOEVERIFY_CUDA_COMBINE_LANES", {"64", "32", "128", "256"}));
  return cap;
}
template <class T, int W> int lanes_of(const k::CombineBody<T, W>& b) {
  return std::min(k::row_lanes(b.D * int64_t(sizeof(T))), combine_lanes_cap());
}
/// How the combine's aligned rows run on the device, all with the same
/// bits, for timing them on a GPU (the kit's KIT_COMBINE_AB):
/// - spans: k::CombineBody, k::CombineBody::kBatch (4) routed rows' pieces
///   loaded before the first is added (the default);
/// - spans8: k::CombineBatchBody, eight at a time
///   (MOEVERIFY_CUDA_COMBINE_BATCH=8);
/// - staged: combine_staged_kernel, the pieces staged in shared memory by
///   cp.async (MOEVERIFY_CUDA_COMBINE_STAGED=on, which takes precedence;
///   off by default: never yet run on a device).
enum class CombineWay { spans, spans8, staged };
static_assert(k::CombineBody<bf16, 8>::kBatch == 4, "MOEVERIFY_CUDA_COMBINE_BATCH's default names CombineBody's batch");
CombineWay combine_way() {
  static const CombineWay w = [] {
    if (env_choice("MOEVERIFY_CUDA_COMBINE_STAGED", {"off", "on"}) == "on") return CombineWay::staged;
    return env_choice("MOEVERIFY_CUDA_COMBINE_BATCH", {"4", "8"}) == "8" ? CombineWay::spans8 : CombineWay::spans;
  }();
  return w;
}

/// Whether device memory comes as it did before the pool and the block
/// cache (CudaDevice::alloc): MOEVERIFY_CUDA_ALLOC=plain, every buffer by
/// cudaMalloc and cudaFree (the block cache keeping nothing) and the pool
/// handing back all it does not use at each synchronisation, for timing the
/// two on a GPU (the kit's KIT_ALLOC_AB); `cached`, the default, otherwise.
bool alloc_plain() {
  static const bool plain = env_choice("MOEVERIFY_CUDA_ALLOC", {"cached", "plain"}) == "plain";
  return plain;
}

/// Enqueues combine_staged_kernel over tokens [0, n) as enqueue() would the
/// body: `lanes` threads a token, 128-thread blocks (or `lanes`), each
/// thread with k::CombineBody::kStagedPieces pieces of shared memory.
template <class T, int W>
void enqueue_combine_staged(const k::CombineBody<T, W>& body, int64_t n, int lanes) {
  if (n == 0) return;
  const ItemsGrid g = items_grid(n, lanes);
  const size_t smem = size_t(g.threads) * k::CombineBody<T, W>::kStagedPieces * sizeof(k::Piece);
  static const bool carved = [] {  // as much shared memory an SM as the blocks that fit want
    MOEV_CUDA_CHECK(cudaFuncSetAttribute(combine_staged_kernel<T, W>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
    return true;
  }();
  (void)carved;
  combine_staged_kernel<T, W><<<g.blocks, g.threads, smem, thread_stream()>>>(body, n, lanes);
  MOEV_CUDA_CHECK(cudaGetLastError());
}
template <class T> int lanes_of(const k::RowMapBody<T>& b) { return k::row_lanes(b.D * int64_t(sizeof(T))); }
template <class T, class M> int lanes_of(const k::FnRowMapBody<T, M>& b) { return k::row_lanes(b.D * int64_t(sizeof(T))); }
template <class Body> int lanes_of(const Body&) { return 128; }

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
    const k::GatherBody<T_> body{dx.as<T_>(), dp.as<int32_t>(), ds.as<float>(), dr.as<T_>(), dt_.as<int32_t>(),
                                 dss.as<float>(), drow.as<int32_t>(), D, K, apply, smul};
    launch(body, N, lanes_of(body));
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
    const k::CombineBody<T_, k::kDeviceSpan<T_>> body{
        dro.as<T_>(), ds.as<float>(),    drow.as<int32_t>(), dinit.as<T_>(), dsh.as<T_>(),
        dout.as<T_>(), a.D,              a.K,                a.apply,        a.acc,
        a.shared_add,  k::CombineOrder::ascending_row,       a.smul};
    launch(body, a.T, lanes_of(body));
    dout.back(out);
  });
}

}  // namespace moev::cuda

// --- the CUDA device (kernels/device.h) ----------------------------------------

namespace moev::cuda {
namespace {

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The sum over 8-byte words (zero-padded tail) of mix64(word ^ mix64(index)),
// as the emulated device computes it; sums commute, so atomics keep it exact.
__global__ void hash_kernel(const uint8_t* p, size_t n, unsigned long long* out) {
  const size_t words = (n + 7) / 8;
  unsigned long long h = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t w = 0;
    const size_t nb = n - i * 8 < 8 ? n - i * 8 : 8;
    for (size_t b = 0; b < nb; ++b) w |= uint64_t(p[i * 8 + b]) << (8 * b);
    h += mix64(w ^ mix64(i));
  }
  atomicAdd(out, h);
}

// Sort keys (expert, N-1-a) packed in 64 bits (the planted fault
// unstable_sort: descending a within an expert); values a.
__global__ void sort_keys_kernel(const int32_t* ids, int64_t N, uint64_t* keys, int32_t* vals) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < N; a += int64_t(gridDim.x) * blockDim.x) {
    keys[a] = uint64_t(ids[a]) * uint64_t(N) + uint64_t(N - 1 - a);
    vals[a] = int32_t(a);
  }
}

// Values a = 0, 1, ..., N - 1.
__global__ void iota_kernel(int64_t N, int32_t* vals) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < N; a += int64_t(gridDim.x) * blockDim.x)
    vals[a] = int32_t(a);
}

// counts[e] = #{a : ids[a] == e} for e in [0, E) (ids outside are not
// counted, as HistogramBody), counts zeroed before. Per-block counters in
// shared memory where E fits (`shared`), then one global add per expert.
__global__ void histogram_kernel(const int32_t* ids, int64_t N, int E, bool shared, unsigned long long* counts) {
  extern __shared__ unsigned int local[];
  if (shared)
    for (int e = threadIdx.x; e < E; e += blockDim.x) local[e] = 0;
  __syncthreads();
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < N; a += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[a];
    if (e < 0 || e >= E) continue;
    if (shared) atomicAdd(&local[e], 1u);
    else atomicAdd(&counts[e], 1ull);
  }
  if (!shared) return;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (local[e]) atomicAdd(&counts[e], (unsigned long long)local[e]);
}

// cuBLAS is loaded when the first GEMM runs, not linked: mapping libcublas
// and libcublasLt at start-up costs every process about 220 MB resident
// (measured), host runs and MPI ranks included.
struct Blas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*, const void*,
                         cudaDataType, int, const void*, cudaDataType, int, const void*, void*, cudaDataType, int,
                         cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  /// cublasGemmGroupedBatchedEx (cuBLAS 12.5 and later); null where the
  /// library lacks it, and gemm_group then enqueues the single GEMMs.
  decltype(&cublasGemmGroupedBatchedEx) gemm_grouped = nullptr;
  /// cublasGemmBatchedEx: gemm_group's GEMMs of one shape (GroupMode).
  cublasStatus_t (*gemm_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                 const void* const*, cudaDataType, int, const void* const*, cudaDataType, int,
                                 const void*, void* const*, cudaDataType, int, int, cublasComputeType_t,
                                 cublasGemmAlgo_t) = nullptr;
};

/// How gemm_group enqueues its jobs (MOEVERIFY_CUDA_GEMM_GROUP):
/// - `auto` (the default): the jobs of one shape as one cublasGemmBatchedEx
///   and every other job as one cublasGemmEx (k::plan_gemm_units), these
///   calls spread over gemm_streams() streams of their own, largest first.
///   On an H100 (2026-11-28, a52630d) DeepSeek-V3's grouped SwiGLU forward
///   (16 experts of 512 rows, D 7168, F 2048) ran at 61.6% of one GEMM of
///   the same FLOPs as batched calls, at 45-50% as single GEMMs over 2-8
///   streams and at 31% as one grouped call. Experts of unequal counts have
///   shapes of their own, so there the single GEMMs fill the GPU side by
///   side, the way TransformerEngine's grouped linear layers run on several
///   streams.
/// - `streams`: every job as one cublasGemmEx over those streams;
/// - `batched`: auto's calls, all on the calling thread's stream;
/// - `grouped`: one cublasGemmGroupedBatchedEx per output type.
/// The kit's KIT_GEMM_AB times each on a GPU. Every way gives each GEMM's
/// sums in fp32 and one rounding (outputs compared with the `gemm`
/// tolerance, docs/contract.md); which stream or call runs a job may change
/// its last bits, never from one run to the next.
enum class GroupMode { automatic, streams, grouped, batched };
GroupMode gemm_group_mode() {
  static const GroupMode m = [] {
    const std::string v = env_choice("MOEVERIFY_CUDA_GEMM_GROUP", {"auto", "streams", "grouped", "batched"});
    return v == "grouped"   ? GroupMode::grouped
           : v == "batched" ? GroupMode::batched
           : v == "streams" ? GroupMode::streams
                            : GroupMode::automatic;
  }();
  return m;
}
/// The streams of gemm_group's fan (MOEVERIFY_CUDA_GEMM_STREAMS: 2, 4, 8 or
/// 16). Four GEMMs of 512 x 2048 x 7168 in 128 x 256 tiles are 128 blocks,
/// about an H100's or H200's 132 SMs. On an H100 (2026-11-28) DeepSeek-V3's
/// forward as single GEMMs ran at 50.2%, 46.4% and 45.1% of one same-FLOP
/// GEMM on 2, 4 and 8 streams: equal shapes, where `auto` now batches them;
/// unequal counts, smaller GEMMs, want more side by side (not yet timed).
int gemm_streams() {
  static const int n = std::stoi(env_choice("MOEVERIFY_CUDA_GEMM_STREAMS", {"4", "2", "8", "16"}));
  return n;
}

const Blas& blas() {
  static const Blas b = [] {
    void* h = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h) throw std::runtime_error(std::string("cannot load cuBLAS: ") + dlerror());
    Blas r;
    r.create = reinterpret_cast<decltype(r.create)>(dlsym(h, "cublasCreate_v2"));
    r.destroy = reinterpret_cast<decltype(r.destroy)>(dlsym(h, "cublasDestroy_v2"));
    r.set_stream = reinterpret_cast<decltype(r.set_stream)>(dlsym(h, "cublasSetStream_v2"));
    r.set_math_mode = reinterpret_cast<decltype(r.set_math_mode)>(dlsym(h, "cublasSetMathMode"));
    r.gemm = reinterpret_cast<decltype(r.gemm)>(dlsym(h, "cublasGemmEx"));
    r.gemm_grouped = reinterpret_cast<decltype(r.gemm_grouped)>(dlsym(h, "cublasGemmGroupedBatchedEx"));
    r.gemm_batched = reinterpret_cast<decltype(r.gemm_batched)>(dlsym(h, "cublasGemmBatchedEx"));
    if (!r.create || !r.destroy || !r.set_stream || !r.set_math_mode || !r.gemm)
      throw std::runtime_error(
          "libcublas.so.13 lacks cublasCreate_v2, cublasSetStream_v2, cublasSetMathMode or cublasGemmEx");
    return r;
  }();
  return b;
}

#define MOEV_CUBLAS_CHECK(expr)                                                                       \
  do {                                                                                                \
    const cublasStatus_t s_ = (expr);                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string(#expr) + ": cuBLAS status " + std::to_string(int(s_))); \
  } while (0)

struct Event {
  cudaEvent_t e = nullptr;
  Event() { MOEV_CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() { cudaEventDestroy(e); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

class CudaDevice final : public BodyDevice<CudaDevice> {
 public:
  CudaDevice(int ordinal, std::string name) : ordinal_(ordinal), name_(std::move(name)) { keep_pool_memory(); }
  ~CudaDevice() override {
    bind();  // big_ frees its kept blocks after this
    for (cublasHandle_t h : handles_) blas().destroy(h);
    for (void* p : iotas_) big_.give(p);
  }
  std::string name() const override { return name_; }
  // cudaMalloc and cudaFree synchronise every stream of the device, and
  // in-process ranks allocate and free at every entry point (temporaries,
  // each call's outputs), so each rank's allocations stalled the kernels of
  // the ranks beside it. Device memory below kPooledBytes (temporaries,
  // small outputs, the hash's word) comes from the stream-ordered pool,
  // waited for before it is returned so that any stream may use it (alloc's
  // contract); larger blocks from cudaMalloc, and once freed they are kept
  // for the next allocation of the same size, up to kKeptBytes (BlockCache:
  // a bench repeats each stage's calls with the same shapes; 4 GiB holds
  // the routed rows of DeepSeek-V3's 8 ranks, 3.8 GB, and leaves the rest
  // of the device to other processes sharing it).
  static constexpr size_t kPooledBytes = size_t(64) << 20;
  static constexpr size_t kKeptBytes = size_t(4) << 30;
  void* alloc(size_t bytes) override {
    bind();
    void* p = nullptr;
    if (bytes >= kPooledBytes || alloc_plain()) {
      p = big_.take(bytes);
      if (!p)
        throw std::runtime_error("cudaMalloc(" + std::to_string(bytes) + " bytes): out of device memory");
      return p;
    }
    MOEV_CUDA_CHECK(cudaMallocAsync(&p, bytes, thread_stream()));
    MOEV_CUDA_CHECK(cudaStreamSynchronize(thread_stream()));
    std::lock_guard<std::mutex> lk(pooled_m_);
    pooled_.insert(p);
    return p;
  }
  // Every call is complete when the Mirror frees a buffer: no stream still
  // reads it, so a pooled one goes back to the pool in this thread's stream.
  void release(void* p) override {
    bind();
    bool pooled = false;
    {
      std::lock_guard<std::mutex> lk(pooled_m_);
      pooled = pooled_.erase(p) > 0;
    }
    if (pooled)
      cudaFreeAsync(p, thread_stream());
    else
      big_.give(p);
  }
  // Every call is complete on return: the next call may come from another
  // rank's thread (another stream), or be NCCL's own stream. The local
  // Communicator's receivers copy from their senders' buffers, which the
  // senders reuse once all have met: a copy must have landed.
  void upload(void* d, const void* s, size_t n) override { transfer(d, s, n, cudaMemcpyHostToDevice); }
  void download(void* d, const void* s, size_t n) override { transfer(d, s, n, cudaMemcpyDeviceToHost); }
  void copy(void* d, const void* s, size_t n) override { transfer(d, s, n, cudaMemcpyDeviceToDevice); }
  void fill(void* d, uint8_t b, size_t n) override {
    bind();
    MOEV_CUDA_CHECK(cudaMemsetAsync(d, b, n, thread_stream()));
    MOEV_CUDA_CHECK(cudaStreamSynchronize(thread_stream()));
  }
  // timed() waits for its stop event: complete on return, as every call is.
  void fill_timed(void* d, uint8_t b, size_t n) override {
    timed("fill", [&] { MOEV_CUDA_CHECK(cudaMemsetAsync(d, b, n, thread_stream())); });
  }
  void copy_timed(void* d, const void* s, size_t n) override {
    timed("copy", [&] { MOEV_CUDA_CHECK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, thread_stream())); });
  }
  uint64_t hash(const void* p, size_t n) override {
    if (n == 0) return 0;
    bind();
    unsigned long long* h = static_cast<unsigned long long*>(alloc(8));
    unsigned long long v = 0;
    try {
      MOEV_CUDA_CHECK(cudaMemsetAsync(h, 0, 8, thread_stream()));
      const size_t words = (n + 7) / 8;
      const unsigned blocks = unsigned(std::min<size_t>((words + 255) / 256, 4096));
      hash_kernel<<<blocks, 256, 0, thread_stream()>>>(static_cast<const uint8_t*>(p), n, h);
      MOEV_CUDA_CHECK(cudaGetLastError());
      MOEV_CUDA_CHECK(cudaMemcpyAsync(&v, h, 8, cudaMemcpyDeviceToHost, thread_stream()));
      MOEV_CUDA_CHECK(cudaStreamSynchronize(thread_stream()));
    } catch (...) {
      release(h);
      throw;
    }
    release(h);
    return v;
  }
  double busy_seconds() const override { return double(busy_ns_.load()) * 1e-9; }
  void window_begin() override {
    bind();
    std::lock_guard<std::mutex> lk(window_m_);
    MOEV_CUDA_CHECK(cudaEventRecord(window_ref_.e, thread_stream()));
    MOEV_CUDA_CHECK(cudaEventSynchronize(window_ref_.e));
    window_.begin();
  }
  double window_end() override {
    std::lock_guard<std::mutex> lk(window_m_);
    return window_.end();
  }
  std::vector<WindowPart> window_parts() override {
    std::lock_guard<std::mutex> lk(window_m_);
    return window_.parts();
  }
  double timed_copy(void* d, const void* s, size_t n) override {
    return timed("copy", [&] { MOEV_CUDA_CHECK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, thread_stream())); }, false);
  }
  using BodyDevice::run;
  /// A body over [0, n) on the calling thread's stream, timed (BodyDevice's
  /// run overrides call it).
  template <class Body>
  void body(const Body& b, int64_t n) {
    timed(part_name<Body>(), [&] { enqueue(b, n, lanes_of(b)); });
  }
  template <class T, int W>
  void body(const k::CombineBody<T, W>& b, int64_t n) {
    timed(part_name<k::CombineBody<T, W>>(), [&] {
      if constexpr (W * sizeof(T) == 16) {
        if (combine_way() == CombineWay::staged) return enqueue_combine_staged(b, n, lanes_of(b));
        if (combine_way() == CombineWay::spans8) return enqueue(k::CombineBatchBody<T, W, 8>{b}, n, lanes_of(b));
      }
      enqueue(b, n, lanes_of(b));
    });
  }
  // Counts are integers: atomics give the same counts in any order, where
  // the body (one thread an expert walking every assignment) took one
  // thread 262,144 loads per expert at DeepSeek-V3 size.
  void run(const HistogramBody& b, int64_t n) override {
    if (n == 0) return;
    timed(part_name<HistogramBody>(), [&] {
      MOEV_CUDA_CHECK(cudaMemsetAsync(b.counts, 0, size_t(n) * 8, thread_stream()));
      if (b.N == 0) return;
      const int E = int(n);
      const size_t smem = E <= 12288 ? size_t(E) * 4 : 0;
      const int64_t blocks = std::min<int64_t>((b.N + 1023) / 1024, 1024);
      histogram_kernel<<<unsigned(blocks), 256, smem, thread_stream()>>>(b.ids, b.N, E, smem > 0,
                                                                         reinterpret_cast<unsigned long long*>(b.counts));
      MOEV_CUDA_CHECK(cudaGetLastError());
    });
  }

  // CUB radix sort (sort_pairs): ascending a within an expert, or
  // descending under the planted fault unstable_sort.
  void sort(const int32_t* ids, int64_t N, int E, int32_t* perm, bool descending_within) override {
    if (N == 0) return;
    timed("sort", [&] { sort_pairs(ids, N, E, perm, descending_within); });
  }

  // logits (T, E) row-major = x (T, D) wg^T: column-major, logits^T (E x T) =
  // wg^T (E x D; wg is D x E column-major) times x^T (D x T; x is D x T
  // column-major). fp32 output.
  void gemm_logits(DType dt, const void* x, const void* wg, int64_t T, int64_t D, int E, float* logits) override {
    gemm_ex(call(dt, CUBLAS_OP_T, CUBLAS_OP_N, E, T, D, wg, D, x, D, logits, CUDA_R_32F, E));
  }

  // The single GEMMs: one job each, as call_of maps it to column-major.
  void gemm_nt(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
               int64_t ldy) override {
    gemm_ex(call_of(dt, {GemmOp::nt, X, W, Y, rows, k, n, ldx, 0, ldy}));
  }
  void gemm_nn(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
               int64_t ldy) override {
    gemm_ex(call_of(dt, {GemmOp::nn, X, W, Y, rows, k, n, ldx, 0, ldy}));
  }

  // fp32 output (a cublasGemmEx combination for bf16 and fp16 inputs too).
  void gemm_tn_f32(DType dt, const void* A, int64_t rows, int64_t m, int64_t lda, const void* B, int64_t n,
                   int64_t ldb, float* C) override {
    gemm_ex(call_of(dt, {GemmOp::tn_f32, A, B, C, rows, m, n, lda, ldb, 0}));
  }

  // The jobs as column-major calls (call_of), enqueued as gemm_group_mode()
  // says, one wait in all:
  // - auto, streams, batched: the plan's calls (k::plan_gemm_units,
  //   enqueue_planned), over the fan's streams or on the caller's;
  // - grouped: one cublasGemmGroupedBatchedEx per output type (act, fp32),
  //   consecutive jobs of equal shape sharing a group.
  // The batched and grouped calls need dt other than fp32 (fp32 GEMMs use
  // the pedantic compute type, which they do not take) and a cuBLAS that has
  // them; else a job is a single GEMM. A job whose operands are not all
  // 16-byte aligned (operands_aligned16) goes alone through cublasGemmEx:
  // on an H200 (cuBLAS 13) the grouped call gave wrong sums for the SwiGLU
  // experts at hidden = 1 (rows of 2 bytes), which the single call gets right.
  void gemm_group(DType dt, const std::vector<GemmJob>& jobs) override {
    if (jobs.empty()) return;
    const GroupMode mode = gemm_group_mode();
    const bool dt_taken = dt != DType::fp32;  // fp32's pedantic compute type: neither grouped nor batched
    std::vector<Call> calls;
    for (const GemmJob& j : jobs) calls.push_back(call_of(dt, j));
    std::string path;
    if (mode == GroupMode::grouped && dt_taken && blas().gemm_grouped) {
      path = enqueue_grouped_calls(dt, calls);
    } else {
      const bool wants_batch = mode == GroupMode::automatic || mode == GroupMode::batched;
      const bool batch = wants_batch && dt_taken && blas().gemm_batched;
      std::vector<bool> batchable(calls.size());
      for (size_t i = 0; i < calls.size(); ++i) batchable[i] = batch && operands_aligned16(calls[i]);
      const int streams = mode == GroupMode::batched ? 1 : gemm_streams();
      const std::vector<k::GemmUnit> units = k::plan_gemm_units(
          calls.size(), batchable, [&](size_t a, size_t b) { return same_shape(calls[a], calls[b]); },
          [&](size_t i) { return flops(calls[i]); }, streams);
      if (units.size() > 1 && streams > 1) {
        FanLease f(*this);
        timed("gemm_group", [&] { path = enqueue_planned(f.fan, f.fan->handles, calls, units); });
      } else {
        Lease h(*this);
        timed("gemm_group", [&] { path = enqueue_planned(nullptr, {h.h}, calls, units); });
      }
      if (mode == GroupMode::grouped || (wants_batch && !batch))
        path += std::string(" (no ") + (mode == GroupMode::grouped ? "grouped" : "batched") + " call: " +
                (!dt_taken ? "fp32's pedantic compute type" : "this cuBLAS lacks it") + ")";
    }
    std::lock_guard<std::mutex> lk(blas_m_);
    ++group_calls_.calls;
    group_calls_.path = path;
  }
  GroupCalls gemm_group_calls() const override {
    std::lock_guard<std::mutex> lk(blas_m_);
    return group_calls_;
  }

 private:
  /// Device memory for the calling thread's stream, freed in stream order:
  /// the pool keeps it for the next call (cudaMallocAsync), so a sort's
  /// scratch costs no cudaMalloc/cudaFree, whose implicit synchronisation
  /// stalled every rank's stream.
  struct StreamBuffer {
    void* d = nullptr;
    explicit StreamBuffer(size_t n) { MOEV_CUDA_CHECK(cudaMallocAsync(&d, std::max<size_t>(n, 1), thread_stream())); }
    ~StreamBuffer() { cudaFreeAsync(d, thread_stream()); }
    template <class T> T* as() const { return static_cast<T*>(d); }
  };

  /// The expert sort: CUB's radix sort is stable, so sorting the expert ids
  /// (k::radix_key_bits(E) bits) with the values a in ascending order keeps
  /// ascending a within an expert. The planted fault sorts packed
  /// (expert, N-1-a) keys instead, descending a within one.
  void sort_pairs(const int32_t* ids, int64_t N, int E, int32_t* perm, bool descending_within) {
    if (descending_within) {
      const unsigned blocks = unsigned(std::min<int64_t>((N + 255) / 256, 65535));
      StreamBuffer vals(size_t(N) * 4);
      size_t temp_bytes = 0;
      const int bits = k::radix_key_bits(uint64_t(E) * uint64_t(N));
      StreamBuffer keys(size_t(N) * 8), keys_out(size_t(N) * 8);
      sort_keys_kernel<<<blocks, 256, 0, thread_stream()>>>(ids, N, keys.as<uint64_t>(), vals.as<int32_t>());
      MOEV_CUDA_CHECK(cudaGetLastError());
      MOEV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.as<uint64_t>(), keys_out.as<uint64_t>(),
                                                      vals.as<int32_t>(), perm, N, 0, bits, thread_stream()));
      StreamBuffer temp(temp_bytes);
      MOEV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.d, temp_bytes, keys.as<uint64_t>(), keys_out.as<uint64_t>(),
                                                      vals.as<int32_t>(), perm, N, 0, bits, thread_stream()));
      return;
    }
    // One scratch allocation (the sorted keys, then CUB's temp at a 256-byte
    // boundary), the values from the kept iota, CUB's temp size asked once
    // per shape: on an H100 the sort's intervals were 84% the host's
    // enqueuing (2026-11-28, DeepSeek-V3 EP 8), three allocations, three
    // frees, an iota launch and two CUB dispatches a call among them.
    const int bits = k::radix_key_bits(uint64_t(E));
    const int32_t* vals = iota(N);
    // ids are non-negative expert ids below E: as unsigned keys they sort alike
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(ids);
    const size_t keys_bytes = (size_t(N) * 4 + 255) / 256 * 256;
    const size_t temp_bytes = sort_temp_bytes(N, bits);
    StreamBuffer scratch(keys_bytes + temp_bytes);
    size_t tb = temp_bytes;
    MOEV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(static_cast<char*>(scratch.d) + keys_bytes, tb, keys,
                                                    scratch.as<uint32_t>(), vals, perm, N, 0, bits, thread_stream()));
  }

  /// CUB's temp bytes for sorting N 32-bit keys of `bits` bits with 32-bit
  /// values, asked once per (N, bits) and kept.
  size_t sort_temp_bytes(int64_t N, int bits) {
    std::lock_guard<std::mutex> lk(sort_m_);
    const auto key = std::make_pair(N, bits);
    auto it = temp_bytes_.find(key);
    if (it != temp_bytes_.end()) return it->second;
    size_t bytes = 0;
    MOEV_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                    static_cast<uint32_t*>(nullptr),
                                                    static_cast<const int32_t*>(nullptr),
                                                    static_cast<int32_t*>(nullptr), N, 0, bits, thread_stream()));
    if (temp_bytes_.size() > 64) temp_bytes_.clear();  // a bound on what a fuzz run of many shapes keeps
    temp_bytes_[key] = bytes;
    return bytes;
  }

  /// 0, 1, ..., n - 1 on the device: the sort's values, which CUB reads and
  /// never writes. Made for the largest n yet and kept (with the smaller ones
  /// before it, which another rank's sort may still read) until the device
  /// goes; filled and waited for before any stream reads it.
  const int32_t* iota(int64_t n) {
    std::lock_guard<std::mutex> lk(sort_m_);
    if (iota_n_ < n) {
      int64_t len = 1 << 16;  // grown by doubling: a sweep of growing N allocates a few times
      while (len < n) len *= 2;
      void* p = big_.take(size_t(len) * 4);
      if (!p) throw std::runtime_error("out of device memory for the sort's " + std::to_string(len) + " values");
      const unsigned blocks = unsigned(std::min<int64_t>((len + 255) / 256, 65535));
      iota_kernel<<<blocks, 256, 0, thread_stream()>>>(len, static_cast<int32_t*>(p));
      cudaError_t e = cudaGetLastError();
      if (e == cudaSuccess) e = cudaStreamSynchronize(thread_stream());
      if (e != cudaSuccess) {
        big_.give(p);
        MOEV_CUDA_CHECK(e);
      }
      iotas_.push_back(p);
      iota_n_ = len;
    }
    return static_cast<const int32_t*>(iotas_.back());
  }

  static cudaDataType data_type(DType dt) {
    return dt == DType::fp32 ? CUDA_R_32F : dt == DType::bf16 ? CUDA_R_16BF : CUDA_R_16F;
  }

  /// One column-major cuBLAS GEMM: C (m x n, ld ldc, type c_type) =
  /// op_a(A) op_b(B), A and B in dt, fp32 accumulation (fp32 inputs without
  /// TF32: the pedantic compute type).
  struct Call {
    cublasOperation_t op_a, op_b;
    int m, n, k, lda, ldb, ldc;
    const void* A;
    const void* B;
    void* C;
    cudaDataType t, c_type;
    cublasComputeType_t compute;
  };
  static Call call(DType dt, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n, int64_t k,
                   const void* A, int64_t lda, const void* B, int64_t ldb, void* C, cudaDataType c_type,
                   int64_t ldc) {
    for (int64_t v : {m, n, k, lda, ldb, ldc})
      if (v > int64_t(INT_MAX))
        throw std::runtime_error("cublasGemmEx: a size or leading dimension of " + std::to_string(v) +
                                 " exceeds its int range");
    return Call{op_a,   op_b, int(m), int(n), int(k), int(lda), int(ldb), int(ldc), A, B, C, data_type(dt), c_type,
                dt == DType::fp32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F};
  }

  /// Whether every operand of c starts on a 16-byte boundary and every
  /// column (ld times the element size) keeps it: the layout the grouped
  /// call is given (gemm_group).
  static bool operands_aligned16(const Call& c) {
    const auto bytes = [](cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; };
    const auto ok = [](const void* p, int64_t ld_bytes) {
      return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld_bytes % 16 == 0;
    };
    return ok(c.A, int64_t(c.lda) * bytes(c.t)) && ok(c.B, int64_t(c.ldb) * bytes(c.t)) &&
           ok(c.C, int64_t(c.ldc) * bytes(c.c_type));
  }

  /// A row-major job (moe_host.h GemmJob) as the column-major call that
  /// computes it. nt: Y^T (n x rows, ld ldc) = W^T X^T, W (n, k) row-major
  /// being a column-major k x n matrix (ld k), transposed; nn: W (k, n)
  /// row-major is a column-major n x k matrix (ld n), as is (nn_f32: the
  /// same, an fp32 output); tn_f32: C (k, n)
  /// = A^T B is column-major C^T (n x k, ld n) = B_cm A_cm^T, B_cm the n x
  /// rows matrix B is (ld ldb), A_cm the k x rows matrix A is (ld lda), fp32.
  static Call call_of(DType dt, const GemmJob& j) {
    if (j.op == GemmOp::nt)
      return call(dt, CUBLAS_OP_T, CUBLAS_OP_N, j.n, j.rows, j.k, j.b, j.k, j.a, j.lda, j.c, data_type(dt), j.ldc);
    if (j.op == GemmOp::nn || j.op == GemmOp::nn_f32)
      return call(dt, CUBLAS_OP_N, CUBLAS_OP_N, j.n, j.rows, j.k, j.b, j.n, j.a, j.lda, j.c,
                  j.op == GemmOp::nn ? data_type(dt) : CUDA_R_32F, j.ldc);
    return call(dt, CUBLAS_OP_N, CUBLAS_OP_T, j.n, j.k, j.rows, j.b, j.ldb, j.a, j.lda, j.c, CUDA_R_32F, j.n);
  }

  /// A new cuBLAS handle, kept in handles_ (destroyed with the device).
  cublasHandle_t new_handle() {
    cublasHandle_t h = nullptr;
    MOEV_CUBLAS_CHECK(blas().create(&h));
    // The contract's GEMMs accumulate in fp32 (docs/contract.md section 15).
    // By default cuBLAS may reduce split-K partial sums in the output type
    // (bf16, fp16), an extra rounding per partial: seen on an H200 as a
    // one-ulp error in the SwiGLU backward's dX (compute_dtype bf16).
    const cublasStatus_t st =
        blas().set_math_mode(h, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (st != CUBLAS_STATUS_SUCCESS) {
      blas().destroy(h);
      throw std::runtime_error("cublasSetMathMode: cuBLAS status " + std::to_string(int(st)));
    }
    std::lock_guard<std::mutex> lk(blas_m_);
    handles_.push_back(h);
    return h;
  }

  /// The pools of handles and fans: the last one given back (null where
  /// the pool is empty), and one given back.
  template <class X>
  X take(std::vector<X>& pool) {
    std::lock_guard<std::mutex> lk(blas_m_);
    if (pool.empty()) return nullptr;
    X x = pool.back();
    pool.pop_back();
    return x;
  }
  template <class X>
  void give(std::vector<X>& pool, X x) {
    std::lock_guard<std::mutex> lk(blas_m_);
    pool.push_back(x);
  }

  /// A cuBLAS handle for the calling thread's call, from a pool: a handle
  /// serves one thread at a time, and in-process ranks each hold their own
  /// while their GEMMs run side by side (one shared handle under a lock
  /// made them take turns). The pool grows to the most concurrent callers.
  struct Lease {
    CudaDevice& d;
    cublasHandle_t h = nullptr;
    explicit Lease(CudaDevice& dev) : d(dev), h(dev.take(dev.free_)) {
      d.bind();
      if (!h) h = d.new_handle();
      MOEV_CUBLAS_CHECK(blas().set_stream(h, thread_stream()));  // the calling thread's stream
    }
    ~Lease() { d.give(d.free_, h); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
  };

  /// gemm_group's fan (GroupMode auto and streams): gemm_streams() non-blocking
  /// streams, each with a cuBLAS handle of its own bound to it (a handle's
  /// workspace serves one stream at a time) and an event that joins it back;
  /// `fork` lets each wait for the caller's stream. Its handles are in
  /// handles_, destroyed before the fan.
  struct Fan {
    std::vector<cudaStream_t> streams;
    std::vector<cublasHandle_t> handles;
    std::vector<cudaEvent_t> done;
    cudaEvent_t fork = nullptr;
    ~Fan() {
      for (cudaEvent_t e : done) cudaEventDestroy(e);
      if (fork) cudaEventDestroy(fork);
      for (cudaStream_t s : streams) cudaStreamDestroy(s);
    }
  };
  /// A fan for the calling thread's gemm_group, from a pool like Lease's.
  struct FanLease {
    CudaDevice& d;
    Fan* fan = nullptr;
    explicit FanLease(CudaDevice& dev) : d(dev), fan(dev.take(dev.free_fans_)) {
      d.bind();
      if (fan) return;
      auto f = std::make_unique<Fan>();
      MOEV_CUDA_CHECK(cudaEventCreateWithFlags(&f->fork, cudaEventDisableTiming));
      for (int i = 0; i < gemm_streams(); ++i) {
        f->streams.push_back(nullptr);
        MOEV_CUDA_CHECK(cudaStreamCreateWithFlags(&f->streams.back(), cudaStreamNonBlocking));
        f->done.push_back(nullptr);
        MOEV_CUDA_CHECK(cudaEventCreateWithFlags(&f->done.back(), cudaEventDisableTiming));
        f->handles.push_back(d.new_handle());
        MOEV_CUBLAS_CHECK(blas().set_stream(f->handles.back(), f->streams.back()));
      }
      fan = f.get();
      std::lock_guard<std::mutex> lk(d.blas_m_);
      d.fans_.push_back(std::move(f));
    }
    ~FanLease() { d.give(d.free_fans_, fan); }
    FanLease(const FanLease&) = delete;
    FanLease& operator=(const FanLease&) = delete;
  };

  static double flops(const Call& c) { return 2.0 * double(c.m) * double(c.n) * double(c.k); }

  /// Enqueues the plan's units (k::plan_gemm_units over calls): unit u on
  /// handles[u.stream], several jobs as one cublasGemmBatchedEx (where the
  /// batched call refuses the type combination, as single GEMMs), one as
  /// cublasGemmEx. With a fan, its streams first wait for the calling
  /// thread's stream (a fork), which then waits for every stream used; the
  /// batched calls' pointer arrays go to the device in one copy before the
  /// fork and are freed in the calling stream's order after the join.
  /// Without waiting. Returns how the calls ran, for bench.
  std::string enqueue_planned(Fan* fan, const std::vector<cublasHandle_t>& handles, const std::vector<Call>& calls,
                              const std::vector<k::GemmUnit>& units) {
    std::vector<const void*> ptrs;  // per batched unit: its A's, B's, C's
    std::vector<size_t> first(units.size(), 0);
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].jobs.size() < 2) continue;
      first[u] = ptrs.size();
      for (int which = 0; which < 3; ++which)
        for (size_t j : units[u].jobs)
          ptrs.push_back(which == 0 ? calls[j].A : which == 1 ? calls[j].B : static_cast<const void*>(calls[j].C));
    }
    std::unique_ptr<StreamBuffer> dptrs;
    if (!ptrs.empty()) {
      dptrs = std::make_unique<StreamBuffer>(ptrs.size() * sizeof(void*));
      MOEV_CUDA_CHECK(cudaMemcpyAsync(dptrs->d, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                                      thread_stream()));
    }
    // The join: the calling stream waits for every fan stream used, also
    // when an enqueue throws (declared after dptrs, so it runs before
    // dptrs is freed in the calling stream's order; errors are not thrown
    // from a destructor, the first one already is)
    struct Join {
      Fan* fan;
      std::vector<bool> used;
      ~Join() {
        if (!fan) return;
        for (size_t s = 0; s < used.size(); ++s)
          if (used[s] && cudaEventRecord(fan->done[s], fan->streams[s]) == cudaSuccess)
            cudaStreamWaitEvent(thread_stream(), fan->done[s], 0);
      }
    } join{fan, std::vector<bool>(handles.size(), false)};
    std::vector<bool>& used = join.used;
    if (fan) MOEV_CUDA_CHECK(cudaEventRecord(fan->fork, thread_stream()));
    int batched = 0, refused = 0, singles = 0;
    std::string sizes;
    for (size_t u = 0; u < units.size(); ++u) {  // largest first (the plan's order)
      const size_t s = size_t(units[u].stream);
      if (fan && !used[s]) MOEV_CUDA_CHECK(cudaStreamWaitEvent(fan->streams[s], fan->fork, 0));
      used[s] = true;
      const std::vector<size_t>& js = units[u].jobs;
      if (js.size() < 2) {
        enqueue_gemm(handles[s], calls[js[0]]);
        ++singles;
        continue;
      }
      const Call& c = calls[js[0]];
      void** dp = static_cast<void**>(dptrs->d) + first[u];
      const size_t np = js.size();
      const float alpha = 1.f, beta = 0.f;
      const cublasStatus_t st =
          blas().gemm_batched(handles[s], c.op_a, c.op_b, c.m, c.n, c.k, &alpha, dp, c.t, c.lda, dp + np, c.t,
                              c.ldb, &beta, dp + 2 * np, c.c_type, c.ldc, int(np), c.compute, CUBLAS_GEMM_DEFAULT);
      if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // a type combination the batched call does not take
        for (size_t j : js) enqueue_gemm(handles[s], calls[j]);
        refused += int(np);
      } else if (st != CUBLAS_STATUS_SUCCESS) {
        throw std::runtime_error("cublasGemmBatchedEx: cuBLAS status " + std::to_string(int(st)));
      } else {
        ++batched;
        sizes += (sizes.empty() ? "" : ", ") + std::to_string(np);
      }
    }
    const long streams_used = std::count(used.begin(), used.end(), true);
    std::string path;
    if (batched) path = std::to_string(batched) + " cublasGemmBatchedEx of " + sizes + " GEMMs";
    if (singles + refused)
      path += (path.empty() ? "" : " and ") + std::to_string(singles + refused) + " cublasGemmEx" +
              (refused ? " (" + std::to_string(refused) + " refused by the batched call)" : "");
    path += fan ? " over " + std::to_string(streams_used) + " of " + std::to_string(handles.size()) +
                      " streams, largest first"
                : " on one stream";
    return path;
  }

  /// Enqueues one GEMM on the handle's stream, without waiting.
  static void enqueue_gemm(cublasHandle_t h, const Call& c) {
    const float alpha = 1.f, beta = 0.f;
    MOEV_CUBLAS_CHECK(blas().gemm(h, c.op_a, c.op_b, c.m, c.n, c.k, &alpha, c.A, c.t, c.lda, c.B, c.t, c.ldb, &beta,
                                  c.C, c.c_type, c.ldc, c.compute, CUBLAS_GEMM_DEFAULT));
  }

  /// Whether b is a's GEMM on other operands (one group of a grouped or
  /// batched call).
  static bool same_shape(const Call& a, const Call& b) {
    return a.op_a == b.op_a && a.op_b == b.op_b && a.m == b.m && a.n == b.n && a.k == b.k && a.lda == b.lda &&
           a.ldb == b.ldb && a.ldc == b.ldc && a.t == b.t && a.c_type == b.c_type && a.compute == b.compute;
  }

  /// gemm_group's grouped mode: the calls whose operands are 16-byte
  /// aligned as one cublasGemmGroupedBatchedEx per output type (an output
  /// type it refuses as single GEMMs), the rest as single GEMMs, on the
  /// calling thread's stream. Returns how they ran, for bench.
  std::string enqueue_grouped_calls(DType dt, const std::vector<Call>& all) {
    std::vector<Call> calls, alone;
    for (const Call& c : all) (operands_aligned16(c) ? calls : alone).push_back(c);
    std::string path = "one cublasGemmGroupedBatchedEx per output type (MOEVERIFY_CUDA_GEMM_GROUP=grouped)";
    if (!alone.empty())
      path += "; " + std::to_string(alone.size()) + " GEMM(s) with operands not 16-byte aligned one cublasGemmEx each";
    Lease h(*this);
    timed("gemm_group", [&] {
      for (const Call& c : alone) enqueue_gemm(h.h, c);
      for (cudaDataType ct : {data_type(dt), CUDA_R_32F}) {
        const cublasStatus_t st = enqueue_grouped(h.h, calls, ct);
        if (st == CUBLAS_STATUS_SUCCESS) continue;
        if (st != CUBLAS_STATUS_NOT_SUPPORTED)
          throw std::runtime_error("cublasGemmGroupedBatchedEx: cuBLAS status " + std::to_string(int(st)));
        // a type combination the grouped call does not take: that output
        // type's GEMMs one by one (the same results, one call each)
        path += std::string("; its ") + (ct == CUDA_R_32F ? "fp32" : "activation") +
                "-output GEMMs one cublasGemmEx each (the grouped call said not supported)";
        for (const Call& c : calls)
          if (c.c_type == ct) enqueue_gemm(h.h, c);
      }
    });
    return path;
  }

  /// Enqueues the calls whose output type is c_type as one
  /// cublasGemmGroupedBatchedEx: a group per run of consecutive calls of
  /// equal operations, sizes and leading dimensions. The pointer arrays go
  /// to the device first (the call reads them there), freed in stream order.
  /// Returns the call's status (success where there is nothing to run).
  static cublasStatus_t enqueue_grouped(cublasHandle_t h, const std::vector<Call>& calls, cudaDataType c_type) {
    std::vector<cublasOperation_t> op_a, op_b;
    std::vector<int> m, n, k, lda, ldb, ldc, size;
    std::vector<const void*> A, B, ptrs;  // ptrs: every A pointer, then B's, then C's
    std::vector<void*> C;
    const Call* prev = nullptr;
    cudaDataType t = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    for (const Call& c : calls) {
      if (c.c_type != c_type) continue;
      if (prev && same_shape(*prev, c)) {
        ++size.back();
      } else {
        op_a.push_back(c.op_a), op_b.push_back(c.op_b), m.push_back(c.m), n.push_back(c.n), k.push_back(c.k);
        lda.push_back(c.lda), ldb.push_back(c.ldb), ldc.push_back(c.ldc), size.push_back(1);
      }
      A.push_back(c.A), B.push_back(c.B), C.push_back(c.C);
      t = c.t, compute = c.compute, prev = &c;
    }
    if (A.empty()) return CUBLAS_STATUS_SUCCESS;
    const size_t np = A.size();
    ptrs.insert(ptrs.end(), A.begin(), A.end());
    ptrs.insert(ptrs.end(), B.begin(), B.end());
    ptrs.insert(ptrs.end(), C.begin(), C.end());
    StreamBuffer dptrs(ptrs.size() * sizeof(void*));
    // pageable source: the copy has read it when the call returns
    MOEV_CUDA_CHECK(cudaMemcpyAsync(dptrs.d, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                                    thread_stream()));
    void** dp = static_cast<void**>(dptrs.d);
    const void* const* dA = dp;
    const std::vector<float> alpha(size.size(), 1.f), beta(size.size(), 0.f);
    return blas().gemm_grouped(h, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(), dA, t,
                               lda.data(), dA + np, t, ldb.data(), beta.data(), dp + 2 * np, c_type, ldc.data(),
                               int(size.size()), size.data(), compute);
  }

  /// One GEMM (the single entry points), synchronised and timed.
  void gemm_ex(const Call& c) {
    Lease h(*this);
    timed("gemm", [&] { enqueue_gemm(h.h, c); });
  }

  /// Runs f (which enqueues work on the calling thread's stream) between
  /// two events, waits for the second and returns the seconds between them,
  /// also added to busy_ns_ where `busy` (only that stream's work counts;
  /// ranks running side by side each add their own) and, inside a window,
  /// as an interval to the window's union, with the host's seconds inside
  /// f: the start event completes as soon as the stream reaches it, so an
  /// interval includes the host's enqueuing where the device outran it.
  template <class F>
  double timed(const std::string& part, F&& f, bool busy = true) {
    bind();
    Event start, stop;
    MOEV_CUDA_CHECK(cudaEventRecord(start.e, thread_stream()));
    const auto h0 = std::chrono::steady_clock::now();
    f();
    const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count();
    MOEV_CUDA_CHECK(cudaEventRecord(stop.e, thread_stream()));
    MOEV_CUDA_CHECK(cudaEventSynchronize(stop.e));
    float ms = 0;
    MOEV_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
    if (busy) busy_ns_ += int64_t(double(ms) * 1e6);
    std::lock_guard<std::mutex> lk(window_m_);
    if (window_.open()) {
      float a = 0, b = 0;  // offsets from the window's reference event: a few seconds, float ms resolve 1 us
      MOEV_CUDA_CHECK(cudaEventElapsedTime(&a, window_ref_.e, start.e));
      MOEV_CUDA_CHECK(cudaEventElapsedTime(&b, window_ref_.e, stop.e));
      window_.add(part, double(a) * 1e-3, double(b) * 1e-3, host);
    }
    return double(ms) * 1e-3;
  }

  /// The CUDA device is per host thread: in-process ranks call in from
  /// threads of their own.
  void bind() const { MOEV_CUDA_CHECK(cudaSetDevice(ordinal_)); }

  /// The stream-ordered scratch (StreamBuffer: the sort's keys, values and
  /// CUB temp, the grouped GEMMs' pointer arrays) comes from the device's
  /// default memory pool, which by default hands every unused byte back to
  /// the driver at each synchronisation: timed() synchronises after every
  /// call, so each sort mapped its scratch anew, with the GPU idle inside
  /// the sort's timed interval. The pool now keeps up to kPoolKeep bytes
  /// it no longer uses: its buffers are small (alloc's from kPooledBytes up
  /// are cudaMalloc'd), and 1 GiB holds a call's worth of them for 8
  /// in-process ranks (DeepSeek-V3's combine outputs, 59 MB each), so a
  /// bench's repeats map nothing new.
  static constexpr uint64_t kPoolKeep = uint64_t(1) << 30;
  void keep_pool_memory() {
    if (alloc_plain()) return;
    cudaMemPool_t pool = nullptr;
    uint64_t keep = kPoolKeep;
    MOEV_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, ordinal_));
    MOEV_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }

  void transfer(void* d, const void* s, size_t n, cudaMemcpyKind kind) {
    bind();
    MOEV_CUDA_CHECK(cudaMemcpyAsync(d, s, n, kind, thread_stream()));
    MOEV_CUDA_CHECK(cudaStreamSynchronize(thread_stream()));
  }

  int ordinal_;
  std::string name_;
  std::mutex pooled_m_;
  std::unordered_set<void*> pooled_;  // alloc's buffers from the stream-ordered pool
  BlockCache big_{[](size_t n) -> void* {  // the others, from cudaMalloc; null when out of memory
                     void* p = nullptr;
                     const cudaError_t e = cudaMalloc(&p, n);
                     if (e == cudaErrorMemoryAllocation) {
                       cudaGetLastError();  // cleared: the cache may flush and try again
                       return nullptr;
                     }
                     MOEV_CUDA_CHECK(e);
                     return p;
                   },
                   [](void* p) { cudaFree(p); }, alloc_plain() ? 0 : kKeptBytes};
  std::atomic<int64_t> busy_ns_{0};
  std::mutex window_m_;
  Event window_ref_;
  BusyWindow window_;
  mutable std::mutex blas_m_;            // guards the handle pool and group_calls_
  std::vector<cublasHandle_t> handles_;  // every handle made (destroyed with the device)
  std::vector<cublasHandle_t> free_;     // those no call holds now
  std::vector<std::unique_ptr<Fan>> fans_;  // every fan made (after handles_: destroyed after them)
  std::vector<Fan*> free_fans_;             // those no call holds now
  GroupCalls group_calls_;
  std::mutex sort_m_;  // guards the sort's kept iota and temp sizes
  std::vector<void*> iotas_;  // sort_pairs' values, the last the longest (iota_n_)
  int64_t iota_n_ = 0;
  std::map<std::pair<int64_t, int>, size_t> temp_bytes_;  // CUB's temp bytes by (N, bits)
};

}  // namespace

std::unique_ptr<Device> make_device(int ordinal, std::string& why) {
  const DeviceStatus s = probe();
  if (s.count == 0) {
    why = s.message;
    return nullptr;
  }
  if (ordinal < 0 || ordinal >= s.count) {
    why = "CUDA device " + std::to_string(ordinal) + " does not exist (" + std::to_string(s.count) + " device(s))";
    return nullptr;
  }
  const cudaError_t e = cudaSetDevice(ordinal);
  if (e != cudaSuccess) {
    why = "cudaSetDevice(" + std::to_string(ordinal) + "): " + cudaGetErrorName(e);
    return nullptr;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, ordinal);
  return std::make_unique<CudaDevice>(ordinal, "CUDA device " + std::to_string(ordinal) + ": " + p.name);
}

}  // namespace moev::cuda
