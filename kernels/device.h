// Device execution of the fast path (docs/architecture.md idea 2, "Scale and backends";
// issue 12). A Device owns memory of its own and runs the single-source bodies
// of bodies.h (and the primitives that differ by nature: sort, GEMM) on it.
// Two devices: the CUDA device (cuda_exec.cu: a GPU, CUB and cuBLAS) and the
// emulated device (device.cpp: separate host allocations, the host executor),
// which runs the same plumbing without a GPU so that CI exercises it.
//
// A Mirror pairs host buffers with device buffers for one case. The host entry
// points of moe_host.h / ep_host.h, given an ExecCtx with a mirror, translate
// every pointer they are handed to its device copy, run the body on the
// device, and write what they wrote back to the host at once (write-through):
// the runner compares every output on the host anyway, and host code between
// two device calls (splits, an all-to-all staged through the host) then always reads
// valid data. Inputs stay resident: a board tensor is uploaded once per case
// and every later stage reads its device copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "backward_bodies.h"
#include "bodies.h"
#include "ep_host.h"
#include "moe_host.h"
#include "sp_host.h"

namespace moev {

struct RouterConfig;

/// Counts of one expert: counts[e] = #{a : ids[a] == e}, one item per expert,
/// lane 0 walks the N assignments (deterministic, no atomics). The emulated
/// device runs this body; the CUDA device counts the same with integer
/// atomics (cuda_exec.cu histogram_kernel: integer sums are the same in any
/// order), where one thread an expert took 262,144 loads at DeepSeek-V3 size.
struct HistogramBody {
  const int32_t* ids;
  int64_t N;
  int64_t* counts;
  MOEV_HD void operator()(int64_t e, int lane, int) const {
    if (lane != 0) return;
    int64_t n = 0;
    for (int64_t a = 0; a < N; ++a) n += ids[a] == e;
    counts[e] = n;
  }
};

/// Elementwise bodies take chunks: item c covers elements [c * kChunk,
/// min(n, (c + 1) * kChunk)), its lanes strided over them, so a GPU block
/// keeps every thread busy. chunks(n) is the item count to run.
constexpr int64_t kChunk = 4096;
inline int64_t chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

/// Rounds n fp32 values to the activation type T in place (router.gate_dtype
/// act). With `pieces`, eight values at a time round together (round_pairs,
/// the combine's packed conversion; n a multiple of 8): the same values, so
/// that tests/gpu_check.cpp can compare the packed path with the host's.
template <class T>
struct RoundBody {
  float* v;
  int64_t n;
  bool pieces = false;
  MOEV_HD void operator()(int64_t c, int lane, int lanes) const {
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    if (pieces) {
      for (int64_t i = c * kChunk + 8 * lane; i + 7 < end; i += 8 * lanes) {
        float p[8];
        for (int j = 0; j < 8; ++j) p[j] = v[i + j];
        round_pairs<T, 4>(p);
        for (int j = 0; j < 8; ++j) v[i + j] = p[j];
      }
      return;
    }
    for (int64_t i = c * kChunk + lane; i < end; i += lanes) v[i] = round_to<T>(v[i]);
  }
};

/// dst[i] = src[i] rounded to To for i < n (one rounding; exact where To is
/// wider): the inputs and weights of compute_dtype bf16 (docs/contract.md §14) and back.
template <class From, class To>
struct ConvertBody {
  const From* src;
  To* dst;
  int64_t n;
  MOEV_HD void operator()(int64_t c, int lane, int lanes) const {
    const int64_t end = (c + 1) * kChunk < n ? (c + 1) * kChunk : n;
    for (int64_t i = c * kChunk + lane; i < end; i += lanes) dst[i] = from_float<To>(to_float(src[i]));
  }
};

/// The length of a union of time intervals [a, b) in seconds, added in any
/// order (overlapping ones count once): how long a device was busy when
/// in-process ranks run their kernels side by side.
class BusyUnion {
 public:
  void add(double a, double b);
  double seconds() const;

