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

/// This process's GPU: under mpirun the node-local rank (OMPI_COMM_WORLD_LOCAL_RANK,
/// MPI_LOCALRANKID or SLURM_LOCALID) modulo the device count, so that ranks
/// on one node spread over its GPUs; otherwise 0.
int cuda_device_ordinal();

/// The device that runs a case's fast path on `backend` (cuda: GPU
/// cuda_device_ordinal(); emulated: host memory and the host executor with
/// `threads` threads), or null with the reason in `why`. Host: null, no reason.
std::unique_ptr<Device> make_backend_device(Backend backend, int threads, std::string& why);

}  // namespace moev
