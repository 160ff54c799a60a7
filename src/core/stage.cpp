#include "stage.h"

#include "error.h"

namespace moev {

const Tensor& Board::at(const std::string& name, int rank) const {
  const RankBoard& b = ranks.at(size_t(rank));
  auto it = b.find(name);
  if (it == b.end()) runtime_error("internal: tensor '" + name + "' missing on rank " + std::to_string(rank));
  return it->second;
}

bool Board::has(const std::string& name, int rank) const {
  return size_t(rank) < ranks.size() && ranks[size_t(rank)].count(name) > 0;
}

const Tensor& FastCtx::input(const std::string& name) const {
  auto it = in.find(name);
  if (it == in.end()) runtime_error("internal: stage input '" + name + "' missing on rank " + std::to_string(rank));
  return it->second;
}

}  // namespace moev