 private:
  std::map<double, double> iv_;  // disjoint intervals, start -> end
};

/// One part of a busy window (Device::window_parts): the union of the
/// intervals of one kind of device work, how many there were, and two sums
/// over its calls: their intervals, and the host's time inside them (the
/// time the calling thread spent enqueuing the work on a GPU). A part whose
/// calls' intervals are mostly host time was launch-bound: the device
/// waited for the host (on the emulated device the host does the work, so
/// the two agree).
struct WindowPart {
  std::string name;  // a body's class name ("ScatterRowsBody"), or sort, histogram, gemm, gemm_group, fill, copy
  double seconds = 0;
  int64_t calls = 0;
  double interval_seconds = 0;  // the sum of the calls' intervals (>= seconds, their union)
  double host_seconds = 0;      // the sum of the host's seconds inside the calls
};

/// A device's busy window (Device::window_begin ... window_end): the union
/// of every interval added while open, and a union per part name. Not
/// thread-safe: a device holds it under its own lock.
class BusyWindow {
 public:
  void begin();
  bool open() const { return open_; }
  /// A call's interval [a, b) and the host's seconds inside it; while open.
  void add(const std::string& part, double a, double b, double host_seconds);
  double end();                                           // closes; the whole union's seconds
  std::vector<WindowPart> parts() const;                  // of the last window, longest first

 private:
  bool open_ = false;
  BusyUnion all_;
  struct Part {
    BusyUnion all;
    int64_t calls = 0;
    double interval_seconds = 0, host_seconds = 0;
  };
  std::map<std::string, Part> parts_;
};

/// Blocks of device memory, each one given back kept for the next request
/// of its exact size, up to `keep` bytes kept in all (the largest dropped
/// first beyond it); where the allocator fails, every kept block is dropped
/// and the request tried once more. The CUDA device keeps its large blocks
/// in one: cudaMalloc and cudaFree synchronise every stream of the device,
/// and a bench repeats each stage's calls with the same shapes.
/// Thread-safe.
class BlockCache {
 public:
  using Alloc = std::function<void*(size_t)>;  // null when out of memory
  using Free = std::function<void(void*)>;
  BlockCache(Alloc alloc, Free free, size_t keep) : alloc_(std::move(alloc)), free_(std::move(free)), keep_(keep) {}
  ~BlockCache() { flush(); }  // the kept blocks (those taken are the taker's)
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  void* take(size_t bytes);  // null when out of memory with nothing kept
  void give(void* p);        // a block take() returned (anything else is freed at once)
  void flush();              // frees every kept block
  size_t kept_bytes() const;

