// combine_probe: what a GPU can do with the combine's memory traffic, apart
// from moeverify's combine (issue 36 item 1). The combine reads each token's
// K routed rows, wherever the dispatch put them, and writes one row; at the
// last H200 run it ran at 57% of a device copy of its bytes. This probe times,
// on the same shape and in one run, the device copy that `bench` uses as the
// roof and three kernels that move the combine's bytes, so that the kit's log
// says whether the gap is the access pattern (the plain kernels fall short
// too) or moeverify's kernel (they do not):
//   read_rows    each token's K rows read at the dispatch's positions and summed, one
//                float a block written: the load side of the pattern alone
//   gather_sum   read_rows writing the token's row: the K pieces of a lane
//                loaded before the first is added, fp32 sums of score * row,
//                one bf16 rounding (round to nearest even) at the end
//   stream_sum   gather_sum with the rows in order (row t*K + k): the same
//                bytes without the scattered positions
// None of them is the contract's combine (no per-row rounding, no modes): the
// figures bound the pattern, they verify nothing. Output: one line a kernel,
// milliseconds (best of --repeat) and percent of the copy.
// Usage: combine_probe [--tokens T] [--hidden D] [--top-k K] [--lanes L] [--repeat R]
// Exit 77 without a usable CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

#define PROBE_CHECK(expr)                                                                                      \
  do {                                                                                                         \
    const cudaError_t e_ = (expr);                                                                             \
    if (e_ != cudaSuccess) {                                                                                   \
      std::fprintf(stderr, "combine_probe: %s: %s\n", #expr, cudaGetErrorString(e_));                          \
      std::exit(1);                                                                                            \
    }                                                                                                          \
  } while (0)

// bf16 as its 16 bits: a piece of 16 bytes is 8 of them.
__device__ inline float bf16_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
__device__ inline uint32_t float_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
  const uint32_t u = __float_as_uint(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// The K row indices of token t: the dispatch's (row_of) or in order.
__device__ inline int64_t row_index(const int32_t* row_of, int64_t t, int K, int k) {
  return row_of ? int64_t(row_of[t * K + k]) : t * K + k;
}

/// `lanes` threads a token; a lane walks the token's 16-byte pieces lane,
/// lane + lanes, ...; for each, its K rows' pieces are loaded, then summed.
/// out == nullptr: only a per-block sum is written (read_rows).
template <int K>
__global__ void gather_sum_kernel(const uint4* __restrict__ routed, const int32_t* __restrict__ row_of,
                                  const float* __restrict__ score, uint4* __restrict__ out, float* __restrict__ sink,
                                  int64_t T, int64_t pieces, int lanes) {
  const int per_block = blockDim.x / lanes;
  const int64_t t = int64_t(blockIdx.x) * per_block + threadIdx.x / lanes;
  const int lane = int(threadIdx.x % lanes);
  float acc_all = 0.f;
  if (t < T) {
    int64_t base[K];
    float s[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      base[k] = row_index(row_of, t, K, k) * pieces;
      s[k] = score[t * K + k];
    }
    for (int64_t c = lane; c < pieces; c += lanes) {
      uint4 p[K];
#pragma unroll
      for (int k = 0; k < K; ++k) p[k] = routed[base[k] + c];
      float v[8] = {};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const uint32_t w[4] = {p[k].x, p[k].y, p[k].z, p[k].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[2 * i] += s[k] * bf16_to_float(w[i] & 0xffffu);
          v[2 * i + 1] += s[k] * bf16_to_float(w[i] >> 16);
        }
      }
      if (out) {
        uint4 o;
        o.x = float_to_bf16(v[0]) | (float_to_bf16(v[1]) << 16);
        o.y = float_to_bf16(v[2]) | (float_to_bf16(v[3]) << 16);
        o.z = float_to_bf16(v[4]) | (float_to_bf16(v[5]) << 16);
        o.w = float_to_bf16(v[6]) | (float_to_bf16(v[7]) << 16);
        out[t * pieces + c] = o;
      } else {
        for (float x : v) acc_all += x;
      }
    }
  }
  if (!out && acc_all == 12345.f) sink[blockIdx.x] = acc_all;  // keeps the loads; never true on this data
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    PROBE_CHECK(cudaEventCreate(&a));
    PROBE_CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  /// The best of `repeat` runs of f (after one warm-up), in seconds.
  template <class F>
  double best(int repeat, F&& f) {
    f();
    PROBE_CHECK(cudaDeviceSynchronize());
    double s = 1e30;
    for (int r = 0; r < repeat; ++r) {
      PROBE_CHECK(cudaEventRecord(a));
      f();
      PROBE_CHECK(cudaEventRecord(b));
      PROBE_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      PROBE_CHECK(cudaEventElapsedTime(&ms, a, b));
      s = std::min(s, double(ms) * 1e-3);
    }
    PROBE_CHECK(cudaGetLastError());
    return s;
  }
};

long arg(int argc, char** argv, const char* name, long dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtol(argv[i + 1], nullptr, 10);
  return dflt;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t T = arg(argc, argv, "--tokens", 4096), D = arg(argc, argv, "--hidden", 7168);
  const int K = int(arg(argc, argv, "--top-k", 8)), lanes = int(arg(argc, argv, "--lanes", 64));
  const int repeat = int(arg(argc, argv, "--repeat", 5));
  if (T <= 0 || D <= 0 || D % 8 != 0 || K != 8 || lanes <= 0 || 128 % lanes != 0 || repeat <= 0) {
    std::fprintf(stderr, "combine_probe: --tokens > 0, --hidden a positive multiple of 8, --top-k 8, --lanes dividing 128, "
                         "--repeat > 0\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("combine_probe: no usable CUDA device: SKIPPED\n");
    return 77;
  }
  cudaDeviceProp prop{};
  PROBE_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int64_t N = T * K, pieces = D / 8;
  const size_t row_bytes = size_t(D) * 2, routed_bytes = size_t(N) * row_bytes, out_bytes = size_t(T) * row_bytes;

  // the dispatch's positions: a token's K rows scattered over the buffer
  // (a random permutation of the N rows), as sorting by expert leaves them
  std::vector<int32_t> row_of(static_cast<size_t>(N));
  std::iota(row_of.begin(), row_of.end(), 0);
  std::mt19937 g(7);
  std::shuffle(row_of.begin(), row_of.end(), g);
  std::vector<float> score(static_cast<size_t>(N));
  std::uniform_real_distribution<float> u(0.05f, 0.3f);
  for (float& s : score) s = u(g);

  void *routed = nullptr, *out = nullptr, *copy_dst = nullptr;
  int32_t* d_row_of = nullptr;
  float *d_score = nullptr, *sink = nullptr;
  PROBE_CHECK(cudaMalloc(&routed, routed_bytes));
  PROBE_CHECK(cudaMalloc(&out, out_bytes));
  PROBE_CHECK(cudaMalloc(&d_row_of, size_t(N) * 4));
  PROBE_CHECK(cudaMalloc(&d_score, size_t(N) * 4));
  const int per_block = 128 / lanes;
  const unsigned blocks = unsigned((T + per_block - 1) / per_block);
  PROBE_CHECK(cudaMalloc(&sink, size_t(blocks) * 4));
  PROBE_CHECK(cudaMemset(routed, 0x3c, routed_bytes));  // every bf16 0x3c3c: about 0.0115
  PROBE_CHECK(cudaMemcpy(d_row_of, row_of.data(), size_t(N) * 4, cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(d_score, score.data(), size_t(N) * 4, cudaMemcpyHostToDevice));

  // bench's roof for the combine: a device copy of half its bytes (routed
  // rows read + output rows written), i.e. those bytes read and written
  const size_t moved = routed_bytes + out_bytes, copy_bytes = moved / 2;
  PROBE_CHECK(cudaMalloc(&copy_dst, copy_bytes));
  Timer timer;
  const double copy = timer.best(repeat, [&] { PROBE_CHECK(cudaMemcpyAsync(copy_dst, routed, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const auto* r = static_cast<const uint4*>(routed);
  auto* o = static_cast<uint4*>(out);
  const double read_rows = timer.best(repeat, [&] {
    gather_sum_kernel<8><<<blocks, 128>>>(r, d_row_of, d_score, nullptr, sink, T, pieces, lanes);
  });
  const double gather_sum = timer.best(repeat, [&] {
    gather_sum_kernel<8><<<blocks, 128>>>(r, d_row_of, d_score, o, sink, T, pieces, lanes);
  });
  const double stream_sum = timer.best(repeat, [&] {
    gather_sum_kernel<8><<<blocks, 128>>>(r, nullptr, d_score, o, sink, T, pieces, lanes);
  });

  std::printf("combine_probe on %s: T %lld, D %lld, K %d, bf16, %d threads a token; %.1f MB moved (routed rows read + "
              "output written), best of %d\n",
              prop.name, (long long)T, (long long)D, K, lanes, double(moved) / 1e6, repeat);
  const auto line = [&](const char* name, double s, size_t bytes, const char* what) {
    std::printf("  %-11s %8.4f ms  %7.1f GB/s  %5.1f%% of the copy  %s\n", name, s * 1e3, double(bytes) / s / 1e9,
                100 * copy / s, what);
  };
  line("copy", copy, moved, "cudaMemcpyAsync of half the bytes (bench's roof)");
  line("read_rows", read_rows, routed_bytes, "the K rows read at the dispatch's positions, no row written");
  line("gather_sum", gather_sum, moved, "read_rows writing the token's row (fp32 sums, one rounding)");
  line("stream_sum", stream_sum, moved, "gather_sum with the rows in order");
  cudaFree(routed);
  cudaFree(out);
  cudaFree(copy_dst);
  cudaFree(d_row_of);
  cudaFree(d_score);
  cudaFree(sink);
  return 0;
}
