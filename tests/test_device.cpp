// The device plumbing (kernels/device.h, issue 12) on the emulated device,
// which CI can run: the Mirror uploads a board tensor once, re-uploads what
// the host may have changed, poisons outputs on the device, writes back what
// kernels write, drops what died, and its device hash sees a device write
// into an input. The entry points then give the host executor's bytes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "../kernels/backward_host.h"
#include "../kernels/device.h"
#include "../kernels/moe_host.h"

using namespace moev;

namespace {
std::shared_ptr<std::vector<uint8_t>> buffer(size_t n, uint8_t v) { return std::make_shared<std::vector<uint8_t>>(n, v); }
}  // namespace

TEST_CASE("mirror uploads a held buffer once and translates views inside it", "[cpu][device]") {
  auto dev = make_emulated_device(1);
  Mirror m(*dev);
  auto a = buffer(64, 7);
  m.hold(a->data(), a->size(), a);
  m.hold(a->data(), a->size(), a);
  CHECK(m.uploads() == 1);
  const auto* d0 = static_cast<const uint8_t*>(m.in(a->data(), 64));
  const auto* d1 = static_cast<const uint8_t*>(m.in(a->data() + 16, 8));
  CHECK(d1 == d0 + 16);  // a view keeps its offset in the device copy
  CHECK(d0 != a->data());
  CHECK(m.uploads() == 1);
  CHECK(d0[5] == 7);
}

TEST_CASE("timed_copy copies on the device and times it outside the busy clock", "[cpu][device]") {
  auto dev = make_emulated_device(1);
  std::vector<uint8_t> h(1 << 16);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint8_t(i * 131 + 7);
  void* a = dev->alloc(h.size());
  void* b = dev->alloc(h.size());
  dev->upload(a, h.data(), h.size());
  dev->fill(b, 0, h.size());
  const double busy0 = dev->busy_seconds();
  const double t = dev->timed_copy(b, a, h.size());
  std::vector<uint8_t> back(h.size());
  dev->download(back.data(), b, back.size());
  CHECK(back == h);
  CHECK(t >= 0);
  CHECK(dev->busy_seconds() == busy0);
  dev->release(a);
  dev->release(b);
}

TEST_CASE("mirror poisons outputs on the device and writes kernels' results back", "[cpu][device]") {
  auto dev = make_emulated_device(1);
  Mirror m(*dev);
  auto o = buffer(32, 0xFF);
  m.begin_call();
  m.hold_output(o->data(), o->size(), o, 0xFF);
  auto* d = static_cast<uint8_t*>(m.out(o->data(), 32));
  CHECK(d[0] == 0xFF);
  CHECK_FALSE(m.device_wrote(o->data(), 32));
  std::memset(d, 3, 32);  // what a kernel writes
  CHECK((*o)[0] == 0xFF);
  m.wrote(o->data(), 32);
  CHECK((*o)[31] == 3);  // write-through
  CHECK(m.device_wrote(o->data(), 32));
  m.end_call();
}

TEST_CASE("mirror re-uploads temporaries and host-written outputs, drops the dead", "[cpu][device]") {
  auto dev = make_emulated_device(1);
  Mirror m(*dev);
  std::vector<uint8_t> tmp(16, 1);
  m.begin_call();
  CHECK(static_cast<const uint8_t*>(m.in(tmp.data(), 16))[0] == 1);
  tmp[0] = 9;  // the host changes a temporary (or a new one takes its address)
  CHECK(static_cast<const uint8_t*>(m.in(tmp.data(), 16))[0] == 9);
  auto o = buffer(8, 0xFF);
  m.hold_output(o->data(), o->size(), o, 0xFF);
  (*o)[2] = 5;  // host code writes an output (the host-staged exchange)
  CHECK(static_cast<const uint8_t*>(m.in(o->data(), 8))[2] == 5);
  {
    // An entry point's temporaries end with it (Mirror::Scope): freed host
    // memory may come back at once with other boundaries, in any thread.
    std::vector<uint8_t> t2(32, 2);
    const size_t before = m.device_bytes();
    {
      Mirror::Scope scope{m};
      m.in(t2.data(), 32);
      CHECK(m.device_bytes() == before + 32);
    }
    CHECK(m.device_bytes() == before - 16);  // this thread's temporaries, tmp's too, are gone; the output stays
  }
  m.end_call();
  const size_t held = m.device_bytes();
  CHECK(held == 8);  // the temporary is gone, the output stays
  o.reset();
  m.end_call();
  CHECK(m.device_bytes() == 0);  // its owner died
}

