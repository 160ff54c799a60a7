#include "device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <stdexcept>
#include <vector>

#include "host_exec.h"
#include "moe_host.h"
#include "swiglu_bwd_host.h"

namespace moev {

// --- Mirror -------------------------------------------------------------------

Mirror::~Mirror() {
  for (auto& [p, e] : entries_) dev_.release(e.dev);
}

Mirror::Map::iterator Mirror::find(const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  auto it = entries_.upper_bound(b);
  if (it == entries_.begin()) return entries_.end();
  --it;
  if (it->second.kind != Kind::temporary && it->second.owner.expired()) {  // its storage died: the address may be reused
    drop(it);
    return entries_.end();
  }
  if (b + bytes > it->first + it->second.bytes) return entries_.end();
  return it;
}

Mirror::Map::iterator Mirror::add(const void* p, size_t bytes, const std::shared_ptr<void>* owner, bool upload,
                                  int poison) {
  const auto* b = static_cast<const uint8_t*>(p);
  // An older buffer overlapping this range is stale (its storage died or it
  // was a smaller view): it goes.
  for (auto it = entries_.lower_bound(b); it != entries_.end() && it->first < b + bytes;) {
    auto next = std::next(it);
    drop(it);
    it = next;
  }
  auto below = entries_.upper_bound(b);
  if (below != entries_.begin() && std::prev(below)->first + std::prev(below)->second.bytes > b) drop(std::prev(below));
  Entry e;
  e.bytes = bytes;
  e.dev = dev_.alloc(bytes);
  if (owner) {
    e.owner = *owner;
  } else {
    e.kind = Kind::temporary;
    e.thread = std::this_thread::get_id();
  }
  if (upload) {
    dev_.upload(e.dev, p, bytes);
    ++uploads_;
  } else if (poison >= 0) {
    dev_.fill(e.dev, uint8_t(poison), bytes);
  }
  bytes_ += bytes;
  return entries_.emplace(b, e).first;
}

void Mirror::drop(Map::iterator it) {
  dev_.release(it->second.dev);
  bytes_ -= it->second.bytes;
  entries_.erase(it);
}

void Mirror::hold(const void* host, size_t bytes, const std::shared_ptr<void>& owner) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(host, bytes);
  if (it != entries_.end() && it->second.kind != Kind::temporary) return;
  add(host, bytes, &owner, true, -1);
}

void Mirror::hold_output(const void* host, size_t bytes, const std::shared_ptr<void>& owner, uint8_t poison) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lk(m_);
  add(host, bytes, &owner, false, poison)->second.kind = Kind::output;
}

const void* Mirror::in(const void* p, size_t bytes) {
  if (bytes == 0 || p == nullptr) return nullptr;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  if (it == entries_.end()) {
    it = add(p, bytes, nullptr, true, -1);
  } else if (it->second.host_may_be_newer()) {
    dev_.upload(device_at(it, p), p, bytes);
    ++uploads_;
  }
  return device_at(it, p);
}

void* Mirror::out(void* p, size_t bytes) {
  if (bytes == 0 || p == nullptr) return nullptr;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  // A temporary's device bytes start as the host's (a kernel may write only
  // part of a range), which write-through keeps equal after. An output keeps
  // its device poison: the device writes it, the host does not.
  if (it == entries_.end()) {
    it = add(p, bytes, nullptr, true, -1);
  } else if (it->second.kind == Kind::temporary) {
    dev_.upload(device_at(it, p), p, bytes);
    ++uploads_;
  }
  return device_at(it, p);
}

void Mirror::wrote(void* p, size_t bytes) {
  if (bytes == 0 || p == nullptr) return;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  if (it == entries_.end()) throw std::logic_error("Mirror::wrote: range not on the device");
  dev_.download(p, device_at(it, p), bytes);
  it->second.device_written = true;
}

void Mirror::host_wrote(const void* p, size_t bytes) {
  if (bytes == 0 || p == nullptr) return;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  if (it == entries_.end()) return;  // not on the device: nothing to refresh
  dev_.upload(device_at(it, p), p, bytes);
  ++uploads_;
}

bool Mirror::device_wrote(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  return it != entries_.end() && it->second.device_written;
}

uint64_t Mirror::device_hash(const void* p, size_t bytes) {
  if (bytes == 0) return 0;
  std::lock_guard<std::mutex> lk(m_);
  auto it = find(p, bytes);
  if (it == entries_.end()) throw std::logic_error("Mirror::device_hash: range not on the device");
  return dev_.hash(device_at(it, p), bytes);
}

void Mirror::release_temporaries() {
  std::lock_guard<std::mutex> lk(m_);
  const std::thread::id me = std::this_thread::get_id();
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second.kind == Kind::temporary && it->second.thread == me) drop(it);
    it = next;
  }
}

