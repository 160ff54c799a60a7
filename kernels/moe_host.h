// The fast MoE path on the host executor: the entry points the runner calls.
// Activation buffers are raw bytes of the DType given; metadata is int32/int64
// and fp32 scores. Callers own every buffer (outputs arrive poisoned); no entry
// point allocates inside its per-row loops.
//
// One file per stage family implements them (docs/architecture.md "Layout"):
//   router_host.cpp        router_logits, router_route
//   dispatch_host.cpp      expert_histogram, expert_sort, dispatch_gather
//   experts_host.cpp       experts_swiglu (loop, grouped), gemm_nt, gemm_nn, gemm_group, copy_bytes
//   weight_cache_host.cpp  experts_swiglu_batched and its BatchedWeightCache
//   combine_host.cpp       combine, combine_from_zeros, combine_in_place
// with the GEMM and bf16 helpers they share in moe_host_detail.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "bodies.h"
#include "dtype.h"
#include "host_exec.h"

namespace moev {

struct RouterConfig {
  int E = 0, K = 0, groups = 1, limited_groups = 1;
  float route_scale = 1.f;
  k::ScoreFunc score = k::ScoreFunc::softmax;
  k::Selection selection = k::Selection::topk;
  k::RouteNorm norm = k::RouteNorm::off;
  k::ScoreHeld held = k::ScoreHeld::fp32;  // docs/contract.md §14 router.score_dtype
  bool biased = false;                     // router.bias: on
};

/// Where the router GEMM's result is rounded (docs/contract.md §14 `router.gate_dtype`):
/// `fp32` keeps the fp32 accumulation; `act` rounds each logit to the
/// activation dtype, then widens it back (torchtitan on CPU, where the fp32
/// gate autocast of docs/frameworks.md §0 "Dtypes" is ignored).
enum class GateDtype : uint8_t { fp32, act };

/// logits (T, E) fp32 = float(x) (T, D) * float(wg)^T, wg (E, D) in dtype,
/// rounded to dtype under GateDtype::act.
void router_logits(const ExecCtx& ctx, DType dt, const void* x, const void* wg, int64_t T,
                   int64_t D, int E, float* logits, GateDtype gate = GateDtype::fp32);

/// docs/contract.md §1 steps 1-9 on given logits. `choice` is T * E floats of
/// scratch (token-major on the host, expert-major on a device).
void router_route(const ExecCtx& ctx, const RouterConfig& cfg, const float* logits,
                  const float* bias, int64_t T, float* scores, float* choice, int32_t* ids,
                  float* topk_scores, int64_t* counts);

/// counts[e] = #{a : ids[a] == e} for N flat assignments.
void expert_histogram(const ExecCtx& ctx, const int32_t* ids, int64_t N, int E, int64_t* counts);

/// Stable counting sort of the flat ids: perm lists assignments by (ids[a], a).
void expert_sort(const ExecCtx& ctx, const int32_t* ids, int64_t N, int E, int32_t* perm);

/// Local dispatch (docs/contract.md §2): see k::GatherBody for the outputs.
void dispatch_gather(const ExecCtx& ctx, DType dt, k::ScoreApply apply, const void* x,
                     const int32_t* perm, const float* topk_scores, int64_t N, int64_t D, int K,
                     void* routed, int32_t* token_sorted, float* score_sorted, int32_t* row_of,
                     k::ScoreMultiply smul = k::ScoreMultiply::fp32);

enum class ExpertsImpl : uint8_t { loop, grouped, batched /* experts_swiglu_batched */ };

/// The dtype the expert GEMMs run in (docs/contract.md §14 `experts.compute_dtype`):
/// `act`, or `bf16`: X and the weights rounded to bf16, GEMMs in bf16 with
/// fp32 accumulation (h13 and H in bf16), Y rounded to the activation dtype
/// (torchtitan GroupedExperts casts with .bfloat16(), docs/frameworks.md §8.1).
enum class ComputeDtype : uint8_t { act, bf16 };

/// The numeric conventions of one SwiGLU call (docs/contract.md §14).
struct SwigluConventions {
  k::SiluRounding rounding = k::SiluRounding::fused;
  ComputeDtype compute = ComputeDtype::act;
  /// score_on_hidden (docs/contract.md §14): one fp32 score per row of X,
  /// multiplied into H before the W2 GEMM; null: none.
  const float* row_scale = nullptr;
  /// experts.w13_fused (docs/contract.md §14): under the torchtitan rounding
  /// the backward forms dX in one GEMM over 2F, not two rounded ones.
  bool w13_fused = false;
};

/// The SwiGLU intermediates, caller-owned, in dtype: h13 (rows, 2F) holds
/// [h1 | h3] = [round(X W1^T) | round(X W3^T)] per row, H (rows, F) the
/// activation round(silu(h1) * h3) (docs/contract.md §8). Written so that the
/// activation can be checked on its own, given the same GEMM outputs.
struct SwigluIntermediates {
  void* h13;
  void* H;
};

/// SwiGLU experts (docs/contract.md §8) over expert-major rows: expert j owns
/// counts[j] consecutive rows of X. W1, W3: (E_l, F, D); W2: (E_l, D, F).
/// Under ComputeDtype::bf16 the intermediates are bf16 (whatever dt is).
void experts_swiglu(const ExecCtx& ctx, DType dt, ExpertsImpl impl, const void* X,
                    const int64_t* counts, int E_l, int64_t D, int64_t F, const void* W1,
                    const void* W3, const void* W2, void* Y, const SwigluIntermediates& mid,
                    SwigluConventions conv = {});
/// The same with intermediates it allocates and drops.
void experts_swiglu(const ExecCtx& ctx, DType dt, ExpertsImpl impl, const void* X,
                    const int64_t* counts, int E_l, int64_t D, int64_t F, const void* W1,
                    const void* W3, const void* W2, void* Y);

/// Fused and transposed weights of the batched experts (docs/contract.md §8,
/// docs/frameworks.md §8.1): W13 = [W1; W3] per expert, (E_l, 2F, D), the first F rows
/// the W1 part; W2T = W2^T, (E_l, F, D). Keyed by an explicit weight version
/// that the caller bumps whenever the weights change (no pointer keys).
struct BatchedWeightCache {
  uint64_t version = 0;  // 0: empty
  std::vector<uint8_t> w13, w2t;
  int builds = 0;
};

/// Batched equal-count SwiGLU: every one of the E_l experts has exactly c > 0
/// rows. h13 = X_j W13_j^T (one GEMM of width 2F), H = swiglu(h13),
/// Y_j = H W2T_j. Rebuilds the cache when `weights_version` differs.
void experts_swiglu_batched(const ExecCtx& ctx, DType dt, const void* X, int64_t c, int E_l, int64_t D, int64_t F,
                            const void* W1, const void* W3, const void* W2, uint64_t weights_version,
                            BatchedWeightCache& cache, void* Y, const SwigluIntermediates& mid,
                            SwigluConventions conv = {});
/// The same with intermediates it allocates and drops.
void experts_swiglu_batched(const ExecCtx& ctx, DType dt, const void* X, int64_t c, int E_l, int64_t D, int64_t F,
                            const void* W1, const void* W3, const void* W2, uint64_t weights_version,
                            BatchedWeightCache& cache, void* Y);

/// Y (rows, n; row stride ldy) = round_act(X (rows, k; row stride ldx) W^T)
/// with W (n, k) row-major and fp32 accumulation (the SwiGLU GEMMs).
void gemm_nt(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n,
             void* Y, int64_t ldy);
/// The same with W (k, n) row-major: Y = round_act(X W).
void gemm_nn(const ExecCtx& ctx, DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n,
             void* Y, int64_t ldy);

/// One GEMM of a grouped call (gemm_group, Device::gemm_group): fp32
/// accumulation, row-major operands.
///   nt:     c (rows, n; ld ldc) = round_dt(a (rows, k; ld lda) b^T), b (n, k) dense
///   nn:     c (rows, n; ld ldc) = round_dt(a b), b (k, n) dense
///   nn_f32: c (rows, n; ld ldc) fp32 = a b, unrounded (a partial sum)
///   tn_f32: c (k, n) dense fp32 = a^T b, a (rows, k; ld lda), b (rows, n; ld ldb);
///           rows == 0 gives c = 0
/// ldb is read by tn_f32 only, ldc by the others. Each job gives what
/// gemm_nt, gemm_nn or gemm_tn_f32 gives for it alone (nn_f32: gemm_nn's
/// sum before its rounding).
enum class GemmOp : uint8_t { nt, nn, nn_f32, tn_f32 };
struct GemmJob {
  GemmOp op = GemmOp::nt;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  int64_t rows = 0, k = 0, n = 0, lda = 0, ldb = 0, ldc = 0;
};

struct ByteRange {
  const void* p = nullptr;
  size_t bytes = 0;
};

/// One job as its single entry point (gemm_nt, gemm_nn or gemm_tn_f32).
void gemm_job(const ExecCtx& ctx, DType dt, const GemmJob& job);

/// Independent GEMMs (no job reads what another writes) as one call: on the
/// host each job in turn; on the mirror's device one grouped GEMM (a
/// GPU's grouped cuBLAS call, issue 36 item 3) after translating the jobs'
/// addresses, which must lie inside `inputs` (a, b) and `outputs` (c): the
/// whole buffers the jobs read and write, each moved once.
void gemm_group(const ExecCtx& ctx, DType dt, const std::vector<GemmJob>& jobs, std::initializer_list<ByteRange> inputs,
                std::initializer_list<ByteRange> outputs);

/// dst = src (bytes bytes, no overlap): identity experts. A memcpy on the
/// host; a device-to-device copy on the mirror's device.
void copy_bytes(const ExecCtx& ctx, void* dst, const void* src, size_t bytes);

struct CombineArgs {
  DType dt = DType::fp32;
  const void* routed_out = nullptr;  // (N, D)
  const float* score_sorted = nullptr;
  const int32_t* row_of = nullptr;   // (T*K)
  int64_t rows = 0;                  // N, the rows of routed_out and score_sorted (read on a device, ExecCtx::mirror)
  const void* shared = nullptr;      // (T, D), read when shared_add == add_after
  int64_t T = 0, D = 0;
  int K = 0;
  k::ScoreApply apply = k::ScoreApply::after_experts;
  k::Accumulate acc = k::Accumulate::per_add;
  k::SharedAdd shared_add = k::SharedAdd::none;
  k::ScoreMultiply smul = k::ScoreMultiply::fp32;
};

/// Out-of-place combine: out = init + ordered scatter (init and out distinct).
void combine(const ExecCtx& ctx, const CombineArgs& a, const void* init, void* out);
/// Out-of-place combine from zeros: out = 0 + ordered scatter (docs/contract.md §2,
/// the default target), without reading or allocating an init buffer.
void combine_from_zeros(const ExecCtx& ctx, const CombineArgs& a, void* out);

bool ranges_overlap(ByteRange a, ByteRange b);

enum class Placement : uint8_t { in_place, out_of_place_fallback };

struct InPlaceResult {
  Placement placement;
  std::string reason;  // which input the buffer overlapped, when it fell back
};

/// What an in-place combine's buffer holds before the add (combine_in_place):
/// - as_is: the caller's values, as they stand;
/// - zeros: it is set to zeros first;
/// - copy: it is set to a copy of `from` (T x D, overlapping no byte of it) first.
/// zeros and copy write the buffer where the combine runs (on a mirror's
/// device, with the device's own fill or copy), so a buffer that is a new
/// device output is never built on the host and uploaded.
struct BufferStart {
  enum class Kind : uint8_t { as_is, zeros, copy } kind = Kind::as_is;
  const void* from = nullptr;
};

/// In-place combine (docs/contract.md §9): adds into `buf` (which holds the initial
/// value, once `start` is written) when buf overlaps none of `protected_inputs` by
/// any byte; otherwise writes the initial value (buf's contents as they are, or
/// the start) + scatter into `fallback` and writes nothing into buf.
InPlaceResult combine_in_place(const ExecCtx& ctx, const CombineArgs& a, void* buf,
                               void* fallback, const ByteRange* protected_inputs,
                               const char* const* input_names, int num_inputs, BufferStart start = {});

}  // namespace moev