 private:
  Alloc alloc_;
  Free free_;
  size_t keep_;
  mutable std::mutex m_;
  std::map<void*, size_t> size_;       // every block taken and not given back: its size
  std::multimap<size_t, void*> kept_;  // those given back and kept, by size
  size_t kept_bytes_ = 0;
};

/// A body's part name in a busy window: its class name without namespace
/// or template arguments (k::ScatterRowsBody<bf16> gives "ScatterRowsBody").
std::string short_type_name(const std::type_info& t);
template <class Body>
const std::string& part_name() {
  static const std::string n = short_type_name(typeid(Body));
  return n;
}

/// Every call is complete when it returns (its writes have landed): callers
/// on other threads, and NCCL's own stream, may use the memory next.
class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  virtual void* alloc(size_t bytes) = 0;  // bytes > 0; throws when out of memory
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  /// dst = `byte` everywhere, and dst = src, on the device: the harness's
  /// (an output's poison), untimed.
  virtual void fill(void* dst, uint8_t byte, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  /// The same as part of a stage's own work (an in-place combine's start,
  /// identity experts' rows, an empty expert's zero gradient, the in-process
  /// all-to-all's copies under `run`): timed as a
  /// body is, into busy_seconds() and the busy window (parts "fill" and
  /// "copy"), so the stage's device time holds it.
  virtual void fill_timed(void* dst, uint8_t byte, size_t bytes) = 0;
  virtual void copy_timed(void* dst, const void* src, size_t bytes) = 0;
  /// A hash of the bytes computed on the device (the input-unchanged check
  /// without bringing the input back).
  virtual uint64_t hash(const void* p, size_t bytes) = 0;
  /// Seconds the device has spent running bodies, sorts, GEMMs and the timed
  /// fills and copies since it was made (fill, copy, uploads and hashes
  /// excluded): CUDA events around each launch on a GPU, the host clock on
  /// the emulated device. A stage's device
  /// time is the difference across its fast call; calls of in-process ranks
  /// that overlap count once each.
  virtual double busy_seconds() const = 0;
  /// dst = src on the device, timed by the device's own clock (CUDA events
  /// around the copy on a GPU, the host clock on the emulated device); not
  /// counted in busy_seconds(). `moeverify bench --backend` uses it as the
  /// roof (a device-to-device copy of a stage's traffic) and to time the
  /// in-process all-to-all's copies.
  virtual double timed_copy(void* dst, const void* src, size_t bytes) = 0;
  /// A busy window: from window_begin() to window_end(), every timed body,
  /// sort, GEMM, fill_timed, copy_timed and timed_copy adds its interval
  /// (CUDA events on a GPU, the host clock on the emulated device) to a
  /// union; window_end() returns the
  /// union's length, the seconds the device was busy with that work, however
  /// many ranks' streams overlapped. `bench --backend` times each stage by it.
  virtual void window_begin() = 0;
  virtual double window_end() = 0;
  /// The last window's parts (BusyWindow): where its seconds went, by kind
  /// of work, longest first. Parts overlap where ranks ran side by side.
  virtual std::vector<WindowPart> window_parts() = 0;

  // The bodies of bodies.h over items [0, n) (item = block, lane = thread on a GPU).
  virtual void run(const k::RouterBody& b, int64_t n) = 0;
  virtual void run(const k::RouterScoresBody& b, int64_t n) = 0;
  virtual void run(const HistogramBody& b, int64_t n) = 0;
  virtual void run(const PadRouteBody& b, int64_t n) = 0;
  virtual void run(const k::DispatchMetaBody& b, int64_t n) = 0;
  virtual void run(const k::RouterGradBody& b, int64_t n) = 0;
#define MOEV_DEVICE_BODIES(T)                                                  \
  virtual void run(const k::GatherBody<T>& b, int64_t n) = 0;                  \
  virtual void run(const k::ScatterRowsBody<T>& b, int64_t n) = 0;             \
  virtual void run(const k::CombineBody<T, k::kDeviceSpan<T>>& b, int64_t n) = 0;             \
  virtual void run(const k::RowMapBody<T>& b, int64_t n) = 0;                  \
  virtual void run(const k::FnRowMapBody<T, EqualCountMap>& b, int64_t n) = 0; \
  virtual void run(const RoundBody<T>& b, int64_t n) = 0;                      \
  virtual void run(const k::SwigluBody<T>& b, int64_t n) = 0;                  \
  virtual void run(const k::CombineGradRowsBody<T>& b, int64_t n) = 0;         \
  virtual void run(const k::ScoreGradBody<T>& b, int64_t n) = 0;              \
  virtual void run(const k::SwigluBwdBody<T>& b, int64_t n) = 0;              \
  virtual void run(const k::GradSumBody<T>& b, int64_t n) = 0;              \
  virtual void run(const k::HiddenScoreGradBody<T>& b, int64_t n) = 0;        \
  virtual void run(const k::GateGradBody<T>& b, int64_t n) = 0;               \
  virtual void run(const k::GateInputGradBody<T>& b, int64_t n) = 0;
  MOEV_DEVICE_BODIES(float)
  MOEV_DEVICE_BODIES(bf16)
  MOEV_DEVICE_BODIES(fp16)
#undef MOEV_DEVICE_BODIES
  // the fused SwiGLU backward's dX from fp32 halves (GradSumBody<float> is above)
  virtual void run(const k::GradSumBody<bf16, float>& b, int64_t n) = 0;
  virtual void run(const k::GradSumBody<fp16, float>& b, int64_t n) = 0;
  // FP8 dispatch (docs/contract.md §16): e4m3 rows move with the row-map bodies.
  virtual void run(const k::RowMapBody<e4m3>& b, int64_t n) = 0;
  virtual void run(const k::FnRowMapBody<e4m3, EqualCountMap>& b, int64_t n) = 0;
#define MOEV_DEVICE_FP8(T)                                       \
  virtual void run(const k::Fp8QuantBody<T>& b, int64_t n) = 0; \
  virtual void run(const k::Fp8DequantBody<T>& b, int64_t n) = 0;
  MOEV_DEVICE_FP8(float)
  MOEV_DEVICE_FP8(bf16)
  MOEV_DEVICE_FP8(fp16)
#undef MOEV_DEVICE_FP8
#define MOEV_DEVICE_CONVERT(T)                                                \
  virtual void run(const ConvertBody<T, bf16>& b, int64_t n) = 0;             \
  virtual void run(const ConvertBody<bf16, T>& b, int64_t n) = 0;
  MOEV_DEVICE_CONVERT(float)
  MOEV_DEVICE_CONVERT(fp16)
#undef MOEV_DEVICE_CONVERT

  /// Stable sort of the flat ids: perm lists assignments by (ids[a], a); with
  /// `descending_within` (the planted fault unstable_sort) by (ids[a], -a).
  virtual void sort(const int32_t* ids, int64_t N, int E, int32_t* perm, bool descending_within) = 0;
  /// logits (T, E) fp32 = float(x) (T, D) * float(wg)^T (E, D), fp32 accumulation.
  virtual void gemm_logits(DType dt, const void* x, const void* wg, int64_t T, int64_t D, int E, float* logits) = 0;
  /// Y (rows, n; row stride ldy) = round_act(X (rows, k; row stride ldx) W^T),
  /// W (n, k) row-major, fp32 accumulation, one rounding to the type `dt`.
  virtual void gemm_nt(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
                       int64_t ldy) = 0;
  /// The same with W (k, n) row-major: Y = round_act(X W) (the batched
  /// experts' cached W2^T).
  virtual void gemm_nn(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
                       int64_t ldy) = 0;
  /// C (m, n) fp32 = A^T B, A (rows, m; ld lda) and B (rows, n; ld ldb) in
  /// dt, fp32 products and accumulation, rows > 0 (the weight gradients).
  virtual void gemm_tn_f32(DType dt, const void* A, int64_t rows, int64_t m, int64_t lda, const void* B, int64_t n,
                           int64_t ldb, float* C) = 0;
  /// The jobs (device addresses; moe_host.h GemmJob, tn_f32 jobs with rows
  /// > 0), independent of one another, as one timed call: each gives the
  /// single call's result. On a GPU one grouped cuBLAS GEMM where the
  /// library has it and the type allows it, so that many small expert
  /// GEMMs fill the device together (issue 36 item 3); else the single
  /// GEMMs enqueued back to back, with one wait at the end.
  virtual void gemm_group(DType dt, const std::vector<GemmJob>& jobs) = 0;
  /// gemm_group calls so far, and how the last one ran (for `bench`: a
  /// GEMM stage that made calls says how).
  struct GroupCalls {
    int64_t calls = 0;
    std::string path;
  };
  virtual GroupCalls gemm_group_calls() const = 0;
};

/// The run() overrides of a device whose bodies all go through one template,
/// Derived::body(b, n): the CUDA device's launch, the emulated device's host
/// run. A device overrides run() again where a body differs by nature there
/// (the CUDA device's histogram).
template <class Derived>
class BodyDevice : public Device {
 public:
  void run(const k::RouterBody& b, int64_t n) override { self().body(b, n); }
  void run(const k::RouterScoresBody& b, int64_t n) override { self().body(b, n); }
  void run(const HistogramBody& b, int64_t n) override { self().body(b, n); }
  void run(const PadRouteBody& b, int64_t n) override { self().body(b, n); }
  void run(const k::DispatchMetaBody& b, int64_t n) override { self().body(b, n); }
  void run(const k::RouterGradBody& b, int64_t n) override { self().body(b, n); }
#define MOEV_BODY_DEVICE(T)                                                                           \
  void run(const k::GatherBody<T>& b, int64_t n) override { self().body(b, n); }                     \
  void run(const k::ScatterRowsBody<T>& b, int64_t n) override { self().body(b, n); }                \
  void run(const k::CombineBody<T, k::kDeviceSpan<T>>& b, int64_t n) override { self().body(b, n); } \
  void run(const k::RowMapBody<T>& b, int64_t n) override { self().body(b, n); }                     \
  void run(const k::FnRowMapBody<T, EqualCountMap>& b, int64_t n) override { self().body(b, n); }    \
  void run(const RoundBody<T>& b, int64_t n) override { self().body(b, n); }                         \
  void run(const k::SwigluBody<T>& b, int64_t n) override { self().body(b, n); }                     \
  void run(const k::CombineGradRowsBody<T>& b, int64_t n) override { self().body(b, n); }            \
  void run(const k::ScoreGradBody<T>& b, int64_t n) override { self().body(b, n); }                  \
  void run(const k::SwigluBwdBody<T>& b, int64_t n) override { self().body(b, n); }                  \
  void run(const k::GradSumBody<T>& b, int64_t n) override { self().body(b, n); }                    \
  void run(const k::HiddenScoreGradBody<T>& b, int64_t n) override { self().body(b, n); }            \
  void run(const k::GateGradBody<T>& b, int64_t n) override { self().body(b, n); }                  \
  void run(const k::GateInputGradBody<T>& b, int64_t n) override { self().body(b, n); }              \
  void run(const k::Fp8QuantBody<T>& b, int64_t n) override { self().body(b, n); }                   \
  void run(const k::Fp8DequantBody<T>& b, int64_t n) override { self().body(b, n); }
  MOEV_BODY_DEVICE(float)
  MOEV_BODY_DEVICE(bf16)
  MOEV_BODY_DEVICE(fp16)
#undef MOEV_BODY_DEVICE
  void run(const k::GradSumBody<bf16, float>& b, int64_t n) override { self().body(b, n); }
  void run(const k::GradSumBody<fp16, float>& b, int64_t n) override { self().body(b, n); }
  void run(const k::RowMapBody<e4m3>& b, int64_t n) override { self().body(b, n); }
  void run(const k::FnRowMapBody<e4m3, EqualCountMap>& b, int64_t n) override { self().body(b, n); }
#define MOEV_BODY_DEVICE_CONVERT(T)                                                       \
  void run(const ConvertBody<T, bf16>& b, int64_t n) override { self().body(b, n); } \
  void run(const ConvertBody<bf16, T>& b, int64_t n) override { self().body(b, n); }
  MOEV_BODY_DEVICE_CONVERT(float)
  MOEV_BODY_DEVICE_CONVERT(fp16)
#undef MOEV_BODY_DEVICE_CONVERT

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
};

/// The emulated device: its memory is separate host allocations, its
/// executor the host executor with `threads` threads, each item run as a
/// block of 3 lanes one after another (host_exec.h block_item). It exists so that the
/// device plumbing (uploads, poisoning, pointer translation, residency,
/// write-back, device-side checks) runs in CI, which has no GPU.
std::unique_ptr<Device> make_emulated_device(int threads);

/// Host buffers and their device copies, for one case (see the file comment).
/// Thread-safe: in-process EP ranks call it from their threads.
class Mirror {
 public:
  explicit Mirror(Device& dev) : dev_(dev) {}
  ~Mirror();
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;

