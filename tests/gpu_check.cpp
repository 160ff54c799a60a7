// [gpu] The CUDA executor runs the same kernel bodies as the host executor:
// gather and ordered combine must agree bitwise for random problems in every
// dtype, and so must the entry points on the CUDA device (routing, sort,
// gather, combine, row maps through a Mirror); the NCCL communicator runs
// with one rank; the fp32/bf16/fp16 conversions agree with the host's; the
// grouped GEMMs agree with single ones. `gpu_check --emulated` runs the
// checks that take a Device on the emulated device. Without a usable device it
// prints SKIPPED and exits 77, which ctest reports as skipped (never passed).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../kernels/backward_host.h"
#include "../kernels/cuda_exec.h"
#include "../kernels/device.h"
#include "../kernels/moe_host.h"
#include "comm.h"

using namespace moev;

namespace {

/// `gpu_check --emulated`: the checks that take a Device run on the
/// emulated device instead (their own logic checked where CI has no GPU).
bool g_emulated = false;

/// GPU 0 as a Device (the emulated device under --emulated), or null after
/// a line saying why `what` cannot run.
std::unique_ptr<Device> device_or_say(const char* what) {
  if (g_emulated) return make_emulated_device(2);
  std::string why;
  std::unique_ptr<Device> dev = cuda::make_device(0, why);
  if (!dev) std::printf("%s: no CUDA device (%s)\n", what, why.c_str());
  return dev;
}

CombineArgs combine_args(DType dt, const void* rows, const float* scores, const int32_t* row_of, int64_t N, int64_t T,
                         int64_t D, int K, k::Accumulate acc) {
  CombineArgs a;
  a.dt = dt;
  a.routed_out = rows;
  a.score_sorted = scores;
  a.row_of = row_of;
  a.rows = N;
  a.T = T;
  a.D = D;
  a.K = K;
  a.acc = acc;
  return a;
}

/// The entry points on the CUDA device (kernels/device.h: a Mirror, pointers
/// translated, write-through) against the host executor, bitwise: routing,
/// the expert sort, gather, combine, row maps, the combine's backward.
/// Returns the failures.
int device_entry_points() {
  std::unique_ptr<Device> dev = device_or_say("device entry points");
  if (!dev) return 1;
  Mirror m(*dev);
  std::mt19937 g(99);
  int failures = 0;
  for (int iter = 0; iter < 20; ++iter) {
    const int E = 8 * (1 + int(g() % 4)), K = 1 + int(g() % 4), groups = E % 4 == 0 ? 4 : 1;
    const int64_t T = int64_t(g() % 500), D = 1 + int64_t(g() % 300), N = T * K;
    RouterConfig rc;
    rc.E = E;
    rc.K = K;
    rc.groups = groups;
    rc.limited_groups = groups > 1 ? 2 : 1;
    rc.score = iter % 2 ? k::ScoreFunc::sigmoid : k::ScoreFunc::softmax;
    std::vector<float> logits(static_cast<size_t>(T * E)), bias(static_cast<size_t>(E), 0.f);
    for (auto& v : logits) v = float(int(g() % 64)) / 16.f;  // exact ties on purpose
    std::vector<float> sc_h(logits.size()), sc_d(logits.size()), ch_h(logits.size()), ch_d(logits.size());
    std::vector<int32_t> ids_h(static_cast<size_t>(N)), ids_d(static_cast<size_t>(N));
    std::vector<float> ts_h(static_cast<size_t>(N)), ts_d(static_cast<size_t>(N));
    std::vector<int64_t> cnt_h(static_cast<size_t>(E)), cnt_d(static_cast<size_t>(E));
    const ExecCtx host{2, {}}, on_dev{1, {}, &m};
    m.begin_call();
    router_route(host, rc, logits.data(), bias.data(), T, sc_h.data(), ch_h.data(), ids_h.data(), ts_h.data(), cnt_h.data());
    router_route(on_dev, rc, logits.data(), bias.data(), T, sc_d.data(), ch_d.data(), ids_d.data(), ts_d.data(), cnt_d.data());
    const bool route_ok = ids_h == ids_d && cnt_h == cnt_d &&
                          std::memcmp(sc_h.data(), sc_d.data(), sc_h.size() * 4) == 0 &&
                          std::memcmp(ts_h.data(), ts_d.data(), ts_h.size() * 4) == 0;
    std::vector<int32_t> p_h(static_cast<size_t>(N)), p_d(static_cast<size_t>(N));
    expert_sort(host, ids_h.data(), N, E, p_h.data());
    expert_sort(on_dev, ids_h.data(), N, E, p_d.data());
    const bool sort_ok = p_h == p_d;
    bool move_ok = true;
    for (DType dt : {DType::fp32, DType::bf16, DType::fp16}) {
      const size_t eb = dtype_bytes(dt);
      std::vector<uint8_t> x(static_cast<size_t>(T * D) * eb);
      for (auto& b : x) b = uint8_t(g() % 64);  // small finite values in every type
      std::vector<uint8_t> r_h(static_cast<size_t>(N * D) * eb), r_d(r_h.size());
      std::vector<int32_t> t_h(static_cast<size_t>(N)), t_d(t_h.size()), o_h(t_h.size()), o_d(t_h.size());
      std::vector<float> s_h(static_cast<size_t>(N)), s_d(s_h.size());
      dispatch_gather(host, dt, k::ScoreApply::after_experts, x.data(), p_h.data(), ts_h.data(), N, D, K, r_h.data(),
                      t_h.data(), s_h.data(), o_h.data());
      dispatch_gather(on_dev, dt, k::ScoreApply::after_experts, x.data(), p_h.data(), ts_h.data(), N, D, K, r_d.data(),
                      t_d.data(), s_d.data(), o_d.data());
      move_ok = move_ok && r_h == r_d && t_h == t_d && o_h == o_d;
      for (k::Accumulate acc : {k::Accumulate::per_add, k::Accumulate::fp32_accumulate}) {
        CombineArgs a = combine_args(dt, r_h.data(), s_h.data(), o_h.data(), N, T, D, K, acc);
        std::vector<uint8_t> c_h(x.size()), c_d(x.size());
        combine_from_zeros(host, a, c_h.data());
        combine_from_zeros(on_dev, a, c_d.data());
        move_ok = move_ok && c_h == c_d;
      }
      std::vector<int64_t> map(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) map[size_t(i)] = (i * 7919) % (N + 1) - 1;  // some zero rows
      std::vector<uint8_t> m_h(r_h.size()), m_d(r_h.size());
      apply_row_map(host, dt, r_h.data(), map.data(), N, D, m_h.data());
      apply_row_map(on_dev, dt, r_h.data(), map.data(), N, D, m_d.data());
      move_ok = move_ok && m_h == m_d;
      // The backward (docs/contract.md §13): gradient rows in dispatch order and the
      // score gradient (a per-assignment fp32 dot product in column order).
      std::vector<uint8_t> g_h(r_h.size()), g_d(r_h.size());
      std::vector<float> gs_h(static_cast<size_t>(N)), gs_d(gs_h.size());
      combine_backward(host, dt, k::ScoreApply::after_experts, k::ScoreMultiply::fp32, x.data(), r_h.data(), s_h.data(),
                       t_h.data(), o_h.data(), T, N, D, K, g_h.data(), gs_h.data());
      combine_backward(on_dev, dt, k::ScoreApply::after_experts, k::ScoreMultiply::fp32, x.data(), r_h.data(),
                       s_h.data(), t_h.data(), o_h.data(), T, N, D, K, g_d.data(), gs_d.data());
      move_ok = move_ok && g_h == g_d && std::memcmp(gs_h.data(), gs_d.data(), gs_h.size() * 4) == 0;
    }
    m.end_call();
    if (!(route_ok && sort_ok && move_ok)) {
      ++failures;
      std::printf("device entry points differ: T=%lld D=%lld E=%d K=%d route %d sort %d movement %d\n", (long long)T,
                  (long long)D, E, K, route_ok, sort_ok, move_ok);
    }
  }
  std::printf("device entry points (%s): %d failure(s) in 20 random problems\n", dev->name().c_str(), failures);
  // Device::timed_copy, bench's roof: the bytes arrive, the time is finite
  // and positive, and the busy clock does not count it.
  const size_t n = size_t(1) << 24;
  std::vector<uint8_t> h(n), back(n);
  for (size_t i = 0; i < n; ++i) h[i] = uint8_t(i * 131 + 7);
  void* a = dev->alloc(n);
  void* b = dev->alloc(n);
  dev->upload(a, h.data(), n);
  dev->fill(b, 0, n);
  const double busy0 = dev->busy_seconds();
  const double t = dev->timed_copy(b, a, n);
  dev->download(back.data(), b, n);
  const bool copy_ok = back == h && std::isfinite(t) && t > 0 && dev->busy_seconds() == busy0;
  std::printf("timed_copy: 16 MiB in %.4f ms (%.1f GB/s read + write): %s\n", t * 1e3, 2.0 * double(n) / t / 1e9,
              copy_ok ? "ok" : "WRONG");
  failures += !copy_ok;
  dev->release(a);
  dev->release(b);
  return failures;
}

/// The conversions between fp32 and bf16 / fp16 on the GPU (src/core/dtype.h:
/// the hardware instruction, a NaN's result selected) against the host's
/// integer path, bitwise, through bodies that use
/// them: RoundBody<bf16> (round_to<bf16>), ConvertBody<float, bf16>
/// (from_float<bf16>), RoundBody<fp16> (from_float<fp16>, then to_float) on
/// every high half of an fp32 bit pattern with low halves at and around
/// every rounding boundary (ties, just below, just above; each bf16 and
/// fp16 rounding position, subnormal ones included); every NaN class and
/// infinity are among them. The same inputs eight at a time through
/// round_pairs (the combine's packed conversion).
/// ConvertBody<fp16, bf16> covers to_float(fp16)
/// on all 65,536 patterns. Returns the failures.
int conversions() {
  std::unique_ptr<Device> dev = device_or_say("conversions");
  if (!dev) return 1;
  std::vector<uint32_t> low = {0u, 0xffffu, 0x7fffu, 0x8000u, 0x8001u, 0x3000u, 0x2fffu, 0x3001u, 0xb000u, 0xd000u};
  for (int b = 0; b < 16; ++b) low.insert(low.end(), {1u << b, (1u << b) - 1u, (1u << b) + 1u, 0xffffu ^ (1u << b)});
  std::vector<float> in;
  in.reserve(low.size() << 16);
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : low) in.push_back(f32_from_bits((hi << 16) | (lo & 0xffffu)));
  // Eight values without a NaN around the infinities: the packed path's
  // infinities (in the patterns above an infinity shares its eight with NaNs).
  for (uint32_t u : {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu, 0u, 0x80000000u, 0x477ff000u, 0xc77fefffu})
    in.push_back(f32_from_bits(u));
  const int64_t n = int64_t(in.size());
  const size_t fb = size_t(n) * 4;
  float* d = static_cast<float*>(dev->alloc(fb));
  bf16* db = static_cast<bf16*>(dev->alloc(size_t(n) * 2));
  int failures = 0;
  auto report = [&](const char* what, bool ok) {
    std::printf("conversion %s on %lld inputs: %s\n", what, (long long)n, ok ? "bitwise equal" : "DIFFERS");
    failures += !ok;
  };
  // Scalar, then eight values at a time (round_pairs: the packed conversion
  // where none of the eight is a NaN, else the scalar one for all eight).
  const char* names[2][2] = {{"round_to<bf16>", "from_float<fp16> and back"},
                             {"round_pairs<bf16>", "round_pairs<fp16>"}};
  for (int mode = 0; mode < 2; ++mode)
    for (int which = 0; which < 2; ++which) {
      std::vector<float> want(in), got(in.size());
      for (float& v : want) v = which == 0 ? round_to<bf16>(v) : round_to<fp16>(v);
      dev->upload(d, in.data(), fb);
      if (which == 0) dev->run(RoundBody<bf16>{d, n, mode > 0}, chunks(n));
      else dev->run(RoundBody<fp16>{d, n, mode > 0}, chunks(n));
      dev->download(got.data(), d, fb);
      report(names[mode][which], std::memcmp(want.data(), got.data(), fb) == 0);
    }
  {
    std::vector<bf16> want(in.size()), got(in.size());
    for (size_t i = 0; i < in.size(); ++i) want[i] = from_float<bf16>(in[i]);
    dev->upload(d, in.data(), fb);
    dev->run(ConvertBody<float, bf16>{d, db, n}, chunks(n));
    dev->download(got.data(), db, size_t(n) * 2);
    report("from_float<bf16>", std::memcmp(want.data(), got.data(), size_t(n) * 2) == 0);
  }
  {
    std::vector<fp16> h(65536);
    std::vector<bf16> want(65536), got(65536);
    for (uint32_t i = 0; i < 65536; ++i) h[i] = fp16{uint16_t(i)}, want[i] = from_float<bf16>(to_float(h[i]));
    fp16* dh = static_cast<fp16*>(dev->alloc(65536 * 2));
    dev->upload(dh, h.data(), 65536 * 2);
    dev->run(ConvertBody<fp16, bf16>{dh, db, 65536}, chunks(65536));
    dev->download(got.data(), db, 65536 * 2);
    dev->release(dh);
    std::printf("conversion to_float(fp16) on all 65536 patterns: %s\n",
                std::memcmp(want.data(), got.data(), 65536 * 2) == 0 ? "bitwise equal" : "DIFFERS");
    failures += std::memcmp(want.data(), got.data(), 65536 * 2) != 0;
  }
  dev->release(d);
  dev->release(db);
  return failures;
}

