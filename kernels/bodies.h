// Single-source kernel bodies (docs/architecture.md idea 2). Each body is a functor over
// an index space (item, lane, lanes): the host executor calls it with lane 0 of
// 1 for every item; the CUDA executor maps item to a block and lane to a
// thread. Nothing here allocates, and every body is deterministic: no atomics,
// each output element is written by exactly one (item, lane).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace moev::k {

constexpr int kMaxTopK = 32;    // per-token scratch in the combine body
/// Columns of one combine span on the host executor: the span's running
/// values (kCombineSpan fp32, 1 KiB) stay in L1 while the K routed rows
/// stream through, and the inner loops over the span are contiguous.
constexpr int kCombineSpan = 256;
constexpr int kMaxGroups = 64;  // per-token scratch in group-limited routing

enum class ScoreFunc : uint8_t { softmax, sigmoid };
enum class Selection : uint8_t { topk, force_load_balance };
enum class RouteNorm : uint8_t { off, on };
enum class TieBreak : uint8_t { lower_id, higher_id /* planted fault */ };
enum class Accumulate : uint8_t { per_add, fp32_accumulate };
enum class ScoreApply : uint8_t { after_experts, before_experts };
enum class SharedAdd : uint8_t { none, add_after };
/// Where the combine's scatter target starts: the `init` buffer, or zeros
/// (the default out-of-place combine, which then reads no init buffer).
enum class CombineInit : uint8_t { buffer, zeros };
enum class CombineOrder : uint8_t { ascending_row, descending_row /* planted fault */ };
enum class SoftmaxShift : uint8_t { subtract_max, none /* planted fault */ };
enum class GroupTie : uint8_t { lower_group, higher_group /* planted fault */ };
/// The type the router's scores are held in (docs/contract.md §14
/// `router.score_dtype`): fp32, or the activation dtype.
enum class ScoreHeld : uint8_t { fp32, bf16, fp16 };
/// Planted faults of held scores: the scores themselves left in fp32, or the
/// route_norm denominator taken from the fp32 sum without its act rounding.
enum class HeldFault : uint8_t { none, scores_fp32, norm_sum_fp32 };
/// The SwiGLU activation's rounding points (docs/contract.md §8, §14 `experts.rounding`):
/// `fused` rounds once, H = round(silu(h1) * h3); `rounded_to_act` rounds
/// silu(h1) to the activation dtype first, as every torchtitan expert path
/// does (docs/frameworks.md §8.1: silu and mul in bf16). The planted fault silu_rounded applies the second
/// where the case says `fused`.
enum class SiluRounding : uint8_t { fused, rounded_to_act };
/// The score multiply (docs/contract.md §14 `score_multiply`): `fp32` multiplies by
/// the fp32 score, `act` by the score rounded to the activation dtype first
/// (docs/frameworks.md §2.2 step 1, the FK variant: ezpz PR #11 `routed_output * score.to(bf16)`).
enum class ScoreMultiply : uint8_t { fp32, act };
/// FP8 block scales (docs/contract.md §16): s = amax / 448 in fp32, or that
/// rounded up to a power of two (UE8M0, DeepGEMM's recipe on newer GPUs).
enum class Fp8Scale : uint8_t { fp32, ue8m0 };
/// The quotient that is rounded to e4m3: x * (1 / s) (DeepGEMM's helpers),
/// x * (448 / amax) (DeepEP's older tests; fp32 scales only) or x / s, one
/// correctly rounded fp32 division (DeepSeek-V3's act_quant kernel).
enum class Fp8Quotient : uint8_t { reciprocal, amax_ratio, divide };

/// v as the router holds it: rounded to bf16 or fp16, or left in fp32.
MOEV_HD inline float hold_as(ScoreHeld held, float v) {
  return held == ScoreHeld::bf16 ? round_to<bf16>(v) : held == ScoreHeld::fp16 ? round_to<fp16>(v) : v;
}

/// e^v from additions, multiplications and exponent bits only, so that the
/// host and CUDA executors give the same bits (a library expf differs: CUDA's
/// is within 2 ulp, glibc's within 0.5; both builds compile without FMA
/// contraction). Cody-Waite reduction v = n ln2 + r, |r| <= ln2/2, with ln2
/// split so that n * ln2_hi is exact; a degree-7 Taylor polynomial for e^r
/// (truncation below 0.1 ulp); then 2^n from its exponent bits, in two steps
/// where the result is subnormal so that it rounds once. Overflow past
/// ln(FLT_MAX) gives inf, underflow below the smallest subnormal's half 0,
/// NaN stays NaN. Within 2 ulp of e^v (tests/test_numeric.cpp measures it).
MOEV_HD inline float k_pow2(int e) { return f32_from_bits(uint32_t(e + 127) << 23); }  // e in [-126, 127]
MOEV_HD inline float k_exp(float v) {
  if (!(v == v)) return v;
  if (v > 88.72283935546875f) return INFINITY;
  if (v < -103.972084045410156f) return 0.f;
  const float n = floorf(v * 1.44269502162933349609f + 0.5f);
  const float r = (v - n * 0.693145751953125f) - n * 1.42860676533018704e-06f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
  const int e = int(n);
  if (e < -126) return p * k_pow2(e + 64) * k_pow2(-64);
  if (e > 127) return p * 2.f * k_pow2(e - 1);
  return p * k_pow2(e);
}