  Device& device() { return dev_; }
  /// A board tensor's storage [host, host + bytes), alive while `owner` is:
  /// uploaded now unless already mirrored (then nothing moves).
  void hold(const void* host, size_t bytes, const std::shared_ptr<void>& owner);
  /// A new output's storage: its device copy is poisoned like the host copy
  /// (every byte `poison`), so a kernel that skips an element shows it.
  void hold_output(const void* host, size_t bytes, const std::shared_ptr<void>& owner, uint8_t poison);

  /// Device address of host range [p, p + bytes) for reading. The host copy
  /// is the truth (write-through), so what may have changed on the host since
  /// its upload is uploaded again first: a temporary of the fast function (a
  /// range inside no held buffer: its host memory may even be a new
  /// allocation at a freed one's address), and an output of this call that
  /// no device call wrote (host code may have, e.g. an MPI exchange of host rows).
  /// A variant that runs on a device writes each output either on the host or
  /// on the device, never both.
  const void* in(const void* p, size_t bytes);
  /// Device address of [p, p + bytes) for writing; wrote() must follow.
  void* out(void* p, size_t bytes);
  /// Copies [p, p + bytes) back to the host after a kernel wrote it.
  void wrote(void* p, size_t bytes);
  /// Brings [p, p + bytes) to the device after host code wrote it.
  void host_wrote(const void* p, size_t bytes);
  /// Whether a device call wrote into [p, p + bytes) since begin_call().
  bool device_wrote(const void* p, size_t bytes);