void Mirror::begin_call() {
  std::lock_guard<std::mutex> lk(m_);
  for (auto& [p, e] : entries_) {
    e.device_written = false;
    if (e.kind == Kind::output) e.kind = Kind::held;
  }
}

void Mirror::end_call() {
  std::lock_guard<std::mutex> lk(m_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    const bool dead = it->second.kind == Kind::temporary || it->second.owner.expired();
    if (dead) {
      auto next = std::next(it);
      drop(it);
      it = next;
    } else {
      ++it;
    }
  }
}

void BusyUnion::add(double a, double b) {
  if (!(b > a)) return;
  // merge with every interval that overlaps or touches [a, b)
  auto it = iv_.upper_bound(a);
  if (it != iv_.begin() && std::prev(it)->second >= a) --it;
  while (it != iv_.end() && it->first <= b) {
    a = std::min(a, it->first);
    b = std::max(b, it->second);
    it = iv_.erase(it);
  }
  iv_.emplace(a, b);
}

double BusyUnion::seconds() const {
  double s = 0;
  for (const auto& [a, b] : iv_) s += b - a;
  return s;
}

void BusyWindow::begin() {
  all_ = BusyUnion{};
  parts_.clear();
  open_ = true;
}

void BusyWindow::add(const std::string& part, double a, double b, double host_seconds) {
  if (!open_) return;
  all_.add(a, b);
  Part& p = parts_[part];
  p.all.add(a, b);
  ++p.calls;
  p.interval_seconds += b - a;
  p.host_seconds += host_seconds;
}

double BusyWindow::end() {
  open_ = false;
  return all_.seconds();
}

std::vector<WindowPart> BusyWindow::parts() const {
  std::vector<WindowPart> v;
  for (const auto& [name, p] : parts_) v.push_back({name, p.all.seconds(), p.calls, p.interval_seconds, p.host_seconds});
  std::stable_sort(v.begin(), v.end(), [](const WindowPart& a, const WindowPart& b) { return a.seconds > b.seconds; });
  return v;
}

// --- BlockCache ----------------------------------------------------------------

void* BlockCache::take(size_t bytes) {
  {
    std::lock_guard<std::mutex> lk(m_);
    auto it = kept_.find(bytes);
    if (it != kept_.end()) {
      void* p = it->second;
      kept_.erase(it);
      kept_bytes_ -= bytes;
      size_[p] = bytes;
      return p;
    }
  }
  void* p = alloc_(bytes);
  if (!p) {
    flush();
    p = alloc_(bytes);
    if (!p) return nullptr;
  }
  std::lock_guard<std::mutex> lk(m_);
  size_[p] = bytes;
  return p;
}

void BlockCache::give(void* p) {
  std::vector<void*> drop;
  {
    std::lock_guard<std::mutex> lk(m_);
    auto it = size_.find(p);
    if (it == size_.end()) {
      drop.push_back(p);
    } else {
      kept_.emplace(it->second, p);
      kept_bytes_ += it->second;
      size_.erase(it);
      while (kept_bytes_ > keep_) {  // the largest first
        auto big = std::prev(kept_.end());
        kept_bytes_ -= big->first;
        drop.push_back(big->second);
        kept_.erase(big);
      }
    }
  }
  for (void* d : drop) free_(d);
}

void BlockCache::flush() {
  std::vector<void*> drop;
  {
    std::lock_guard<std::mutex> lk(m_);
    for (const auto& kv : kept_) drop.push_back(kv.second);
    kept_.clear();
    kept_bytes_ = 0;
  }
  for (void* d : drop) free_(d);
}

size_t BlockCache::kept_bytes() const {
  std::lock_guard<std::mutex> lk(m_);
  return kept_bytes_;
}

std::string short_type_name(const std::type_info& t) {
  int status = 0;
  char* d = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status);
  std::string n = status == 0 && d ? d : t.name();
  std::free(d);
  n = n.substr(0, n.find('<'));
  const size_t colon = n.rfind("::");
  return colon == std::string::npos ? n : n.substr(colon + 2);
}

// --- the emulated device ------------------------------------------------------

namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class EmulatedDevice final : public BodyDevice<EmulatedDevice> {
 public:
  explicit EmulatedDevice(int threads) : ctx_{threads, {}} {}
  std::string name() const override { return "emulated (host memory, host executor; no GPU)"; }
  void* alloc(size_t bytes) override { return ::operator new(bytes); }
  void release(void* p) override { ::operator delete(p); }
  void upload(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }
  void download(void* d, const void* s, size_t n) override { std::memcpy(d, s, n); }
  void fill(void* d, uint8_t b, size_t n) override { std::memset(d, b, n); }
  void copy(void* d, const void* s, size_t n) override { std::memmove(d, s, n); }
  void fill_timed(void* d, uint8_t b, size_t n) override {
    timed("fill", [&] { std::memset(d, b, n); });
  }
  void copy_timed(void* d, const void* s, size_t n) override {
    timed("copy", [&] { std::memmove(d, s, n); });
  }
  // The same function as the CUDA device's hash kernel: the sum over 8-byte
  // words (zero-padded tail) of mix64(word ^ mix64(index)).
  uint64_t hash(const void* p, size_t n) override {
    const auto* b = static_cast<const uint8_t*>(p);
    uint64_t h = 0;
    for (size_t i = 0; i * 8 < n; ++i) {
      uint64_t w = 0;
      std::memcpy(&w, b + i * 8, std::min<size_t>(8, n - i * 8));
      h += mix64(w ^ mix64(i));
    }
    return h;
  }
  double busy_seconds() const override { return double(busy_ns_.load()) * 1e-9; }
  double timed_copy(void* d, const void* s, size_t n) override {
    return timed("copy", [&] { std::memmove(d, s, n); }, false);
  }
  void window_begin() override {
    std::lock_guard<std::mutex> lk(window_m_);
    window_.begin();
    window_t0_ = Clock::now();
  }
  double window_end() override {
    std::lock_guard<std::mutex> lk(window_m_);
    return window_.end();
  }
  std::vector<WindowPart> window_parts() override {
    std::lock_guard<std::mutex> lk(window_m_);
    return window_.parts();
  }
  void sort(const int32_t* ids, int64_t N, int E, int32_t* perm, bool descending_within) override {
    FaultSet f;
    if (descending_within) f.bits |= uint64_t(Fault::unstable_sort);
    timed("sort", [&] { expert_sort(ExecCtx{ctx_.threads, f}, ids, N, E, perm); });
  }
  void gemm_logits(DType dt, const void* x, const void* wg, int64_t T, int64_t D, int E, float* logits) override {
    timed("gemm", [&] { router_logits(ExecCtx{ctx_.threads, {}}, dt, x, wg, T, D, E, logits); });
  }
  void gemm_nt(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
               int64_t ldy) override {
    timed("gemm", [&] { moev::gemm_nt(ExecCtx{ctx_.threads, {}}, dt, X, rows, k, ldx, W, n, Y, ldy); });
  }
  void gemm_nn(DType dt, const void* X, int64_t rows, int64_t k, int64_t ldx, const void* W, int64_t n, void* Y,
               int64_t ldy) override {
    timed("gemm", [&] { moev::gemm_nn(ExecCtx{ctx_.threads, {}}, dt, X, rows, k, ldx, W, n, Y, ldy); });
  }
  void gemm_tn_f32(DType dt, const void* A, int64_t rows, int64_t m, int64_t lda, const void* B, int64_t n,
                   int64_t ldb, float* C) override {
    timed("gemm", [&] { moev::gemm_tn_f32(ExecCtx{ctx_.threads, {}}, dt, A, rows, m, lda, B, n, ldb, C); });
  }
  void gemm_group(DType dt, const std::vector<GemmJob>& jobs) override {
    const ExecCtx host{ctx_.threads, {}};
    timed("gemm_group", [&] { moev::gemm_group(host, dt, jobs, {}, {}); });
    ++group_calls_;
  }
  GroupCalls gemm_group_calls() const override { return {group_calls_.load(), "host Eigen GEMMs, one job after another"}; }

 private:
  using Clock = std::chrono::steady_clock;
  /// Runs f on the host clock and returns its seconds, also added to
  /// busy_ns_ where `busy`, and inside a window to its union under `part`
  /// (as the CUDA device's events).
  template <class F>
  double timed(const std::string& part, F&& f, bool busy = true) {
    const auto t0 = Clock::now();
    f();
    const auto t1 = Clock::now();
    const double seconds = std::chrono::duration<double>(t1 - t0).count();
    if (busy) busy_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
    std::lock_guard<std::mutex> lk(window_m_);
    if (window_.open())  // the host does the work: all of the interval is the host's
      window_.add(part, std::chrono::duration<double>(t0 - window_t0_).count(),
                  std::chrono::duration<double>(t1 - window_t0_).count(), seconds);
    return seconds;
  }
  /// Each item as an emulated GPU block of kLanes lanes (block_item): the
  /// bodies' multi-lane index math, which the host executor (one lane) never
  /// takes, runs in every case on this device. An odd count, so that no
  /// stride happens to divide a row.
  static constexpr int kLanes = 3;
  friend class BodyDevice<EmulatedDevice>;  // its run() overrides call body()
  template <class Body>
  void body(const Body& b, int64_t n) {
    timed(part_name<Body>(), [&] { host_run(ctx_, n, b, kLanes); });
  }

  ExecCtx ctx_;
  std::atomic<int64_t> busy_ns_{0}, group_calls_{0};
  std::mutex window_m_;
  BusyWindow window_;
  Clock::time_point window_t0_;
};

}  // namespace

std::unique_ptr<Device> make_emulated_device(int threads) { return std::make_unique<EmulatedDevice>(threads); }

}  // namespace moev
