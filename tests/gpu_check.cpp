// [gpu] The CUDA executor runs the same kernel bodies as the host executor:
// gather and ordered combine must agree bitwise for random problems in every
// dtype. Without a usable device it prints SKIPPED and exits 77, which ctest
// reports as skipped (never as passed).
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../kernels/cuda_exec.h"
#include "../kernels/moe_host.h"

using namespace moev;

int main() {
  const cuda::DeviceStatus st = cuda::probe();
  if (st.count == 0) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n", st.message.c_str());
    return 77;
  }
  std::printf("device: %s\n", st.message.c_str());
  std::mt19937 g(1234);
  int failures = 0;
  for (int iter = 0; iter < 20; ++iter) {
    const int E = 1 + int(g() % 16), K = 1 + int(g() % std::min(E, 4));
    const int64_t T = int64_t(g() % 300), D = 1 + int64_t(g() % 200), N = T * K;
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) ids[size_t(t * K + k)] = int32_t((t + k * 7 + int64_t(g() % 3)) % E);
    for (int64_t t = 0; t < T; ++t)  // make ids distinct per token
      for (int k = 0; k < K; ++k) ids[size_t(t * K + k)] = int32_t((ids[size_t(t * K)] + k) % E);
    std::vector<int32_t> perm(static_cast<size_t>(N));
    expert_sort(ExecCtx{2, {}}, ids.data(), N, E, perm.data());
    std::vector<float> scores(static_cast<size_t>(N));
    for (auto& s : scores) s = float(g() % 1000) / 999.f;
    for (DType dt : {DType::fp32, DType::bf16, DType::fp16}) {
      const size_t eb = dtype_bytes(dt);
      std::vector<uint8_t> x(static_cast<size_t>(T * D) * eb);
      for (size_t i = 0; i < x.size() / eb; ++i) {
        const float v = float(int(g() % 2001) - 1000) / 250.f;
        if (dt == DType::fp32) std::memcpy(&x[i * 4], &v, 4);
        else {
          const uint16_t b = dt == DType::bf16 ? from_float<bf16>(v).bits : from_float<fp16>(v).bits;
          std::memcpy(&x[i * 2], &b, 2);
        }
      }
      std::vector<uint8_t> rh(static_cast<size_t>(N * D) * eb), rd(rh.size());
      std::vector<int32_t> th(static_cast<size_t>(N)), td(static_cast<size_t>(N)), oh(static_cast<size_t>(N)), od(static_cast<size_t>(N));
      std::vector<float> sh(static_cast<size_t>(N)), sd(static_cast<size_t>(N));
      // score_multiply act (CONTRACT §14) before the experts; the fp32 multiply
      // runs last so that rh holds plain rows for the combine below.
      for (k::ScoreMultiply smul : {k::ScoreMultiply::act, k::ScoreMultiply::fp32})
        for (k::ScoreApply apply : {k::ScoreApply::before_experts, k::ScoreApply::after_experts}) {
          dispatch_gather(ExecCtx{2, {}}, dt, apply, x.data(), perm.data(), scores.data(), N, D, K, rh.data(),
                          th.data(), sh.data(), oh.data(), smul);
          cuda::dispatch_gather(dt, apply, x.data(), T, perm.data(), scores.data(), N, D, K, rd.data(), td.data(),
                                sd.data(), od.data(), smul);
          failures += rh != rd || th != td || oh != od || std::memcmp(sh.data(), sd.data(), sh.size() * 4) != 0;
        }
      for (k::ScoreMultiply smul : {k::ScoreMultiply::fp32, k::ScoreMultiply::act})
      for (k::Accumulate acc : {k::Accumulate::per_add, k::Accumulate::fp32_accumulate}) {
        CombineArgs a;
        a.dt = dt;
        a.routed_out = rh.data();
        a.score_sorted = sh.data();
        a.row_of = oh.data();
        a.T = T;
        a.D = D;
        a.K = K;
        a.acc = acc;
        a.smul = smul;
        std::vector<uint8_t> init(static_cast<size_t>(T * D) * eb, 0), ch(init.size()), cd(init.size());
        combine(ExecCtx{2, {}}, a, init.data(), ch.data());
        cuda::combine(a, N, init.data(), cd.data());
        if (ch != cd) {
          ++failures;
          std::printf("combine mismatch: T=%lld D=%lld E=%d K=%d dtype=%s\n", (long long)T, (long long)D, E, K,
                      dtype_name(dt));
        }
      }
    }
  }
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
