// Where the fast path runs; a stage variant lists the backends whose
// executor implements it (core/stage.h), a case names one (config/case.h).
#pragma once

namespace moev {

/// Where the fast path runs (docs/architecture.md "Scale and backends"): the host
/// executor, or a device (kernels/device.h): `cuda`, a GPU; `emulated`, the
/// device plumbing on host memory with the host executor's kernels (no GPU:
/// it tests the tool, not a GPU). A case on a backend that cannot run it is
/// NOT_SUPPORTED, never run on another backend in disguise.
enum class Backend { host, cuda, emulated };

}  // namespace moev