/// Router for one token (docs/contract.md §1, steps 1-8). Layout: logits and
/// scores are (T, E) row-major fp32, choice T * E fp32 (choice_expert_major);
/// ids and topk_scores are (T, K), the K entries in descending choice order,
/// ties to the lower id.
///
/// A thread-per-item body (kThreadPerItem, host_exec.h): every executor runs
/// a token as lane 0 of 1, a GPU one token per thread, so each token's steps
/// run in one order everywhere (the reductions in ascending expert order, the
/// selection as K passes) and the bits are the host's by construction. A
/// block per token, its lanes meeting at barriers between the E-wide steps,
/// left one thread busy through the serial selection while the others
/// waited: 56 ms for DeepSeek-V3's 32,768 tokens on an H100 (docs/guide.md).
struct RouterBody {
  const float* logits;
  const float* bias;  // (E) fp32 selection bias; all zeros when the case has none
  float* scores;
  float* choice;      // scratch, see choice_expert_major; a chosen expert's entry ends as kTaken
  int32_t* ids;
  float* topk_scores;
  int64_t T;
  int E, K, groups, limited_groups;
  float route_scale;
  ScoreFunc score;
  Selection selection;
  RouteNorm norm;
  TieBreak tie;
  SoftmaxShift shift = SoftmaxShift::subtract_max;
  GroupTie group_tie = GroupTie::lower_group;
  // Scores held in act (docs/contract.md §14 router.score_dtype): each score,
  // the normalisation's sum and quotients, the scaled values, and each group
  // score where the choice values are the scores (no bias) rounded to it.
  ScoreHeld held = ScoreHeld::fp32;
  bool biased = false;
  HeldFault held_fault = HeldFault::none;
  // Where token t's choice value of expert e lives: choice[t * E + e]
  // (token-major: a host thread walks its token's values in order), or
  // choice[e * T + t] (expert-major: a GPU warp's 32 tokens read 32
  // neighbouring floats at each step of a scan, one 128-byte line instead of
  // 32). Addresses only; the values and their order are the same.
  bool choice_expert_major = false;
  // The scores and choice values are already written (RouterScoresBody, a
  // device's sigmoid routing): operator() goes straight to the selection.
  bool scores_given = false;

  static constexpr bool kThreadPerItem = true;

  MOEV_HD float hold(float v) const { return hold_as(held, v); }

  /// Token t's choice values: element e at c[e * step].
  struct Choice {
    float* c;
    int64_t step;
    MOEV_HD float& operator[](int64_t e) const { return c[e * step]; }
  };
  MOEV_HD Choice choice_of(int64_t t) const {
    return choice_expert_major ? Choice{choice + t, T} : Choice{choice + t * E, 1};
  }

  /// Step 2 for sigmoid and step 3, one expert: the score as held, and into
  /// c the choice value score + bias where the case selects.
  MOEV_HD void sigmoid_score(float l, int e, float& s, float& c) const {
    s = 1.f / (1.f + k_exp(-l));
    if (held_fault != HeldFault::scores_fp32) s = hold(s);
    if (selection != Selection::force_load_balance) c = s + bias[e];
  }

  MOEV_HD void operator()(int64_t t, int, int) const {
    const float* l = logits + t * E;
    float* s = scores + t * E;
    const Choice c = choice_of(t);
    if (scores_given) return select_top_k(t, s, c);
    if (score == ScoreFunc::sigmoid) {
      for (int e = 0; e < E; ++e) sigmoid_score(l[e], e, s[e], c[e]);
      return select_top_k(t, s, c);
    }
    // softmax: exp(l - max) never overflows; exp(l) does past l ~ 88.7 in
    // fp32 (inf / inf = NaN). The planted fault drops the shift
    // (docs/frameworks.md §1.2 step 2).
    float m = l[0];
    for (int e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
    if (shift == SoftmaxShift::none) m = 0.f;
    float sum = 0.f;
    for (int e = 0; e < E; ++e) {
      s[e] = k_exp(l[e] - m);
      sum += s[e];
    }
    // the normalised (held) scores, and the choice values score + bias
    const bool select = selection != Selection::force_load_balance;
    for (int e = 0; e < E; ++e) {
      s[e] = s[e] / sum;
      if (held_fault != HeldFault::scores_fp32) s[e] = hold(s[e]);
      if (select) c[e] = s[e] + bias[e];
    }
    select_top_k(t, s, c);
  }

  /// Steps 4-8: the group limit, the top-k, the gathered scores, their
  /// normalisation and the route scale. The chosen ids are kept in registers
  /// (`id`) and written once.
  ///
  /// Each of the K passes scans the untaken experts in ascending order: the
  /// first sets `best`, a later one replaces it where its choice value is
  /// greater (or equal, under the planted higher_id fault). A NaN is never
  /// greater, nor is anything greater than a NaN, so a NaN is chosen only
  /// where it is the first untaken expert. A chosen expert's choice value is
  /// overwritten with kTaken, a signalling NaN that no arithmetic produces
  /// (every operation on a NaN returns a quiet one, and the choice values
  /// are sums), so a scan tests one loaded value instead of the K ids, and
  /// its loads do not wait on one another.
  static constexpr uint32_t kTaken = 0x7fa0dead;

  MOEV_HD void select_top_k(int64_t t, const float* s, const Choice& c) const {
    int32_t id[kMaxTopK];
    float* ts = topk_scores + t * K;
    if (selection == Selection::force_load_balance) {
      for (int k = 0; k < K; ++k) id[k] = int32_t((t * K + k) % E);
    } else {
      if (groups > 1) mask_groups(c);
      for (int k = 0; k < K; ++k) {
        int best = -1;
        float bv = 0.f;
#ifdef __CUDA_ARCH__
#pragma unroll 8
#endif
        for (int e = 0; e < E; ++e) {
          const float v = c[e];
          if (f32_bits(v) == kTaken) continue;
          if (best < 0 || v > bv || (tie == TieBreak::higher_id && v == bv)) {
            best = e;
            bv = v;
          }
        }
        id[k] = best;
        c[best] = f32_from_bits(kTaken);
      }
    }
    for (int k = 0; k < K; ++k) {
      ids[t * K + k] = id[k];
      ts[k] = s[id[k]];
    }
    if (norm == RouteNorm::on) {
      float sum = 0.f;
      for (int k = 0; k < K; ++k) sum += ts[k];
      const float d = held_fault == HeldFault::norm_sum_fp32 ? sum + 1e-20f : hold(hold(sum) + 1e-20f);
      for (int k = 0; k < K; ++k) ts[k] = hold(ts[k] / d);
    }
    for (int k = 0; k < K; ++k) ts[k] = hold(ts[k] * route_scale);
  }

  // Group score = sum of the two largest choice values of the group; the best
  // `limited_groups` groups stay (ties to the lower group), the rest get -inf.
  MOEV_HD void mask_groups(const Choice& c) const {
    const int per = E / groups;
    float gs[kMaxGroups];
    for (int g = 0; g < groups; ++g) {
      float a = -INFINITY, b = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (c[e] > a) { b = a; a = c[e]; } else if (c[e] > b) { b = c[e]; }
      }
      gs[g] = biased ? a + b : hold(a + b);
    }
    bool keep[kMaxGroups];
    for (int g = 0; g < groups; ++g) keep[g] = false;
    for (int n = 0; n < limited_groups; ++n) {
      int best = -1;
      for (int g = 0; g < groups; ++g)
        if (!keep[g] && (best < 0 || gs[g] > gs[best] || (group_tie == GroupTie::higher_group && gs[g] == gs[best])))
          best = g;
      keep[best] = true;
    }
    for (int g = 0; g < groups; ++g)
      if (!keep[g])
        for (int e = g * per; e < (g + 1) * per; ++e) c[e] = -INFINITY;
  }
};