/// Device::gemm_group against the same jobs one GEMM at a time on the same
/// device (batched or grouped cuBLAS, or the single GEMMs): nt, nn and tn_f32
/// jobs of random expert row counts, empty experts included, and of equal
/// ones, in
/// every dtype, bitwise (the sums are exact, see below); nn_f32 jobs, which
/// have no single entry point, against the exact sums computed here. A
/// wrong pointer, size or leading dimension gives other values or leaves the
/// poison (NaN bytes; the gradients of an expert without rows stay poison in
/// both). Returns the failures.
int grouped_gemms() {
  std::unique_ptr<Device> dev = device_or_say("grouped GEMMs");
  if (!dev) return 1;
  std::mt19937 g(7);
  int failures = 0;
  // D = 96, F = 40: every operand 16-byte aligned (the grouped call); D = 1
  // and D = 7, F = 3: rows of 2 and 14 bytes, which cuBLAS's grouped call
  // got wrong on an H200 (gemm_group sends them alone)
  // Random counts give GEMMs of distinct shapes (single calls side by side);
  // equal counts give every kind of job one shape, which gemm_group's
  // default batches into one call (kernels/gemm_plan.h).
  for (const bool equal : {false, true}) {
    for (DType dt : {DType::bf16, DType::fp16, DType::fp32})
      for (const auto& [D, F] : std::vector<std::pair<int64_t, int64_t>>{{96, 40}, {1, 8}, {7, 3}}) {
        const int E = 6;
        std::vector<int64_t> counts(E);
        int64_t rows = 0;
        for (auto& c : counts) rows += c = equal ? 33 : (g() % 3 == 0) ? 0 : int64_t(g() % 70);
        const size_t eb = dtype_bytes(dt);
        auto fill = [&](size_t elems) {
          std::vector<uint8_t> b(elems * eb);
          for (size_t i = 0; i < elems; ++i) {
            const float v = float(int(g() % 257) - 128) / 64.f;
            if (dt == DType::fp32) std::memcpy(&b[i * 4], &v, 4);
            else {
              const uint16_t u = dt == DType::bf16 ? from_float<bf16>(v).bits : from_float<fp16>(v).bits;
              std::memcpy(&b[i * 2], &u, 2);
            }
          }
          void* p = dev->alloc(std::max<size_t>(b.size(), 1));
          dev->upload(p, b.data(), b.size());
          return static_cast<uint8_t*>(p);
        };
        uint8_t* x = fill(size_t(rows * D));
        uint8_t* w = fill(size_t(E * F * D));
        const size_t yb = size_t(rows * 2 * F) * eb, gb = size_t(E) * size_t(F * D) * 4;
        uint8_t* y1 = static_cast<uint8_t*>(dev->alloc(std::max<size_t>(yb, 1)));
        uint8_t* y2 = static_cast<uint8_t*>(dev->alloc(std::max<size_t>(yb, 1)));
        uint8_t* w1 = static_cast<uint8_t*>(dev->alloc(gb));
        uint8_t* w2 = static_cast<uint8_t*>(dev->alloc(gb));
        const size_t fb = size_t(rows * F) * 4;  // the nn_f32 jobs' outputs (rows, F)
        uint8_t* yf = static_cast<uint8_t*>(dev->alloc(std::max<size_t>(fb, 1)));
        for (uint8_t* p : {y1, y2}) dev->fill(p, 0xff, yb);
        for (uint8_t* p : {w1, w2}) dev->fill(p, 0xff, gb);
        dev->fill(yf, 0xff, fb);
        std::vector<GemmJob> jobs;
        int64_t r0 = 0;
        for (int j = 0; j < E; r0 += counts[size_t(j)], ++j) {
          const int64_t n = counts[size_t(j)];
          const uint8_t* wj = w + size_t(j) * size_t(F * D) * eb;
          if (n > 0) {
            jobs.push_back({GemmOp::nt, x + size_t(r0 * D) * eb, wj, nullptr, n, D, F, D, 0, 2 * F});  // (n, F) into cols [0, F)
            jobs.push_back({GemmOp::nn, x + size_t(r0 * D) * eb, wj, nullptr, n, D, F, D, 0, 2 * F});  // W as (D, F): cols [F, 2F)
            jobs.push_back({GemmOp::tn_f32, x + size_t(r0 * D) * eb, x + size_t(r0 * D) * eb, nullptr, n, std::min<int64_t>(D, F), D, D, D, 0});
            jobs.push_back({GemmOp::nn_f32, x + size_t(r0 * D) * eb, wj, yf + size_t(r0 * F) * 4, n, D, F, D, 0, F});
          }
        }
        auto place = [&](uint8_t* y, uint8_t* wg) {
          std::vector<GemmJob> out = jobs;
          int64_t r = 0, t = 0;
          for (size_t i = 0; i < out.size(); i += 4) {
            while (counts[size_t(t)] == 0) ++t;
            out[i].c = y + size_t(r * 2 * F) * eb;
            out[i + 1].c = y + size_t(r * 2 * F + F) * eb;
            out[i + 2].c = wg + size_t(t) * size_t(F * D) * 4;
            r += counts[size_t(t)], ++t;
          }
          return out;
        };
        dev->gemm_group(dt, place(y1, w1));
        for (const GemmJob& j : place(y2, w2)) {
          if (j.op == GemmOp::nt) dev->gemm_nt(dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.c, j.ldc);
          else if (j.op == GemmOp::nn) dev->gemm_nn(dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.c, j.ldc);
          else if (j.op == GemmOp::tn_f32) dev->gemm_tn_f32(dt, j.a, j.rows, j.k, j.lda, j.b, j.n, j.ldb, static_cast<float*>(j.c));
        }
        // every operand is a multiple of 1/64 of magnitude at most 2, so every
        // product and sum is exact in fp32 and the results agree bit for bit
        // whatever order a kernel sums in
        auto bytes_of = [&](const uint8_t* p, size_t n) {
          std::vector<uint8_t> h(n);
          dev->download(h.data(), p, n);
          return h;
        };
        const bool y_ok = bytes_of(y1, yb) == bytes_of(y2, yb), w_ok = bytes_of(w1, gb) == bytes_of(w2, gb);
        // nn_f32: yf (r, f) = sum_d x (r, d) w_j (d, f), exact, for expert j's rows r
        auto values = [&](const uint8_t* p, size_t n) {
          const std::vector<uint8_t> b = bytes_of(p, n * eb);
          std::vector<float> v(n);
          for (size_t i = 0; i < n; ++i) {
            uint16_t u = 0;
            if (dt == DType::fp32) std::memcpy(&v[i], &b[i * 4], 4);
            else std::memcpy(&u, &b[i * 2], 2), v[i] = dt == DType::bf16 ? to_float(bf16{u}) : to_float(fp16{u});
          }
          return v;
        };
        const std::vector<float> xv = values(x, size_t(rows * D)), wv = values(w, size_t(E * F * D));
        std::vector<float> want(size_t(rows * F)), got(want.size());
        for (int64_t j = 0, r0 = 0; j < E; r0 += counts[size_t(j)], ++j)
          for (int64_t r = r0; r < r0 + counts[size_t(j)]; ++r)
            for (int64_t f = 0; f < F; ++f) {
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += xv[size_t(r * D + d)] * wv[size_t(j * F * D + d * F + f)];
              want[size_t(r * F + f)] = s;
            }
        dev->download(got.data(), yf, fb);
        const bool f_ok = std::memcmp(want.data(), got.data(), fb) == 0;
        // nt: y1 (r, f) = x (r, :) . w_j (f, :), the exact sum rounded once to dt
        // (both sides, so a wrong grouped call cannot pass by matching the single)
        const std::vector<float> yv = values(y1, size_t(rows * 2 * F));
        bool nt_ok = true;
        for (int64_t j = 0, r0 = 0; j < E; r0 += counts[size_t(j)], ++j)
          for (int64_t r = r0; r < r0 + counts[size_t(j)]; ++r)
            for (int64_t f = 0; f < F; ++f) {
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += xv[size_t(r * D + d)] * wv[size_t(j * F * D + f * D + d)];
              const float want_nt = dt == DType::bf16 ? to_float(from_float<bf16>(s))
                                    : dt == DType::fp16 ? to_float(from_float<fp16>(s)) : s;
              nt_ok = nt_ok && std::memcmp(&want_nt, &yv[size_t(r * 2 * F + f)], 4) == 0;
            }
        std::printf("grouped GEMMs %s D=%lld F=%lld (%s): %zu jobs, %lld rows: outputs %s (nt %s), weight gradients %s, "
                    "fp32 outputs %s\n",
                    dtype_name(dt), (long long)D, (long long)F, dev->gemm_group_calls().path.c_str(), jobs.size(),
                    (long long)rows, y_ok ? "equal" : "DIFFER", nt_ok ? "exact" : "WRONG", w_ok ? "equal" : "DIFFER",
                    f_ok ? "exact" : "DIFFER");
        failures += !y_ok || !nt_ok || !w_ok || !f_ok;
        for (uint8_t* p : {x, w, y1, y2, w1, w2, yf}) dev->release(p);
      }
  }
  return failures;
}

