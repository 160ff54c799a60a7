#include "board_exchange.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace moev {
namespace {

// One rank's board, notes, skip reason and error as bytes: each tensor's name,
// dtype, shape and bytes, little-endian u64 lengths (ranks of one job share
// a byte order).
void put_u64(std::vector<uint8_t>& b, uint64_t v) { b.insert(b.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + 8); }
uint64_t get_u64(const uint8_t*& p) { uint64_t v; std::memcpy(&v, p, 8); p += 8; return v; }
void put_str(std::vector<uint8_t>& b, const std::string& s) { put_u64(b, s.size()); b.insert(b.end(), s.begin(), s.end()); }
std::string get_str(const uint8_t*& p) { const size_t n = size_t(get_u64(p)); std::string s(reinterpret_cast<const char*>(p), n); p += n; return s; }

std::vector<uint8_t> serialise(const RankBoard& out, const std::vector<std::string>& notes, const std::string& skipped,
                               const std::string& error) {
  std::vector<uint8_t> b;
  put_u64(b, out.size());
  for (const auto& [n, t] : out) {
    put_str(b, n);
    put_u64(b, uint64_t(t.type));
    put_u64(b, t.shape.size());
    for (int64_t d : t.shape) put_u64(b, uint64_t(d));
    const uint8_t* d = static_cast<const uint8_t*>(t.data());
    put_u64(b, t.bytes());
    b.insert(b.end(), d, d + t.bytes());
  }
  put_u64(b, notes.size());
  for (const auto& n : notes) put_str(b, n);
  put_str(b, skipped);
  put_str(b, error);
  return b;
}

void deserialise(const uint8_t* p, RankBoard& out, std::vector<std::string>& notes, std::string& skipped,
                 std::string& error) {
  const uint64_t n = get_u64(p);
  for (uint64_t i = 0; i < n; ++i) {
    const std::string name = get_str(p);
    const ElemType type = ElemType(get_u64(p));
    std::vector<int64_t> shape(static_cast<size_t>(get_u64(p)));
    for (auto& d : shape) d = int64_t(get_u64(p));
    Tensor t = Tensor::alloc(type, shape, 0);
    const size_t bytes = size_t(get_u64(p));
    if (bytes) std::memcpy(t.data(), p, bytes);  // an empty tensor's data() may be null
    p += bytes;
    out[name] = t;
  }
  const uint64_t nn = get_u64(p);
  for (uint64_t i = 0; i < nn; ++i) notes.push_back(get_str(p));
  skipped = get_str(p);
  error = get_str(p);
}

}  // namespace

void exchange_boards(Comm& w, Board& out, std::vector<std::vector<std::string>>& notes,
                     std::vector<std::string>& skip, std::vector<std::string>& err) {
  const int R = w.size(), me = w.rank();
  const std::vector<uint8_t> mine = serialise(out.ranks[size_t(me)], notes[size_t(me)], skip[size_t(me)], err[size_t(me)]);
  // Every rank's block padded to the largest, so that one all-gather moves them.
  std::vector<int64_t> sizes(static_cast<size_t>(R));
  const int64_t my_size = int64_t(mine.size());
  w.allgather(&my_size, 8, sizes.data(), "board sizes");
  const int64_t mx = *std::max_element(sizes.begin(), sizes.end());
  std::vector<uint8_t> padded(mine);
  padded.resize(size_t(mx));
  std::vector<uint8_t> all(size_t(mx) * size_t(R));
  w.allgather(padded.data(), size_t(mx), all.data(), "board exchange");
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    out.ranks[size_t(r)].clear();
    notes[size_t(r)].clear();
    deserialise(all.data() + size_t(r) * size_t(mx), out.ranks[size_t(r)], notes[size_t(r)], skip[size_t(r)], err[size_t(r)]);
  }
}

}  // namespace moev
