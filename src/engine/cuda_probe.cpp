// Whether this build has the CUDA executor and whether a device is usable.
#include "cuda_probe.h"

#include <algorithm>
#include <cstdlib>

#include "comm.h"

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

int cuda_device_ordinal() {
  // A property of the process: probed once, not at every stage that asks.
  static const int ordinal = [] {
    const int n = cuda_status().devices;
    if (n <= 0 || !launched_under_mpi()) return 0;
    for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
      if (const char* s = std::getenv(v)) return std::max(0, std::atoi(s)) % n;
    return 0;
  }();
  return ordinal;
}

std::unique_ptr<Device> make_backend_device(Backend backend, int threads, std::string& why) {
  switch (backend) {
    case Backend::host: return nullptr;
    case Backend::emulated: return make_emulated_device(threads);
    case Backend::cuda:
#if defined(MOEVERIFY_HAVE_CUDA)
      return cuda::make_device(cuda_device_ordinal(), why);
#else
      why = cuda_status().message;
      return nullptr;
#endif
  }
  return nullptr;
}

}  // namespace moev