/// Steps 2 and 3 of sigmoid routing as a row body, a device's first pass:
/// item = token t, lane `lane` of `lanes` over its experts, each expert's
/// score and choice value exactly as RouterBody computes them
/// (sigmoid_score), so a GPU's lanes read the logits and write the scores in
/// neighbouring floats and the exponentials of all tokens run in parallel
/// instead of in each token's thread. RouterBody then runs with scores_given.
struct RouterScoresBody {
  RouterBody r;
  MOEV_HD void operator()(int64_t t, int lane, int lanes) const {
    const RouterBody::Choice c = r.choice_of(t);
    for (int e = lane; e < r.E; e += lanes) r.sigmoid_score(r.logits[t * r.E + e], e, r.scores[t * r.E + e], c[e]);
  }
};

/// 16-byte moves of row data (load_piece, store_piece, zero16 below): a
/// GPU thread's widest single load and store (ld/st.global.v4), so a warp
/// moves 512 contiguous bytes per instruction instead of 64 with 2-byte
/// elements. Addresses 16-byte aligned.
MOEV_HD inline void zero16(void* dst) {
#ifdef __CUDA_ARCH__
  *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
#else
  memset(dst, 0, 16);
#endif
}
/// Whether a row span [p, p + bytes) may move in 16-byte pieces.
MOEV_HD inline bool aligned16(const void* p, int64_t bytes) {
  return ((reinterpret_cast<uintptr_t>(p) | uintptr_t(bytes)) & 15) == 0;
}

/// 16 bytes of a row held in registers (one ld/st.global.v4 on a GPU), and
/// element i of it as T (little-endian: element 0 in the low bits of w[0]).
/// A value, not an array in memory, so that nothing spills to local memory.
struct Piece {
  uint32_t w[4];
};
MOEV_HD inline Piece load_piece(const void* p) {
#ifdef __CUDA_ARCH__
  const uint4 u = *static_cast<const uint4*>(p);
  return Piece{{u.x, u.y, u.z, u.w}};
#else
  Piece r;
  memcpy(&r, p, 16);
  return r;
#endif
}
MOEV_HD inline void store_piece(void* p, const Piece& r) {
#ifdef __CUDA_ARCH__
  *static_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
#else
  memcpy(p, &r, 16);
#endif
}
/// Asynchronous 16-byte copies from global to shared memory, as a GPU
/// thread's staging of row pieces (CombineBody::lane_staged): on a GPU
/// cp.async (into `dst` in shared memory), committed as a group, and a wait
/// until at most `pending` of the thread's groups are in flight; on the
/// host a plain copy, and the commit and wait do nothing. Each is a memory
/// clobber on a GPU: the compiler keeps a thread's reads of a slot before
/// the copies that refill it, and after the wait that completes them.
MOEV_HD inline void copy_piece_async(Piece* dst, const void* src) {
#ifdef __CUDA_ARCH__
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
#else
  memcpy(dst, src, 16);
#endif
}
MOEV_HD inline void commit_pieces() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int pending>
MOEV_HD inline void wait_pieces() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
}
template <class T>
MOEV_HD inline float piece_get(const Piece& r, int i) {
  T e;
  if constexpr (sizeof(T) == 4) {
    memcpy(&e, &r.w[i], 4);
  } else {
    const uint16_t b = uint16_t(r.w[i >> 1] >> ((i & 1) * 16));
    memcpy(&e, &b, 2);
  }
  return to_float(e);
}

/// A lane's pieces c, c + step, ..., c + (kPieceBatch - 1) step of a row
/// (16-byte pieces from byte address s), those below `pieces`, all loaded
/// before the caller stores any: the compiler cannot move a load above a
/// store that might alias it, so a load-store loop keeps one load in flight
/// a thread. copy_row and the dispatch's scatter move rows this way.
constexpr int kPieceBatch = 4;
struct PieceBatch {
  Piece p[kPieceBatch];
  bool has[kPieceBatch];
};
MOEV_HD inline PieceBatch load_batch(const void* s, int64_t c, int64_t step, int64_t pieces) {
  PieceBatch b;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int j = 0; j < kPieceBatch; ++j) {
    b.has[j] = c + j * step < pieces;
    b.p[j] = b.has[j] ? load_piece(static_cast<const char*>(s) + 16 * (c + j * step)) : Piece{};
  }
  return b;
}

