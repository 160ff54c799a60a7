// Whether this build has the CUDA executor and whether a device is usable.
#include "cuda_probe.h"

#if defined(MOEVERIFY_HAVE_CUDA)
#include "../kernels/cuda_exec.h"
#endif

namespace moev {

CudaStatus cuda_status() {
#if defined(MOEVERIFY_HAVE_CUDA)
  const cuda::DeviceStatus s = cuda::probe();
  return {true, s.count, s.message};
#else
  return {false, 0, "built without the CUDA executor (no nvcc at configure time, or MOEVERIFY_CUDA=OFF)"};
#endif
}

}  // namespace moev