  /// Drops the temporaries the calling thread created. Every entry point
  /// ends with it (Scope): a temporary's host memory may be freed and reused
  /// right after, by any rank's thread, with other boundaries; an entry
  /// outliving it could then be dropped for an overlap while another call
  /// still reads its device copy.
  void release_temporaries();
  /// Calls release_temporaries() when a device entry point returns.
  struct Scope {
    Mirror& m;
    ~Scope() { m.release_temporaries(); }
  };

  /// Hash, on the device, of the device copy of [p, p + bytes) (held).
  uint64_t device_hash(const void* p, size_t bytes);
  /// Starts a fast call: clears the per-call marks.
  void begin_call();
  /// Ends it: drops the call's temporaries and every buffer whose owner died.
  void end_call();

  int64_t uploads() const { return uploads_; }
  size_t device_bytes() const { return bytes_; }

 private:
  /// held: a board tensor's storage, alive while `owner` is; output: one
  /// registered by hold_output() in the current call (held from the next);
  /// temporary: a range of a fast function's own, ended with its entry point.
  enum class Kind : uint8_t { held, output, temporary };
  struct Entry {
    size_t bytes = 0;
    void* dev = nullptr;
    Kind kind = Kind::held;
    std::weak_ptr<void> owner;    // held and output
    std::thread::id thread;       // temporary: the thread whose entry point made it
    bool device_written = false;  // by a device call since begin_call()
    /// Whether the host may hold bytes the device copy lacks (see in()).
    bool host_may_be_newer() const { return kind == Kind::temporary || (kind == Kind::output && !device_written); }
  };
  using Map = std::map<const uint8_t*, Entry>;
  /// The device address of host address p inside entry `it`.
  static uint8_t* device_at(Map::iterator it, const void* p) {
    return static_cast<uint8_t*>(it->second.dev) + (static_cast<const uint8_t*>(p) - it->first);
  }
  Map::iterator find(const void* p, size_t bytes);  // the live entry containing the range, or end()
  Map::iterator add(const void* p, size_t bytes, const std::shared_ptr<void>* owner, bool upload, int poison);
  void drop(Map::iterator it);

  Device& dev_;
  std::mutex m_;
  Map entries_;
  int64_t uploads_ = 0;
  size_t bytes_ = 0;
};

}  // namespace moev