/// The piece holding from_float<T> of the 16 / sizeof(T) values v, element
/// 0 lowest; the 2-byte types convert in pairs (pack_pairs: one packed
/// instruction a pair on a GPU), the same bits as from_float on each.
template <class T>
MOEV_HD inline Piece piece_of(const float (&v)[16 / sizeof(T)]) {
  Piece r;
  if constexpr (sizeof(T) == 4)
    for (int i = 0; i < 4; ++i) r.w[i] = f32_bits(v[i]);
  else
    pack_pairs<T, 4>(v, r.w);
  return r;
}

/// Copies the n elements of one row span, as lane `lane` of `lanes`. One
/// lane (the host executor) copies the contiguous span with memcpy, at copy
/// speed; several lanes (the CUDA executor) interleave 16-byte pieces where
/// both rows and the span are 16-byte aligned (rows of D * sizeof(T) bytes, D
/// a multiple of 8 in bf16), else elements, so neighbouring threads touch
/// neighbouring bytes (coalesced). A lane loads its pieces in batches of up
/// to four before it stores any (load_batch): with one load in flight, a
/// DeepSeek-V3 row (896 pieces, 256 lanes: three or four a lane) waited
/// three or four memory latencies in a row. A copy is the same bytes either
/// way.
template <class T>
MOEV_HD inline void copy_row(T* dst, const T* src, int64_t n, int lane, int lanes) {
  const int64_t bytes = n * int64_t(sizeof(T));
  if (lanes == 1) {
    memcpy(dst, src, size_t(bytes));
    return;
  }
  if (aligned16(dst, bytes) && aligned16(src, 0)) {
    char* d = reinterpret_cast<char*>(dst);
    const int64_t pieces = bytes / 16, step = lanes;
    for (int64_t c = lane; c < pieces; c += kPieceBatch * step) {
      const PieceBatch b = load_batch(src, c, step, pieces);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int j = 0; j < kPieceBatch; ++j)
        if (b.has[j]) store_piece(d + 16 * (c + j * step), b.p[j]);
    }
    return;
  }
  for (int64_t c = lane; c < n; c += lanes) dst[c] = src[c];
}

/// Zeroes the n elements of one row span (all-zero bits are +0 in every
/// activation type), as copy_row splits the work.
template <class T>
MOEV_HD inline void zero_row(T* dst, int64_t n, int lane, int lanes) {
  const int64_t bytes = n * int64_t(sizeof(T));
  if (lanes == 1) {
    memset(dst, 0, size_t(bytes));
    return;
  }
  if (aligned16(dst, bytes)) {
    char* d = reinterpret_cast<char*>(dst);
    for (int64_t c = lane; c < bytes / 16; c += lanes) zero16(d + 16 * c);
    return;
  }
  for (int64_t c = lane; c < n; c += lanes) dst[c] = from_float<T>(0.f);
}

/// Lanes for a GPU block that moves rows of `bytes` bytes in 16-byte pieces:
/// one piece per thread up to 256 threads, in whole warps (a D = 256 bf16 row
/// keeps one warp busy, DeepSeek-V3's D = 7168 a block of 256 with 3.5
/// pieces each). The CUDA executor asks bodies with a row width for it.
MOEV_HD inline int row_lanes(int64_t bytes) {
  const int64_t pieces = (bytes + 15) / 16;
  const int64_t warps = (pieces + 31) / 32;
  return int(warps < 1 ? 32 : warps > 8 ? 256 : warps * 32);
}

/// The radix bits that hold every key below `keys`: the least b >= 1 with
/// 2^b >= keys (the device's expert sort: 8 for the ids of E = 256
/// experts, one 8-bit pass, where 9 took two).
MOEV_HD constexpr int radix_key_bits(uint64_t keys) {
  int b = 1;
  while (b < 64 && (uint64_t(1) << b) < keys) ++b;
  return b;
}

/// The multiplier of a score s under score_multiply (docs/contract.md §14):
/// the fp32 score, or the score rounded to T first.
template <class T>
MOEV_HD inline float multiplier(float s, ScoreMultiply smul) {
  return smul == ScoreMultiply::act ? round_to<T>(s) : s;
}

/// A 16-byte piece of T with every element multiplied by m, each product
/// rounded once to T.
template <class T>
MOEV_HD inline Piece scaled_piece(const Piece& in, float m) {
  float v[16 / sizeof(T)];
  for (int j = 0; j < int(16 / sizeof(T)); ++j) v[j] = piece_get<T>(in, j) * m;
  return piece_of<T>(v);
}

/// dst = round(src * m) over a row span of n elements, as copy_row splits
/// the work: 16-byte pieces where several lanes meet aligned rows, else
/// elements. The same product and rounding per element either way.
template <class T>
MOEV_HD inline void scale_row(T* dst, const T* src, int64_t n, float m, int lane, int lanes) {
  constexpr int W = int(16 / sizeof(T));
  if (lanes > 1 && aligned16(dst, n * int64_t(sizeof(T))) && aligned16(src, 0)) {
    for (int64_t c = lane; c < n / W; c += lanes) store_piece(dst + c * W, scaled_piece<T>(load_piece(src + c * W), m));
    return;
  }
  for (int64_t c = lane; c < n; c += lanes) dst[c] = from_float<T>(to_float(src[c]) * m);
}

