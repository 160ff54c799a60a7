// Benchmark of diff_tensors at a real shape (issue 7 item 2): prints the
// seconds of one diff of two N-element tensors and the ratio to a memcpy of
// the same bytes (both tensors' bytes: a diff reads two tensors, a memcpy
// reads one and writes one), measured in the same run. Built, never timed by
// ctest (no timed unit tests).
//
// Rows marked ~ differ in every element (1 ULP, within tolerance), so the
// typed walk runs instead of the byte compare.
//
//   bench_diff [N_ELEMENTS] [REPEATS]     default 134217728 (T 4096 x K 8 x D 4096) and 3
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "diff.h"

using namespace moev;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Minimum wall seconds of `repeats` calls of f.
template <class F> double best_of(int repeats, F&& f) {
  double best = 1e300;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

Tensor filled(ElemType t, int64_t n) {
  Tensor x = Tensor::alloc(t, {n}, 0);
  // A cheap pattern of ordinary finite values: low 12 bits of a counter in
  // the mantissa, exponent near 1.
  uint8_t* p = static_cast<uint8_t*>(x.data());
  const size_t eb = elem_bytes(t);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = eb == 2 ? 0x3f80u | (uint32_t(i) & 0x7fu) : 0x3f800000u | (uint32_t(i) & 0xfffu) << 8;
    std::memcpy(p + size_t(i) * eb, &v, eb);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : int64_t(4096) * 8 * 4096;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  const CoordFn coords = [](int64_t i) { return "[" + std::to_string(i) + "]"; };
  std::printf("bench_diff: %lld elements, best of %d\n", static_cast<long long>(n), repeats);
  struct Row {
    const char* name;
    ElemType type;
    CompareClass cls;
    bool all_differ;  // the lowest bit of every reference element flipped: no byte run is equal
  };
  for (const Row& row : {Row{"bf16 exact", ElemType::bf16, CompareClass::exact, false},
                         Row{"bf16 gemm", ElemType::bf16, CompareClass::gemm, false},
                         Row{"bf16 gemm ~", ElemType::bf16, CompareClass::gemm, true},
                         Row{"fp32 scores", ElemType::f32, CompareClass::scores, false},
                         Row{"fp32 scores ~", ElemType::f32, CompareClass::scores, true}}) {
    const Tensor a = filled(row.type, n);
    Tensor b = a.clone();
    if (row.all_differ)
      for (size_t i = 0; i < b.bytes(); i += elem_bytes(row.type)) static_cast<uint8_t*>(b.data())[i] ^= 1u;
    std::vector<uint8_t> dst(a.bytes());
    const double copy = best_of(repeats, [&] { std::memcpy(dst.data(), a.data(), a.bytes()); });
    DiffResult r;
    const double diff = best_of(repeats, [&] { r = diff_tensors(a, b, row.cls, Tolerance{1.6e-2, 1e-5}, coords); });
    std::printf("  %-14s %7.1f MB each: diff %8.4f s  memcpy %8.4f s  diff/memcpy %6.2f  (mismatches %lld)\n",
                row.name, double(a.bytes()) / 1e6, diff, copy, diff / copy, static_cast<long long>(r.mismatches));
  }
  return 0;
}
