#pragma once

#include <string>

namespace moev {

struct CudaStatus {
  bool built = false;  // the CUDA executor is compiled in
  int devices = 0;     // usable devices now
  std::string message;
};

CudaStatus cuda_status();

}  // namespace moev