/// Local dispatch gather (docs/contract.md §2) for dispatch row i: perm[i] is the flat
/// assignment a = t*K + k of row i. Writes the row, token_sorted[i],
/// score_sorted[i] and the inverse map row_of[a] = i.
template <class T>
struct GatherBody {
  const T* x;              // (T, D)
  const int32_t* perm;     // (N)
  const float* topk_scores;  // (T*K)
  T* routed;               // (N, D)
  int32_t* token_sorted;   // (N)
  float* score_sorted;     // (N)
  int32_t* row_of;         // (N)
  int64_t D;
  int K;
  ScoreApply apply;
  ScoreMultiply smul = ScoreMultiply::fp32;

  MOEV_HD void operator()(int64_t i, int lane, int lanes) const {
    const int32_t a = perm[i];
    const int64_t t = a / K;
    const float s = topk_scores[a];
    if (lane == 0) {
      token_sorted[i] = int32_t(t);
      score_sorted[i] = s;
      row_of[a] = int32_t(i);
    }
    const T* src = x + t * D;
    T* dst = routed + i * D;
    if (apply == ScoreApply::before_experts) scale_row(dst, src, D, multiplier<T>(s, smul), lane, lanes);
    else copy_row(dst, src, D, lane, lanes);
  }
};

/// The local dispatch on a device, in two passes with the gather's results
/// (docs/contract.md §2). Pass 1, thread per dispatch row i: the metadata
/// token_sorted[i], score_sorted[i] and the inverse map row_of[perm[i]] = i.
struct DispatchMetaBody {
  const int32_t* perm;       // (N)
  const float* topk_scores;  // (T*K)
  int32_t* token_sorted;     // (N)
  float* score_sorted;       // (N)
  int32_t* row_of;           // (T*K)
  int K;

  static constexpr bool kThreadPerItem = true;

  MOEV_HD void operator()(int64_t i, int, int) const {
    const int32_t a = perm[i];
    token_sorted[i] = a / K;
    score_sorted[i] = topk_scores[a];
    row_of[a] = int32_t(i);
  }
};

/// Pass 2, item = token t: x's row t is read once and written to its K
/// dispatch rows row_of[t*K + k] (multiplied by its score first under
/// before_experts, as GatherBody does), where the gather reads it K times,
/// once per row: T + N rows move instead of 2 N (DeepSeek-V3, K = 8: 56% of
/// the gather's traffic). Every output element is written once, by the
/// lane that owns its column; the same bytes as GatherBody.
template <class T>
struct ScatterRowsBody {
  const T* x;                // (T, D)
  const float* topk_scores;  // (T*K)
  const int32_t* row_of;     // (T*K), every row in [0, N): no assignment dropped
  T* routed;                 // (N, D)
  int64_t D;
  int K;
  ScoreApply apply;
  ScoreMultiply smul = ScoreMultiply::fp32;

  MOEV_HD void operator()(int64_t t, int lane, int lanes) const {
    constexpr int W = int(16 / sizeof(T));
    const T* src = x + t * D;
    const int32_t* rows = row_of + t * K;
    const bool scaled = apply == ScoreApply::before_experts;
    auto score = [&](int k) { return multiplier<T>(topk_scores[t * K + k], smul); };
    if (lanes > 1 && aligned16(src, D * int64_t(sizeof(T))) && aligned16(routed, 0)) {
      // 16-byte pieces, each loaded once (in batches, as copy_row) and
      // stored K times
      const int64_t pieces = D / W, step = lanes;
      for (int64_t c = lane; c < pieces; c += kPieceBatch * step) {
        const PieceBatch b = load_batch(src, c, step, pieces);
        for (int k = 0; k < K; ++k) {
          T* dst = routed + int64_t(rows[k]) * D;
          const float m = scaled ? score(k) : 1.f;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
          for (int j = 0; j < kPieceBatch; ++j)
            if (b.has[j]) store_piece(dst + (c + j * step) * W, scaled ? scaled_piece<T>(b.p[j], m) : b.p[j]);
        }
      }
      return;
    }
    for (int k = 0; k < K; ++k) {
      T* dst = routed + int64_t(rows[k]) * D;
      if (scaled) scale_row(dst, src, D, score(k), lane, lanes);
      else copy_row(dst, src, D, lane, lanes);
    }
  }
};

/// SwiGLU activation for row r: H = round(silu(float(h1)) * float(h3)) in fp32
/// (docs/contract.md §8), with silu(h1) rounded to T first under rounded_to_act
/// (§14), and then H = round(float(H) * row_scale[r]) where a row scale is
/// given (§14 score_on_hidden). h13 holds rows of width 2F: [h1 | h3] (W13
/// order, §8.1).
template <class T>
struct SwigluBody {
  const T* h13;  // (rows, 2F)
  T* H;          // (rows, F)
  int64_t F;
  SiluRounding silu_rounding = SiluRounding::fused;
  const float* row_scale = nullptr;  // (rows) or none

  MOEV_HD void operator()(int64_t r, int lane, int lanes) const {
    const T* h1 = h13 + r * 2 * F;
    const T* h3 = h1 + F;
    for (int64_t f = lane; f < F; f += lanes) {
      const float a = to_float(h1[f]);
      float silu = a / (1.f + k_exp(-a));
      if (silu_rounding == SiluRounding::rounded_to_act) silu = to_float(from_float<T>(silu));
      H[r * F + f] = from_float<T>(silu * to_float(h3[f]));
      if (row_scale) H[r * F + f] = from_float<T>(to_float(H[r * F + f]) * row_scale[r]);
    }
  }
};