TEST_CASE("mirror device hash sees a device write into an input", "[cpu][device]") {
  auto dev = make_emulated_device(1);
  Mirror m(*dev);
  auto a = buffer(100, 4);
  m.hold(a->data(), a->size(), a);
  const uint64_t h = m.device_hash(a->data(), 100);
  CHECK(h == m.device_hash(a->data(), 100));
  auto* d = const_cast<uint8_t*>(static_cast<const uint8_t*>(m.in(a->data(), 100)));
  d[99] ^= 1;  // a kernel writing past its output into this buffer
  CHECK(h != m.device_hash(a->data(), 100));
  CHECK((*a)[99] == 4);  // the host copy cannot tell
}

TEST_CASE("entry points on the emulated device give the host executor's bytes", "[cpu][device]") {
  auto dev = make_emulated_device(2);
  Mirror m(*dev);
  const int64_t T = 37, D = 19, K = 3, E = 7, N = T * K;
  std::vector<int32_t> ids(static_cast<size_t>(N));
  for (int64_t a = 0; a < N; ++a) ids[size_t(a)] = int32_t((a * 5 + a / K) % E);
  std::vector<float> x(static_cast<size_t>(T * D)), scores(static_cast<size_t>(N));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 23) - 11) / 8.f;
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = float(i % 5 + 1) / 8.f;
  for (bool unstable : {false, true}) {
    ExecCtx host{2, {}}, device{2, {}, &m};
    if (unstable) host.faults.bits = device.faults.bits = uint32_t(Fault::unstable_sort);
    std::vector<int32_t> ph(static_cast<size_t>(N)), pd(size_t(N), -1);
    expert_sort(host, ids.data(), N, int(E), ph.data());
    m.begin_call();
    expert_sort(device, ids.data(), N, int(E), pd.data());
    CHECK(ph == pd);
    std::vector<float> rh(static_cast<size_t>(N * D)), rd(size_t(N * D), -1.f), sh(static_cast<size_t>(N)), sd(static_cast<size_t>(N));
    std::vector<int32_t> th(static_cast<size_t>(N)), td(static_cast<size_t>(N)), oh(static_cast<size_t>(N)), od(static_cast<size_t>(N));
    dispatch_gather(host, DType::fp32, k::ScoreApply::before_experts, x.data(), ph.data(), scores.data(), N, D, int(K),
                    rh.data(), th.data(), sh.data(), oh.data());
    dispatch_gather(device, DType::fp32, k::ScoreApply::before_experts, x.data(), pd.data(), scores.data(), N, D,
                    int(K), rd.data(), td.data(), sd.data(), od.data());
    CHECK(std::memcmp(rh.data(), rd.data(), rh.size() * 4) == 0);
    CHECK((th == td && oh == od && sh == sd));
    CombineArgs a;
    a.routed_out = rd.data();
    a.score_sorted = sd.data();
    a.row_of = od.data();
    a.rows = N;
    a.T = T;
    a.D = D;
    a.K = int(K);
    std::vector<float> ch(static_cast<size_t>(T * D)), cd(size_t(T * D), -1.f);
    combine_from_zeros(host, a, ch.data());
    combine_from_zeros(device, a, cd.data());
    CHECK(std::memcmp(ch.data(), cd.data(), ch.size() * 4) == 0);
    // The combine's backward (docs/contract.md §13): gradient rows and score gradient.
    std::vector<float> gh(static_cast<size_t>(N * D)), gd(size_t(N * D), -1.f), gsh(static_cast<size_t>(N)),
        gsd(size_t(N), -1.f);
    combine_backward(host, DType::fp32, k::ScoreApply::after_experts, k::ScoreMultiply::fp32, x.data(), rd.data(),
                     sd.data(), td.data(), od.data(), T, N, D, int(K), gh.data(), gsh.data());
    combine_backward(device, DType::fp32, k::ScoreApply::after_experts, k::ScoreMultiply::fp32, x.data(), rd.data(),
                     sd.data(), td.data(), od.data(), T, N, D, int(K), gd.data(), gsd.data());
    CHECK(std::memcmp(gh.data(), gd.data(), gh.size() * 4) == 0);
    CHECK(std::memcmp(gsh.data(), gsd.data(), gsh.size() * 4) == 0);
    m.end_call();
  }
  CHECK(m.device_bytes() == 0);  // every buffer here was a temporary
}

