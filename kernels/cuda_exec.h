// CUDA executor (docs/architecture.md idea 2): the bodies of bodies.h launched on a grid,
// item = block, lane = thread. Entry points take host pointers and stage them
// through device memory, so the runner can compare device results with the
// host executor's bitwise. Declared always; defined only in CUDA builds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "device.h"
#include "dtype.h"
#include "moe_host.h"

namespace moev::cuda {

struct DeviceStatus {
  int count = 0;            // usable devices; 0 when none or no driver
  std::string message;      // why there is none, or the device name
};

DeviceStatus probe();

/// The CUDA device of kernels/device.h on GPU `ordinal` (bodies on a grid,
/// CUB radix sort, cuBLAS GEMM), or null with the reason in `why`. Every
/// call binds the calling thread to that GPU first.
std::unique_ptr<Device> make_device(int ordinal, std::string& why);

/// The gather body on the device (see dispatch_gather).
void dispatch_gather(DType dt, k::ScoreApply apply, const void* x, int64_t T, const int32_t* perm,
                     const float* topk_scores, int64_t N, int64_t D, int K, void* routed, int32_t* token_sorted,
                     float* score_sorted, int32_t* row_of, k::ScoreMultiply smul = k::ScoreMultiply::fp32);

/// The ordered combine body on the device (see combine).
void combine(const CombineArgs& a, int64_t N, const void* init, void* out);

}  // namespace moev::cuda