/// Ordered combine for token t (docs/contract.md §2, §9): the K dispatch rows of the
/// token, row_of[t*K + k], are visited in ascending row order (= ascending
/// expert id) and each contribution y = round(float(routed_out[row]) * s) is
/// added per the accumulate mode, starting from init[t]. No atomics: the token
/// owns its output row. `out` may equal `init` (in-place): a span reads its
/// init values before it writes them; `out` must overlap no other input,
/// which the caller guarantees (combine_in_place).
///
/// Index space: item = token; lane `lane` of `lanes` owns the column spans
/// [c0, c0 + W) with c0 = (lane + j * lanes) * W. The host executor runs lane
/// 0 of 1 with W = kCombineSpan: the row is walked in L1-sized spans, each
/// with contiguous, branch-free inner loops over the span (vectorised). A
/// device runs W = kDeviceSpan<T>: 16 bytes of columns per thread, one
/// vector load per routed row, neighbouring threads on neighbouring pieces
/// (coalesced). In place, a lane reads its init piece before it stores it,
/// and no other lane touches that piece. Every column
/// goes through the same operations in the same order whatever W, so the
/// result is bit-identical across executors and span widths.
template <class T, int W = 1>
struct CombineBody {
  const T* routed_out;   // (N, D)
  const float* score_sorted;  // (N)
  const int32_t* row_of;      // (T*K)
  const T* init;         // (T, D) initial value of the scatter target; unread under CombineInit::zeros
  const T* shared;       // (T, D) added after the scatter when shared_add == add_after
  T* out;                // (T, D)
  int64_t D;
  int K;
  ScoreApply apply;
  Accumulate acc;
  SharedAdd shared_add;
  CombineOrder order;
  ScoreMultiply smul = ScoreMultiply::fp32;
  CombineInit init_from = CombineInit::buffer;

  /// Routed-row pieces a device lane loads before it adds the first of them
  /// (span_pieces; CombineBatchBody times others).
  static constexpr int kBatch = 4;

  MOEV_HD void operator()(int64_t t, int lane, int lanes) const { token<kBatch>(t, lane, lanes); }

  /// Token t's spans of one lane, B routed rows' pieces loaded at a time on
  /// a device (span_pieces<B>; CombineBatchBody sets B).
  template <int B>
  MOEV_HD void token(int64_t t, int lane, int lanes) const {
    int32_t rows[kMaxTopK];
    const int n = sorted_rows(t, rows);
    for (int64_t c0 = int64_t(lane) * W; c0 < D; c0 += int64_t(lanes) * W)
      span<B>(t, rows, n, c0, D - c0 < W ? int(D - c0) : W);
  }

  /// Token t's routed rows in the order they are added (`order`), those
  /// dropped by capacity (row -1, docs/contract.md §11) left out: adds
  /// nothing. Returns their count.
  MOEV_HD int sorted_rows(int64_t t, int32_t (&rows)[kMaxTopK]) const {
    int n = 0;
    for (int k = 0; k < K; ++k) {
      const int32_t r = row_of[t * K + k];
      if (r < 0) continue;
      int j = n++;
      while (j > 0 && (order == CombineOrder::ascending_row ? rows[j - 1] > r : rows[j - 1] < r)) {
        rows[j] = rows[j - 1];
        --j;
      }
      rows[j] = r;
    }
    return n;
  }

  /// The device span's steps, on W columns = one 16-byte piece a buffer
  /// (span_pieces), the values those of span() and
  /// add_row with the roundings two elements at a time (round_pairs).
  /// row_multiplier: the multiplier add_row takes for routed row r (1 where
  /// the score was applied before the experts).
  MOEV_HD float row_multiplier(int32_t r) const {
    return apply == ScoreApply::after_experts ? multiplier<T>(score_sorted[r], smul) : 1.f;
  }
  /// v = token t's scatter target at columns [c0, c0 + W).
  MOEV_HD void init_piece(float (&v)[W], int64_t t, int64_t c0) const {
    init_from_piece(v, init_from == CombineInit::zeros ? Piece{} : load_piece(init + t * D + c0));
  }
  /// v = the scatter target from its piece `in` (unread under CombineInit::zeros).
  MOEV_HD void init_from_piece(float (&v)[W], const Piece& in) const {
    for (int i = 0; i < W; ++i) v[i] = init_from == CombineInit::zeros ? 0.f : piece_get<T>(in, i);
  }
  /// v (+)= one routed row's piece p with its multiplier m (row_multiplier):
  /// the contribution round(y * m) under after_experts, y under
  /// before_experts; per_add rounds each sum.
  MOEV_HD void add_piece(float (&v)[W], const Piece& p, float m) const {
    float y[W];
    for (int i = 0; i < W; ++i) y[i] = piece_get<T>(p, i);
    if (apply == ScoreApply::after_experts) {
      for (int i = 0; i < W; ++i) y[i] *= m;
      round_pairs<T, W / 2>(y);
    }
    for (int i = 0; i < W; ++i) v[i] += y[i];
    if (acc == Accumulate::per_add) round_pairs<T, W / 2>(v);
  }
  /// The rounding of an fp32 sum, the shared experts' output added, and the
  /// piece stored at out.
  MOEV_HD void finish_piece(float (&v)[W], int64_t t, int64_t c0) const {
    if (acc == Accumulate::fp32_accumulate) round_pairs<T, W / 2>(v);
    if (shared_add == SharedAdd::add_after) {
      const Piece sh = load_piece(shared + t * D + c0);
      for (int i = 0; i < W; ++i) v[i] += piece_get<T>(sh, i);
      round_pairs<T, W / 2>(v);
    }
    store_piece(out + t * D + c0, piece_of<T>(v));
  }

