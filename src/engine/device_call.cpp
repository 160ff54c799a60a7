// The device call protocol of a fast stage on a device (runner.h:
// begin_device_call, sync_device_outputs), shared by the pipeline and bench.
#include "runner.h"

#include "../kernels/device.h"

namespace moev {

void begin_device_call(Mirror& m, const Board& in, const std::vector<std::string>& inputs) {
  for (const RankBoard& b : in.ranks)
    for (const auto& n : inputs)
      if (const Tensor& t = b.at(n); t.storage) m.hold(t.storage->data(), t.storage->size(), t.storage);
  m.begin_call();
}

void sync_device_outputs(Mirror& m, std::vector<RankBoard>& out) {
  for (RankBoard& b : out)
    for (auto& [n, t] : b)
      if (t.bytes() && !m.device_wrote(t.data(), t.bytes())) m.host_wrote(t.data(), t.bytes());
}

}  // namespace moev