/// The NCCL communicator with one rank on GPU 0 (NCCL allows no second rank
/// of a communicator on the same GPU): rows sent to itself with a zero-row
/// split in between, all-reduce and all-gather staged through the device,
/// and a split mismatch refused before any row moves. Returns the failures.
int nccl_one_rank() {
  std::unique_ptr<Device> dev = device_or_say("nccl");
  if (!dev) return 1;
  int failures = 0;
  try {
    auto host = make_local_comms(1, std::chrono::milliseconds(30000));
    std::unique_ptr<Comm> nccl = make_nccl_comm(*host[0], 0, std::chrono::milliseconds(30000));
    const size_t rb = 12;  // bytes per row
    std::vector<uint8_t> send(5 * rb), recv(5 * rb, 0xEE);
    for (size_t i = 0; i < send.size(); ++i) send[i] = uint8_t(i * 7 + 1);
    void* ds = dev->alloc(send.size());
    void* dr = dev->alloc(recv.size());
    dev->upload(ds, send.data(), send.size());
    dev->fill(dr, 0xEE, recv.size());
    nccl->alltoallv_device(ds, 5, {5}, dr, 5, {5}, rb, "nccl self all-to-all");
    dev->download(recv.data(), dr, recv.size());
    failures += recv != send;
    nccl->alltoallv_device(ds, 5, {0}, dr, 5, {0}, rb, "nccl zero-row all-to-all");  // must not hang or write
    dev->download(recv.data(), dr, recv.size());
    failures += recv != send;
    bool refused = false;
    try {
      nccl->alltoallv_device(ds, 5, {3}, dr, 5, {2}, rb, "nccl mismatched all-to-all");
    } catch (const std::exception& e) {
      refused = std::string(e.what()).find("split mismatch") != std::string::npos;
    }
    failures += !refused;
    int64_t v[2] = {5, -3};
    nccl->allreduce_max(v, 2, "nccl max");
    nccl->allreduce_sum(v, 2, "nccl sum");
    failures += v[0] != 5 || v[1] != -3;
    const uint64_t word = 0x0123456789abcdefull;
    uint64_t got = 0;
    nccl->allgather(&word, 8, &got, "nccl all-gather");
    failures += got != word;
    nccl->barrier("nccl barrier");
    dev->release(ds);
    dev->release(dr);
  } catch (const std::exception& e) {
    std::printf("nccl: %s\n", e.what());
    ++failures;
  }
  std::printf("nccl one-rank communicator: %d failure(s)\n", failures);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--emulated") {
    g_emulated = true;
    const int failures = device_entry_points() + conversions() + grouped_gemms();
    std::printf("%d failure(s) on the emulated device\n", failures);
    return failures ? 1 : 0;
  }
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
      // score_multiply act (docs/contract.md §14) before the experts; the fp32 multiply
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
        CombineArgs a = combine_args(dt, rh.data(), sh.data(), oh.data(), N, T, D, K, acc);
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
  failures += device_entry_points();
  failures += conversions();
  failures += grouped_gemms();
  failures += nccl_one_rank();
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