  /// Columns [c0, c0 + n) of token t, n <= W, from its nrows rows. v holds the running value:
  /// representable in T under per_add (rounded after every addition), the
  /// fp32 sum under fp32_accumulate (rounded once at the end).
  template <int B = kBatch>
  MOEV_HD void span(int64_t t, const int32_t* rows, int nrows, int64_t c0, int n) const {
    if constexpr (W * sizeof(T) == 16) {
      if (n == W && pieces_aligned(t, c0)) return span_pieces<B>(t, rows, nrows, c0);
    }
    float v[W];
    if (init_from == CombineInit::zeros) {
      for (int i = 0; i < n; ++i) v[i] = 0.f;
    } else {
      const T* in = init + t * D + c0;
      for (int i = 0; i < n; ++i) v[i] = to_float(in[i]);
    }
    for (int k = 0; k < nrows; ++k) {
      const T* y = routed_out + int64_t(rows[k]) * D + c0;
      add_row(v, n, row_multiplier(rows[k]), [&](int i) { return to_float(y[i]); });
    }
    if (acc == Accumulate::fp32_accumulate)
      for (int i = 0; i < n; ++i) v[i] = round_to<T>(v[i]);
    if (shared_add == SharedAdd::add_after) {
      const T* sh = shared + t * D + c0;
      for (int i = 0; i < n; ++i) v[i] = round_to<T>(v[i] + to_float(sh[i]));
    }
    T* o = out + t * D + c0;
    for (int i = 0; i < n; ++i) o[i] = from_float<T>(v[i]);
  }

  /// v[i] (+)= the contribution of one routed row, y(i) its element i as
  /// fp32 and m its multiplier (row_multiplier): one per accumulate mode and
  /// score placement (add_piece on a device piece).
  template <class Y>
  MOEV_HD void add_row(float* v, int n, float m, const Y& y) const {
    if (apply == ScoreApply::after_experts) {
      if (acc == Accumulate::per_add)
        for (int i = 0; i < n; ++i) v[i] = round_to<T>(v[i] + round_to<T>(y(i) * m));
      else
        for (int i = 0; i < n; ++i) v[i] += round_to<T>(y(i) * m);
    } else {
      if (acc == Accumulate::per_add)
        for (int i = 0; i < n; ++i) v[i] = round_to<T>(v[i] + y(i));
      else
        for (int i = 0; i < n; ++i) v[i] += y(i);
    }
  }

  /// Whether every buffer the span [c0, c0 + W) of token t touches is
  /// 16-byte aligned there (c0 is a multiple of W, so a row's piece is
  /// aligned when the row stride D * sizeof(T) and the base are).
  MOEV_HD bool pieces_aligned(int64_t t, int64_t c0) const {
    const int64_t stride = D * int64_t(sizeof(T));
    return aligned16(routed_out, stride) && aligned16(out + t * D + c0, 0) &&
           (init_from == CombineInit::zeros || aligned16(init + t * D + c0, 0)) &&
           (shared_add != SharedAdd::add_after || aligned16(shared + t * D + c0, 0));
  }

  /// The device span: the same additions as span() on W columns read as
  /// 16-byte pieces held in registers, B rows' pieces loaded before the
  /// first of them is added (B loads in flight a thread), and the result
  /// stored as one piece. B changes when loads are issued, never the order
  /// of the additions: the bits do not depend on it.
  template <int B = kBatch>
  MOEV_HD void span_pieces(int64_t t, const int32_t* rows, int nrows, int64_t c0) const {
    float v[W];
    init_piece(v, t, c0);
    for (int k0 = 0; k0 < nrows; k0 += B) {
      Piece pc[B];
      float m[B] = {};  // read only where set (k0 + j < nrows)
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int j = 0; j < B; ++j)
        if (k0 + j < nrows) {
          pc[j] = load_piece(routed_out + int64_t(rows[k0 + j]) * D + c0);
          m[j] = row_multiplier(rows[k0 + j]);
        }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int j = 0; j < B; ++j)
        if (k0 + j < nrows) add_piece(v, pc[j], m[j]);
    }
    finish_piece(v, t, c0);
  }

  /// A lane's staging area for lane_staged, in pieces: two slots of kBatch
  /// row pieces and an init piece, and one of padding (on a GPU, 8
  /// neighbouring threads' areas, 176 bytes apart, put their 16-byte pieces
  /// in distinct shared-memory banks).
  static constexpr int kStagedPieces = 2 * (kBatch + 1) + 1;
  /// Token t on one lane whose rows are aligned (pieces_aligned: D a
  /// multiple of W, every span full): its spans c0 = first, first + step,
  /// ... < D, each in span_pieces' steps and order (the same bits), the
  /// pieces of the next step (kBatch routed rows; after a span's last, the
  /// next span's first with its init piece) copied asynchronously into the
  /// lane's other slot of `area` (kStagedPieces) before the current step's
  /// are added: up to two steps of loads in flight a thread without holding
  /// registers. A lane reads only the slots it filled, after the wait. In
  /// place, the next span's init piece is read before this span's store:
  /// other columns, which no other lane touches.
  MOEV_HD void lane_staged(int64_t t, const int32_t* rows, int nr, int64_t first, int64_t step, Piece* area) const {
    constexpr int P = kBatch + 1;  // a slot: kBatch pieces, then the init piece
    if (first >= D) return;
    const int nb = nr > 0 ? (nr + kBatch - 1) / kBatch : 1;  // a span without rows: one empty step
    const auto issue = [&](int slot, int64_t c0, int j) {
      Piece* p = area + slot * P;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int i = 0; i < kBatch; ++i)
        if (j * kBatch + i < nr) copy_piece_async(p + i, routed_out + int64_t(rows[j * kBatch + i]) * D + c0);
      if (j == 0 && init_from == CombineInit::buffer) copy_piece_async(p + kBatch, init + t * D + c0);
      commit_pieces();
    };
    int slot = 0;
    issue(slot, first, 0);
    float v[W];
    for (int64_t c0 = first;; c0 += step)
      for (int j = 0; j < nb; ++j, slot ^= 1) {
        const bool last = j + 1 == nb;
        const int64_t nc0 = last ? c0 + step : c0;
        const bool more = nc0 < D;
        if (more) {  // the next step's copies, then wait for every earlier step's
          issue(slot ^ 1, nc0, last ? 0 : j + 1);
          wait_pieces<1>();
        } else {
          wait_pieces<0>();
        }
        const Piece* p = area + slot * P;  // read as 16-byte loads (load_piece)
        if (j == 0) init_from_piece(v, init_from == CombineInit::buffer ? load_piece(p + kBatch) : Piece{});
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
        for (int i = 0; i < kBatch; ++i)
          if (j * kBatch + i < nr) add_piece(v, load_piece(p + i), row_multiplier(rows[j * kBatch + i]));
        if (last) finish_piece(v, t, c0);
        if (!more) return;
      }
  }
};

