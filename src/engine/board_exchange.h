// The MPI board exchange of a stage variant (docs/architecture.md idea 3):
// every process runs its own rank's fast function, then all ranks' outputs,
// notes, skip reasons and errors are all-gathered, so that each process can
// run the reference, which sees every rank.
#pragma once

#include <string>
#include <vector>

#include "comm.h"
#include "stage.h"

namespace moev {

/// Sends this process's rank (w.rank()) of `out`, `notes`, `skip` and `err`
/// to every peer and fills the other ranks' entries from theirs (their
/// previous contents replaced). Every process must call it, in the same order.
void exchange_boards(Comm& w, Board& out, std::vector<std::vector<std::string>>& notes,
                     std::vector<std::string>& skip, std::vector<std::string>& err);

}  // namespace moev