// An in-place combine into a new device output (the `in_place` variant with
// buffer fresh) writes its start on the device: nothing is built on the host
// and uploaded, so in-process ranks' combines are not held up behind their
// uploads (a bench at EP 8 once timed them one after another for that); the
// start's fill or copy is timed as the stage's own work.
TEST_CASE("an in-place combine's start is written on the device, its buffer never uploaded", "[cpu][device]") {
  auto dev = make_emulated_device(2);
  Mirror m(*dev);
  const int64_t T = 29, D = 24, K = 2, N = T * K;
  auto held = [&](size_t bytes, auto fill) {
    auto b = std::make_shared<std::vector<uint8_t>>(bytes);
    fill(b->data());
    m.hold(b->data(), b->size(), b);
    return b;
  };
  auto routed = held(size_t(N * D) * 4, [&](uint8_t* p) {
    for (int64_t i = 0; i < N * D; ++i) reinterpret_cast<float*>(p)[i] = float(int(i % 31) - 15) / 4.f;
  });
  auto scores = held(size_t(N) * 4, [&](uint8_t* p) {
    for (int64_t i = 0; i < N; ++i) reinterpret_cast<float*>(p)[i] = float(i % 3 + 1) / 4.f;
  });
  auto row_of = held(size_t(N) * 4, [&](uint8_t* p) {  // token t's k-th row: a permutation of the N rows
    for (int64_t i = 0; i < N; ++i) reinterpret_cast<int32_t*>(p)[i] = int32_t((i * 7) % N);
  });
  auto shared = held(size_t(T * D) * 4, [&](uint8_t* p) {
    for (int64_t i = 0; i < T * D; ++i) reinterpret_cast<float*>(p)[i] = float(i % 5) - 2.f;
  });
  CombineArgs a;
  a.routed_out = routed->data();
  a.score_sorted = reinterpret_cast<const float*>(scores->data());
  a.row_of = reinterpret_cast<const int32_t*>(row_of->data());
  a.rows = N;
  a.T = T;
  a.D = D;
  a.K = int(K);
  const size_t td = size_t(T * D) * 4;
  ExecCtx host{1, {}}, device{2, {}, &m};
  for (auto kind : {BufferStart::Kind::zeros, BufferStart::Kind::copy}) {
    const BufferStart start{kind, kind == BufferStart::Kind::copy ? shared->data() : nullptr};
    std::vector<float> want(size_t(T * D));
    if (kind == BufferStart::Kind::zeros)
      combine_from_zeros(host, a, want.data());
    else
      combine(host, a, shared->data(), want.data());
    m.begin_call();
    auto buf = std::make_shared<std::vector<uint8_t>>(td, 0xFF);
    m.hold_output(buf->data(), td, buf, 0xFF);
    std::vector<float> fallback(size_t(T * D), -1.f);
    const int64_t uploads = m.uploads();
    const ByteRange in[] = {{routed->data(), routed->size()}, {shared->data(), shared->size()}};
    const char* names[] = {"routed", "shared"};
    dev->window_begin();
    const InPlaceResult r = combine_in_place(device, a, buf->data(), fallback.data(), in, names, 2, start);
    dev->window_end();
    CHECK(r.placement == Placement::in_place);
    // the start is the stage's own device work, in its device time: a part of the busy window
    const std::vector<WindowPart> parts = dev->window_parts();
    const std::string start_part = kind == BufferStart::Kind::zeros ? "fill" : "copy";
    CHECK(std::count_if(parts.begin(), parts.end(), [&](const WindowPart& p) {
            return p.name == start_part && p.calls == 1;
          }) == 1);
    CHECK(m.uploads() == uploads);  // the inputs were held; the buffer's start never crossed from the host
    CHECK(std::memcmp(buf->data(), want.data(), td) == 0);
    CHECK(fallback == std::vector<float>(size_t(T * D), -1.f));
    // A buffer overlapping an input is left alone, even by its start: the
    // result (start + scatter) goes to the fallback.
    const std::vector<uint8_t> routed_before = *routed;
    const InPlaceResult f = combine_in_place(device, a, routed->data(), fallback.data(), in, names, 2, start);
    CHECK(f.placement == Placement::out_of_place_fallback);
    CHECK(*routed == routed_before);
    CHECK(std::memcmp(fallback.data(), want.data(), td) == 0);
    m.end_call();
  }
}