/// The combine with B routed rows' pieces loaded before the first is added
/// (CombineBody::span_pieces<B>) where CombineBody loads kBatch: more loads
/// in flight a thread for more registers (on sm_90, bf16: 64 registers at
/// 4, 91 at 8), the same bits. A device times it against the default
/// (kernels/cuda_exec.cu combine_batch).
template <class T, int W, int B>
struct CombineBatchBody : CombineBody<T, W> {
  MOEV_HD void operator()(int64_t t, int lane, int lanes) const { this->template token<B>(t, lane, lanes); }
};

/// The combine's span width on a device: 16 bytes of T per lane.
template <class T>
constexpr int kDeviceSpan = int(16 / sizeof(T));

/// The planted faults of the FP8 quantiser (docs/contract.md §16), as flags of
/// the body (src/core/faults.h names them).
struct Fp8QuantFaults {
  bool round_down = false;     // UE8M0 scale rounded down to a power of two
  bool straddle = false;       // amax window at token stride D + block/2: blocks straddle two tokens
  bool store_inverse = false;  // the quotient multiplier stored as the scale
};

/// FP8 quantisation (docs/contract.md §16) of item i = (token t, block b),
/// i = t * (D / block) + b. Layout: x (T, D) act, q (T, D) e4m3 bytes, scale
/// (T, D / block) fp32. amax = max |x| over the block, clamped below at
/// `clamp`; s = amax / 448 in fp32, rounded up to a power of two under
/// ue8m0; q = e4m3(x * (1 / s)), e4m3(x * (448 / amax)) or e4m3(x / s), each
/// product or quotient one fp32 rounding (nvcc: --prec-div=true). Every lane computes the block's amax (a max: the same bits
/// in any order), then encodes its strided elements; lane 0 writes the scale.
template <class T>
struct Fp8QuantBody {
  const T* x;
  e4m3* q;
  float* scale;
  int64_t tokens, D, block;
  float clamp;
  Fp8Scale mode;
  Fp8Quotient quotient;
  Fp8QuantFaults faults;

  MOEV_HD void operator()(int64_t i, int lane, int lanes) const {
    const int64_t nb = D / block, t = i / nb, b = i % nb;
    const int64_t start = t * D + b * block;
    int64_t w0 = faults.straddle ? t * (D + block / 2) + b * block : start;
    int64_t w1 = w0 + block;
    if (w1 > tokens * D) w1 = tokens * D;
    if (w0 > w1) w0 = w1;
    float amax = 0.f;
    for (int64_t j = w0; j < w1; ++j) {
      const float a = fabsf(to_float(x[j]));
      amax = a > amax ? a : amax;
    }
    amax = amax > clamp ? amax : clamp;
    float s = amax / 448.f;
    if (mode == Fp8Scale::ue8m0) {  // s is normal (clamp >= 1e-12): clear the mantissa, step the exponent up
      const uint32_t u = f32_bits(s);
      if (u & 0x7fffffu) s = f32_from_bits(faults.round_down ? (u & 0x7f800000u) : (u & 0x7f800000u) + 0x800000u);
    }
    const float mul = quotient == Fp8Quotient::amax_ratio ? 448.f / amax : 1.f / s;
    if (quotient == Fp8Quotient::divide)
      for (int64_t c = lane; c < block; c += lanes) q[start + c] = from_float<e4m3>(to_float(x[start + c]) / s);
    else
      for (int64_t c = lane; c < block; c += lanes) q[start + c] = from_float<e4m3>(to_float(x[start + c]) * mul);
    if (lane == 0) scale[i] = faults.store_inverse ? mul : s;
  }
};

/// FP8 dequantisation (docs/contract.md §16) of row r: out = round_act(float(q) * s)
/// with s the scale of the element's block, the product one fp32 rounding.
template <class T>
struct Fp8DequantBody {
  const e4m3* q;       // (rows, D)
  const float* scale;  // (rows, D / block)
  T* out;              // (rows, D)
  int64_t D, block;

  MOEV_HD void operator()(int64_t r, int lane, int lanes) const {
    const int64_t nb = D / block;
    for (int64_t c = lane; c < D; c += lanes)
      out[r * D + c] = from_float<T>(to_float(q[r * D + c]) * scale[r * nb + c / block]);
  }
};

/// Copies rows with an index map: dst[i] = src[map[i]] (map[i] < 0: zero row).
/// Used by permutes and padding; 64-bit row arithmetic throughout.
template <class T>
struct RowMapBody {
  const T* src;
  const int64_t* map;
  T* dst;
  int64_t D;

  MOEV_HD void operator()(int64_t i, int lane, int lanes) const {
    const int64_t m = map[i];
    T* d = dst + i * D;
    if (m < 0) zero_row(d, D, lane, lanes);
    else copy_row(d, src + m * D, D, lane, lanes);
  }
};

/// Copies rows with a computed index map: dst[i] = src[map(i)] (no table).
template <class T, class Map>
struct FnRowMapBody {
  const T* src;
  Map map;
  T* dst;
  int64_t D;

  MOEV_HD void operator()(int64_t i, int lane, int lanes) const {
    copy_row(dst + i * D, src + map(i) * D, D, lane, lanes);
  }
};

}  // namespace moev::k
