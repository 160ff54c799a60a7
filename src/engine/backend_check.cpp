// Whether a case can run on its backend (runner.h: backend_unavailable,
// backend_unsupported): the CUDA executor built and a device present, and a
// device form for every primary stage variant the case needs.
#include "cuda_probe.h"
#include "registry.h"
#include "runner.h"

namespace moev {

std::string backend_unavailable(Backend b) {
  if (b != Backend::cuda) return "";
  const std::string flag = std::string("--backend ") + enum_name(backend_table(), b) + ": ";
  const CudaStatus cs = cuda_status();
  if (!cs.built) return flag + cs.message;
  if (cs.devices == 0) return flag + "no usable CUDA device (" + cs.message + ")";
  return "";
}

std::string backend_unsupported(const Case& c) {
  if (c.backend == Backend::host) return "";
  if (std::string why = backend_unavailable(c.backend); !why.empty()) return why;
  const std::string flag = std::string("--backend ") + enum_name(backend_table(), c.backend) + ": ";
  // The emulated device runs exactly what the CUDA device runs. Every
  // primary variant the case needs must run there; the others are reported
  // not taken when the case runs.
  std::string missing;
  for (const Stage& s : registry()) {
    if (!s.applies(c).applies || !s.primary(c) || has_device_form(s)) continue;
    missing += (missing.empty() ? "" : ", ") + s.slot + "/" + s.variant;
  }
  return missing.empty() ? "" : flag + "no device implementation of " + missing;
}

}  // namespace moev
