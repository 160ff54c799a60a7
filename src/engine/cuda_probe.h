#pragma once

#include <memory>
#include <string>

#include "../kernels/device.h"
#include "case.h"

namespace moev {

struct CudaStatus {
  bool built = false;  // the CUDA executor is compiled in
  int devices = 0;     // usable devices now
  std::string message;
};

CudaStatus cuda_status();

/// The device that runs a case's fast path on `backend` (cuda: GPU 0;
/// emulated: host memory and the host executor with `threads` threads), or
/// null with the reason in `why`. Host: null, no reason.
std::unique_ptr<Device> make_backend_device(Backend backend, int threads, std::string& why);

}  // namespace moev
