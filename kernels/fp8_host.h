// FP8 dispatch on the host executor (docs/contract.md §16; the `fp8_quant` and
// `fp8_dequant` slots and the FP8 row moves, src/paths/stages_fp8.cpp): the
// per-token block quantisation of the token rows before the dispatch, the
// dequantisation of the rows the experts take, and the scale rows' map of a
// permute. The bodies are k::Fp8QuantBody and k::Fp8DequantBody (bodies.h);
// with a mirror they run on its device.
#pragma once

#include <cstdint>
#include <vector>

#include "bodies.h"
#include "dtype.h"
#include "host_exec.h"

namespace moev {

struct Fp8Params {
  int64_t block = 128;
  k::Fp8Scale scale = k::Fp8Scale::fp32;
  k::Fp8Quotient quotient = k::Fp8Quotient::reciprocal;
  float clamp = 1e-4f;  // the case's amax clamp rounded to fp32
};

/// q (T, D) e4m3 bytes and scale (T, D / block) fp32 from x (T, D) in `dt`
/// (docs/contract.md §16). The planted faults fp8_ue8m0_round_down,
/// fp8_block_straddle and fp8_scale_inverse act here.
void fp8_quantise(const ExecCtx& ctx, DType dt, const void* x, int64_t T, int64_t D, const Fp8Params& p, void* q,
                  float* scale);

/// out (rows, D) in `dt` = round_act(float(q) * s), s the block's scale.
void fp8_dequantise(const ExecCtx& ctx, DType dt, const void* q, const float* scale, int64_t rows, int64_t D,
                    int64_t block, void* out);

/// The FP8 form of the local dispatch gather (docs/contract.md §2, §16): perm
/// (N) lists the assignments a = t*K + k in dispatch-row order (expert_sort);
/// row i of q_out / scale_out is token perm[i] / K's e4m3 row / scale row,
/// and token_sorted, score_sorted and row_of are those of the act gather.
void fp8_gather(const ExecCtx& ctx, const int32_t* perm, int64_t N, int K, const float* topk_scores, const void* q,
                const float* scale, int64_t D, int64_t nb, void* q_out, float* scale_out, int32_t* token_sorted,
                float* score_sorted, int32_t* row_of);

/// The map that moves the block-scale rows of a permute whose e4m3 rows move
/// with `row_map`: the same map. The planted fault fp8_scales_unmoved gives
/// the identity instead (the scales stay in the order they arrived in).
std::vector<int64_t> scale_row_map(const std::vector<int64_t>& row_map, const FaultSet& faults);

}  // namespace moev
