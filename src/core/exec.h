// What every fast call runs with (the executor context): threads, the
// planted faults, and the device mirror when the fast path runs on a device.
// Used by kernels/ (host_exec.h, the entry points) and by the stage
// descriptors (core/stage.h FastCtx).
#pragma once

#include "faults.h"

namespace moev {

class Mirror;

struct ExecCtx {
  int threads = 1;
  FaultSet faults;
  /// Set: the entry points run their bodies on this mirror's device
  /// (kernels/device.h); null: on the host executor.
  Mirror* mirror = nullptr;
};

}  // namespace moev
