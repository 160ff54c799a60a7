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

std::unique_ptr<Device> make_backend_device(Backend backend, int threads, std::string& why) {
  switch (backend) {
    case Backend::host: return nullptr;
    case Backend::emulated: return make_emulated_device(threads);
    case Backend::cuda:
#if defined(MOEVERIFY_HAVE_CUDA)
      return cuda::make_device(why);
#else
      why = cuda_status().message;
      return nullptr;
#endif
  }
  return nullptr;
}

}  // namespace moev
