#include "bench.h"

#include <unistd.h>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "comm.h"
#include "device.h"
#include "error.h"
#include "memory_estimate.h"
#include "registry.h"
#include "runner.h"
#include "stages.h"
#include "subprocess.h"
#include "version.h"

namespace moev {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The roof: the fastest of `repeat` memcpys of `bytes` bytes (after one
/// untimed copy), split into `threads` contiguous chunks copied in parallel,
/// as the host executor splits its rows. Buffers are kept between calls.
double memcpy_seconds(double bytes, int threads, int repeat) {
  static std::vector<uint8_t> src, dst;
  const size_t n = size_t(bytes);
  if (n == 0) return 0;
  if (src.size() < n) {
    src.assign(n, 1);  // touched: page faults are not part of the roof
    dst.assign(n, 0);
  }
  const int chunks = std::max(1, threads);
  auto copy = [&] {
#pragma omp parallel for num_threads(chunks) schedule(static)
    for (int i = 0; i < chunks; ++i) {
      const size_t a = n / size_t(chunks) * size_t(i), b = i + 1 == chunks ? n : n / size_t(chunks) * size_t(i + 1);
      std::memcpy(dst.data() + a, src.data() + a, b - a);
    }
  };
  copy();
  double best = 1e300;
  for (int r = 0; r < std::max(1, repeat); ++r) {
    const auto t = clock_type::now();
    copy();
    best = std::min(best, seconds_since(t));
  }
  return best;
}

/// The device's roof: the fastest of `repeat` device-to-device copies of
/// `bytes` bytes (after one untimed copy), by the device's clock
/// (Device::timed_copy). The buffers live for this call only.
double device_copy_seconds(Device& dev, double bytes, int repeat) {
  const size_t n = size_t(bytes);
  if (n == 0) return 0;
  struct Buffer {
    Device& d;
    void* p;
    Buffer(Device& dev, size_t n) : d(dev), p(dev.alloc(n)) { d.fill(p, 1, n); }
    ~Buffer() { d.release(p); }
  } src(dev, n), dst(dev, n);
  dev.timed_copy(dst.p, src.p, n);
  double best = 1e300;
  for (int r = 0; r < std::max(1, repeat); ++r) best = std::min(best, dev.timed_copy(dst.p, src.p, n));
  return best;
}

/// Bytes of a (rows, D) activation tensor: the rows a data-movement stage
/// moves (not an integer tensor that happens to have D columns: row_of is
/// (T, K) and K may equal D).
double row_bytes(const Tensor& t, int64_t D) {
  const bool rows = t.type == ElemType::f32 || t.type == ElemType::bf16 || t.type == ElemType::f16 ||
                    t.type == ElemType::e4m3;
  return rows && t.shape.size() == 2 && t.shape[1] == D ? double(t.bytes()) : 0.0;
}

bool is_all_to_all(const std::string& slot) { return slot == "ep_dispatch" || slot == "ep_combine"; }

/// The bytes formula of a stage (README.md, "Benchmarks"), summed over ranks.
/// `in` is the board the stage read, `out` what it wrote.
std::pair<double, std::string> bytes_formula(const Stage& s, const Case& c, const Board& in,
                                             const std::vector<RankBoard>& out) {
  static const std::vector<std::string> row_moves = {"dispatch", "ep_permute", "ep_unpermute", "align_pad",
                                                     "align_unpad"};
  const bool identity = (s.slot == "experts" && s.variant == "identity") ||
                        (s.slot == "shared_experts" && s.variant == "shared_identity");
  double written_rows = 0, written = 0, read = 0;
  for (const RankBoard& b : out)
    for (const auto& [n, t] : b) {
      written_rows += row_bytes(t, c.hidden);
      written += double(t.bytes());
    }
  if (is_all_to_all(s.slot)) return {2 * written_rows, "2 x rows received (all-to-all)"};
  if (identity || std::find(row_moves.begin(), row_moves.end(), s.slot) != row_moves.end())
    return {2 * written_rows, "2 x rows written"};
  if (s.slot == "combine") {
    for (size_t r = 0; r < in.ranks.size(); ++r) read += row_bytes(in.at("routed_output", int(r)), c.hidden);
    // The target's rows the kernel reads before it adds (stages_local.cpp:
    // in place always the caller's buffer; out of place a buffer unless it
    // starts at zeros) and the shared experts' rows added after: each a
    // (T, D) tensor as the output.
    const bool init = s.variant == "in_place" || !combine_starts_at_zeros(c);
    const bool add_after = c.shared.kind != SharedKind::none && c.shared.order == SharedOrder::add_after;
    const int extra = int(init) + int(add_after);
    return {read + double(1 + extra) * written_rows,
            std::string("routed rows read + ") + (init ? "the target's rows read + " : "") +
                (add_after ? "shared rows read + " : "") + "output rows written"};
  }
  for (size_t r = 0; r < in.ranks.size(); ++r)
    for (const auto& n : s.inputs(c)) read += double(in.at(n, int(r)).bytes());
  return {read + written, "inputs read + outputs written"};
}

/// Seconds of one fast call: `wall` on the host clock; on a device backend
/// `device` too, the time the device was busy with the call (its kernels,
/// sorts, GEMMs and the in-process all-to-all's device-to-device copies, the
/// union of their intervals: Device::window_begin/window_end), and
/// `device_summed`, the same work's intervals summed over the ranks' streams
/// (which counts overlapping ranks once each: what `device` was before
/// 2026-11-27, kept for comparison).
struct FastSeconds {
  double wall = 0, device = 0, device_summed = 0;
  std::vector<WindowPart> parts;  // the device window's (Device::window_parts)
};

/// Runs a stage's fast function on every rank of `in` (in-process ranks as
/// threads with local comms, threads split among them as the runner does)
/// and times it. Outputs go to `out`, reused between calls under
/// OutputBuffers::reuse. With a mirror the call runs on its device as the
/// runner's do (begin_device_call, sync_device_outputs).
FastSeconds time_fast_once(const Stage& s, const Case& c, const Board& in, std::vector<RankBoard>& out, int threads,
                           Mirror* mirror, OutputBuffers buffers, std::string& skipped, std::string& error) {
  const int R = int(in.ranks.size());
  std::atomic<int64_t> copy_ns{0};
  DeviceCopy copy;
  if (mirror)
    copy = [&copy_ns, dev = &mirror->device()](void* d, const void* src, size_t n) {
      copy_ns += int64_t(dev->timed_copy(d, src, n) * 1e9);
    };
  auto comms = make_local_comms(R, std::chrono::milliseconds(60000), std::move(copy));
  std::vector<std::string> skip(static_cast<size_t>(R)), err(static_cast<size_t>(R));
  std::vector<std::vector<std::string>> notes(static_cast<size_t>(R));
  auto one = [&](int r) {
    ExecCtx ex{std::max(1, threads / R), FaultSet{}, mirror};
    FastCtx ctx{c, r, R, ex, comms[size_t(r)].get(), in.ranks[size_t(r)], out[size_t(r)], notes[size_t(r)],
                &skip[size_t(r)], buffers};
    try {
      s.fast(ctx);
    } catch (const std::exception& e) {
      err[size_t(r)] = e.what();
      comms[size_t(r)]->abort(e.what());
    }
    comms[size_t(r)]->leave();
  };
  if (mirror) begin_device_call(*mirror, in, s.inputs(c));
  const double busy0 = mirror ? mirror->device().busy_seconds() : 0;
  if (mirror) mirror->device().window_begin();
  const auto t0 = clock_type::now();
  if (R == 1) {
    one(0);
  } else {
    std::vector<std::thread> th;
    for (int r = 0; r < R; ++r) th.emplace_back(one, r);
    for (auto& t : th) t.join();
  }
  FastSeconds sec;
  sec.wall = seconds_since(t0);
  if (mirror) {
    sec.device = mirror->device().window_end();
    sec.parts = mirror->device().window_parts();
    sec.device_summed = mirror->device().busy_seconds() - busy0 + double(copy_ns.load()) * 1e-9;
    sync_device_outputs(*mirror, out);
    mirror->end_call();
  }
  for (int r = 0; r < R; ++r) {
    if (skipped.empty() && !skip[size_t(r)].empty()) skipped = skip[size_t(r)];
    if (error.empty() && !err[size_t(r)].empty()) error = "rank " + std::to_string(r) + ": " + err[size_t(r)];
  }
  return sec;
}

/// The GEMMs of a stage as (M, K, N) shapes summed over ranks, as
/// docs/contract.md names them: the router logits (T, D, E); SwiGLU forward
/// h1, h3 (rows, D, F) and Y (rows, F, D); SwiGLU backward h1, h3 again, dH
/// (rows, D, F), dX as two (rows, F, D), dW1, dW3 (F, rows, D) and dW2
/// (D, rows, F). rows: the rows of the stage's groups. Empty for a stage
/// that runs no GEMM.
std::vector<std::array<int64_t, 3>> gemm_shapes(const Stage& s, const Case& c, const Board& in) {
  std::vector<std::array<int64_t, 3>> g;
  const int64_t D = c.hidden, F = c.ffn;
  const int R = int(in.ranks.size());
  auto rows_of = [&](const std::string& counts, const std::string& tokens) {
    int64_t n = 0;
    for (int r = 0; r < R; ++r) {
      if (!counts.empty() && in.has(counts, r)) {
        const Tensor& t = in.at(counts, r);
        for (int64_t i = 0; i < t.numel(); ++i) n += t.as<int64_t>()[i];
      } else if (!tokens.empty() && in.has(tokens, r)) {
        n += in.at(tokens, r).shape[0];
      }
    }
    return n;
  };
  auto swiglu = [&](int64_t n, bool backward) {
    g.push_back({n, D, F});
    g.push_back({n, D, F});
    if (!backward) return g.push_back({n, F, D});
    g.push_back({n, D, F});
    g.push_back({n, F, D});
    g.push_back({n, F, D});
    g.push_back({F, n, D});
    g.push_back({F, n, D});
    g.push_back({D, n, F});
  };
  if (s.slot == "router_logits") g.push_back({rows_of("", "x"), D, c.num_experts});
  if (s.slot == "experts" && s.variant.rfind("swiglu", 0) == 0) swiglu(rows_of("expert_counts", ""), false);
  if (s.slot == "shared_experts" && s.variant == "shared_swiglu") swiglu(rows_of("", "x"), false);
  // backward: swiglu, or swiglu_autograd (autograd's rounding points, the same GEMMs)
  if (s.slot == "experts_bwd" && s.variant.rfind("swiglu", 0) == 0) swiglu(rows_of("expert_counts", ""), true);
  if (s.slot == "shared_experts_bwd" && s.variant.rfind("shared_swiglu", 0) == 0) swiglu(rows_of("", "x"), true);
  return g;
}

/// The device's roof for a GEMM stage (issue 36 item 3): one GEMM of the
/// same FLOPs on the device, in the case's dtype, fp32 accumulation, in the
/// faster of two shapes: the stage's own (M the sum of its shapes' M over
/// ranks, of the largest shape's K; K that K; N = flops / (2 M K)) and a
/// cube of side (flops / 2)^(1/3) rounded to a multiple of 64. The cube
/// keeps the roof high where the stage's shape is one cuBLAS runs slowly:
/// on an H200 the SwiGLU backward's (M 4096, K 8192, N 28672) ran at 289
/// TFLOP/s, a third of the forward's. Each the fastest of `repeat` after
/// one untimed call, by the device's clock (Device::window_*). 0 when the
/// shape is empty or neither fits in memory.
double device_gemm_seconds(Device& dev, DType dt, const std::vector<std::array<int64_t, 3>>& shapes, double flops,
                           int repeat) {
  int64_t K = 0, M = 0;
  for (const auto& [m, k, n] : shapes) K = std::max(K, k);
  for (const auto& [m, k, n] : shapes) M += k == K ? m : 0;
  if (M == 0 || K == 0 || flops <= 0) return 0;
  const int64_t N = std::max<int64_t>(1, int64_t(std::llround(flops / (2.0 * double(M) * double(K)))));
  const int64_t side = std::max<int64_t>(64, int64_t(std::llround(std::cbrt(flops / 2.0) / 64.0)) * 64);
  const size_t eb = dtype_bytes(dt);
  struct Buffer {
    Device& d;
    void* p;
    Buffer(Device& dev, size_t n) : d(dev), p(dev.alloc(n)) { d.fill(p, 0x3c, n); }  // 0x3c3c: small finite values
    ~Buffer() { d.release(p); }
  };
  // the fastest of `repeat` calls of the (m, k, n) GEMM, as a rate: the
  // cube's FLOPs differ from the stage's by its side's rounding
  auto seconds_per_flop = [&](int64_t m, int64_t k, int64_t n) {
    try {
      Buffer x(dev, size_t(m * k) * eb), w(dev, size_t(n * k) * eb), y(dev, size_t(m * n) * eb);
      double best = 1e300;
      for (int r = 0; r <= std::max(1, repeat); ++r) {
        dev.window_begin();
        dev.gemm_nt(dt, x.p, m, k, k, w.p, n, y.p, n);
        const double t = dev.window_end();
        if (r > 0) best = std::min(best, t);
      }
      return best / (2.0 * double(m) * double(k) * double(n));
    } catch (const std::exception&) {
      return 0.0;  // too large to allocate
    }
  };
  double best = 0;
  for (const double spf : {seconds_per_flop(M, K, N), seconds_per_flop(side, side, side)})
    if (spf > 0 && (best == 0 || spf < best)) best = spf;
  return best * flops;
}

/// Seconds of Eigen fp32 GEMMs of `shapes` on `threads` threads (the rows
/// split into one block per thread, each a single-threaded Eigen product:
/// Eigen's own threads are off in every target), each the fastest of
/// `repeat` products after one untimed one; operands are filled once with
/// small values.
double eigen_gemm_seconds(const std::vector<std::array<int64_t, 3>>& shapes, int threads, int repeat) {
  using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int nt = std::max(1, threads);
  double total = 0;
  for (const auto& [M, K, N] : shapes) {
    if (M == 0 || K == 0 || N == 0) continue;
    const MatF a = MatF::Constant(M, K, 0.5f), b = MatF::Constant(K, N, 0.25f);
    MatF out(M, N);
    const int64_t per = (M + nt - 1) / nt;
    auto product = [&] {
#pragma omp parallel for num_threads(nt) schedule(static, 1)
      for (int k = 0; k < nt; ++k) {
        const int64_t r0 = std::min<int64_t>(M, k * per), r1 = std::min<int64_t>(M, r0 + per);
        if (r1 > r0) out.middleRows(r0, r1 - r0).noalias() = a.middleRows(r0, r1 - r0) * b;
      }
    };
    product();
    double best = 1e300;
    for (int r = 0; r < std::max(1, repeat); ++r) {
      const auto t = clock_type::now();
      product();
      best = std::min(best, seconds_since(t));
    }
    total += best;
  }
  return total;
}

StageBench bench_stage(const Stage& s, const VariantDecision& vd, double slot_ref_seconds, const Case& c,
                       const Board& board, Mirror* mirror, const BenchOptions& opt) {
  StageBench b;
  b.backend = enum_name(backend_table(), c.backend);
  b.slot = s.slot;
  b.variant = s.variant;
  b.ref_seconds = vd.ref_seconds;
  b.compare_seconds = vd.compare_seconds;
  const int R = int(board.ranks.size());
  for (const auto& n : s.inputs(c))
    for (int r = 0; r < R; ++r)
      if (!board.has(n, r)) {
        b.note = "input '" + n + "' is not on the board of the run";
        return b;
      }
  std::vector<RankBoard> out(static_cast<size_t>(R));
  std::vector<double> times, device_times, device_summed;
  std::vector<std::vector<WindowPart>> device_parts;
  const int64_t group_calls = mirror ? mirror->device().gemm_group_calls().calls : 0;
  // The first call allocates (and poisons) the outputs; later calls reuse
  // them. It is never timed, so --warmup 0 still times the fast path, not
  // the allocator.
  const int warmup = std::max(opt.warmup, 1);
  for (int i = 0; i < warmup + opt.repeat; ++i) {
    std::string skipped, error;
    const FastSeconds sec = time_fast_once(s, c, board, out, opt.threads, mirror,
                                           i == 0 ? OutputBuffers::fresh : OutputBuffers::reuse, skipped, error);
    if (!error.empty() || !skipped.empty()) {
      b.note = !error.empty() ? "fast stage failed: " + error : "skipped: " + skipped;
      return b;
    }
    if (i >= warmup) {
      times.push_back(sec.wall), device_times.push_back(sec.device), device_summed.push_back(sec.device_summed);
      device_parts.push_back(std::move(sec.parts));
    }
  }
  b.ran = true;
  b.seconds_min = *std::min_element(times.begin(), times.end());
  b.seconds_median = median(times);
  b.spread = spread_of(times);
  std::tie(b.bytes, b.bytes_formula) = bytes_formula(s, c, board, out);
  b.gbps = b.seconds_min > 0 ? b.bytes / b.seconds_min / 1e9 : 0;
  // at least 5 samples: the best of one or two copies was often far off on a
  // shared machine (a roof 10x too slow gave "%roof" past 1000)
  b.roof_seconds = memcpy_seconds(b.bytes / 2, opt.threads, std::max(opt.repeat, 5));
  b.roof_gbps = b.roof_seconds > 0 ? b.bytes / b.roof_seconds / 1e9 : 0;
  b.ratio_to_roof = b.seconds_min > 0 ? b.roof_seconds / b.seconds_min : 0;
  if (mirror) {
    const auto fastest = std::min_element(device_times.begin(), device_times.end());
    b.device_seconds_min = *fastest;
    b.device_parts = device_parts[size_t(fastest - device_times.begin())];
    b.device_seconds_median = median(device_times);
    b.device_summed_seconds_min = *std::min_element(device_summed.begin(), device_summed.end());
    b.device_gbps = b.device_seconds_min > 0 ? b.bytes / b.device_seconds_min / 1e9 : 0;
    b.device_copy_seconds = device_copy_seconds(mirror->device(), b.bytes / 2, opt.repeat);
    b.device_copy_gbps = b.device_copy_seconds > 0 ? b.bytes / b.device_copy_seconds / 1e9 : 0;
    b.ratio_to_device_copy = b.device_seconds_min > 0 ? b.device_copy_seconds / b.device_seconds_min : 0;
  }
  // The time the GEMM and all-to-all figures use: the device's own on a
  // device backend.
  const double own_seconds = mirror ? b.device_seconds_min : b.seconds_min;
  if (is_all_to_all(s.slot) && own_seconds > 0) {
    b.algbw_gbps = b.bytes / 2 / R / own_seconds / 1e9;
    b.busbw_gbps = b.algbw_gbps * double(R - 1) / double(R);
  }
  if (b.seconds_min > 0) b.check_ratio = (std::max(b.ref_seconds, slot_ref_seconds) + b.compare_seconds) / b.seconds_min;
  const std::vector<std::array<int64_t, 3>> shapes = gemm_shapes(s, c, board);
  for (const auto& [M, K, N] : shapes) b.flops += 2.0 * double(M) * double(K) * double(N);
  if (b.flops > 0 && own_seconds > 0) {
    b.gflops = b.flops / own_seconds / 1e9;
    b.eigen_seconds = eigen_gemm_seconds(shapes, opt.threads, opt.repeat);
    b.eigen_ratio = b.eigen_seconds / own_seconds;
    if (mirror) {
      const Device::GroupCalls g = mirror->device().gemm_group_calls();
      if (g.calls > group_calls) b.gemm_path = g.path;
      b.device_gemm_seconds = device_gemm_seconds(mirror->device(), c.dtype, shapes, b.flops, opt.repeat);
      b.device_gemm_ratio = b.device_gemm_seconds / own_seconds;
    }
  }
  return b;
}

/// Growth sweep: the case re-loaded with one of T, D, R scaled by 1/4, 1/2
/// and 1 (the others as in the case), each verified once.
std::vector<SweepPoint> run_sweep(const Case& c, const BenchOptions& opt, std::ostream& log) {
  std::vector<SweepPoint> pts;
  for (const char* axis : {"T", "D", "R"})
    for (double scale : {0.25, 0.5, 1.0}) {
      SweepPoint p;
      p.axis = axis;
      p.scale = scale;
      p.tokens = c.tokens;
      p.hidden = c.hidden;
      p.ep = c.ep;
      const std::string a = axis;
      if (a == "T") p.tokens = std::max<int64_t>(1, int64_t(double(c.tokens) * scale));
      if (!c.tokens_per_rank.empty() || c.tokens_uniform_lo >= 0) {  // T shows the largest rank's count
        p.tokens = 0;
        for (int r = 0; r < c.ep; ++r)
          p.tokens = std::max<int64_t>(p.tokens, int64_t(double(c.tokens_on(r)) * (a == "T" ? scale : 1.0)));
      }
      if (a == "D") p.hidden = std::max<int64_t>(1, int64_t(double(c.hidden) * scale));
      if (a == "R") p.ep = std::max(1, int(double(c.ep) * scale));
      bool duplicate = false;  // R = 1 scales to 1 three times: run it once
      for (const auto& q : pts) duplicate = duplicate || (q.axis == p.axis && q.tokens == p.tokens && q.hidden == p.hidden && q.ep == p.ep);
      if (duplicate) continue;
      // Only the axis's key is set: the others stay as the case has them
      // (tokens_per_rank in place of shape.tokens).
      std::vector<std::string> sets = opt.sets;
      const auto scaled = [&](int64_t t) { return std::to_string(std::max<int64_t>(0, int64_t(double(t) * scale))); };
      if (a == "T" && !c.tokens_per_rank.empty()) {  // every rank's count scaled
        std::string l;
        for (int64_t t : c.tokens_per_rank) l += (l.empty() ? "[" : ",") + scaled(t);
        sets.push_back("shape.tokens_per_rank=" + l + "]");
      } else if (a == "T" && c.tokens_uniform_lo >= 0) {
        sets.push_back("shape.tokens_per_rank={uniform: [" + scaled(c.tokens_uniform_lo) + ", " +
                       scaled(c.tokens_uniform_hi) + "]}");
      } else if (a == "T") {
        sets.push_back("shape.tokens=" + std::to_string(p.tokens));
      }
      if (a == "D") sets.push_back("shape.hidden=" + std::to_string(p.hidden));
      if (a == "R") sets.push_back("ep=" + std::to_string(p.ep));
      try {
        // The file's other cases may not fit the point (tokens_per_rank of
        // another ep): left out, as they are not this case.
        const Case* found = nullptr;
        LoadNotes notes;
        const std::vector<Case> cases = load_cases(opt.file, sets, &notes);
        for (const auto& k : cases)
          if (k.name == c.name) found = &k;
        for (const auto& n : notes.left_out)
          if (!found && n.first == c.name) throw Error(ErrorKind::bad_input, left_out_note(n));
        if (!found) throw Error(ErrorKind::bad_input, "the case is not in the re-loaded file");
        log << "  sweep " << axis << " x " << scale << ": T=" << p.tokens << " D=" << p.hidden << " R=" << p.ep << "\n";
        RunOptions ro;
        ro.threads = opt.threads;
        reset_peak_rss();
        const CaseReport rep = run_case(*found, ro);
        p.peak_rss_bytes = peak_rss_bytes();
        p.verify_seconds = rep.seconds;
        p.estimated_bytes = estimate_case_bytes(*found, opt.threads);
        p.ran = true;
        if (rep.outcome != Outcome::PASSED) p.note = std::string("run was ") + outcome_name(rep.outcome);
      } catch (const std::exception& e) {
        p.note = e.what();
      }
      pts.push_back(p);
    }
  return pts;
}

std::string fmt(double v, int prec) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(prec) << v;
  return o.str();
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t p = line.find(':');
      return p == std::string::npos ? line : line.substr(p + 2);
    }
  return "unknown";
}

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    switch (ch) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += ch;
    }
  }
  return o;
}

}  // namespace

/// Runs the peer command on the case's shape (BenchOptions::peer) and
/// records its stage seconds, or why there are none, in cb.
void run_peer(CaseBench& cb, const BenchOptions& opt, std::ostream& log) {
  const Case& c = cb.c;
  int64_t tokens = 0;  // every rank's, per-rank counts included
  for (int r = 0; r < c.ep; ++r) tokens += c.tokens_on(r);
  nlohmann::json spec = {{"tokens", tokens},
                         {"ep", c.ep},
                         {"hidden", c.hidden},
                         {"ffn", c.ffn},
                         {"experts", c.num_experts},
                         {"top_k", c.top_k},
                         {"groups", c.router.groups},
                         {"limited_groups", c.router.limited_groups},
                         {"score", c.router.score == k::ScoreFunc::sigmoid ? "sigmoid" : "softmax"},
                         {"bias", c.router.bias == Switch::on},
                         {"route_norm", c.router.route_norm == Switch::on},
                         {"route_scale", c.router.route_scale},
                         {"dtype", dtype_name(c.dtype)},
                         {"expert_kind", c.experts.kind == ExpertKind::swiglu ? "swiglu" : "identity"},
                         {"repeat", opt.repeat},
                         {"device", c.backend == Backend::cuda ? "cuda" : "cpu"}};
  char path[] = "/tmp/moeverify-peer-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) {
    cb.peer_note = "cannot create a spec file under /tmp";
    return;
  }
  close(fd);
  std::ofstream(path) << spec.dump() << "\n";
  std::string cmd = opt.peer;
  const size_t at = cmd.find("{spec}");
  if (at == std::string::npos) cmd += std::string(" ") + path;
  else cmd.replace(at, 6, path);
  log << "  peer: " << cmd << "\n";
  const ProcEnd end = run_command(cmd, opt.peer_timeout_s);
  std::remove(path);
  if (end.how != ProcEnd::How::exited || end.code != 0) {
    std::string err = end.err_tail;
    while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.pop_back();
    const size_t nl = err.rfind('\n');
    cb.peer_note = "the peer " + end.describe(opt.peer_timeout_s, "--peer-timeout") +
                   (err.empty() ? "" : ": " + (nl == std::string::npos ? err : err.substr(nl + 1)));
    return;
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(end.out_tail);
    const nlohmann::json& st = j.at("stages");
    if (!st.is_object()) throw std::runtime_error("\"stages\" is not an object of slots");
    for (const auto& [slot, v] : st.items()) {
      const double sec = v.at("seconds").get<double>();
      if (!std::isfinite(sec) || sec <= 0)
        throw std::runtime_error("stage " + slot + ": seconds " + std::to_string(sec) + ", not a positive time");
      const auto& reg = registry();
      if (std::none_of(reg.begin(), reg.end(), [&](const Stage& x) { return x.slot == slot; }))
        throw std::runtime_error("stage " + slot + ": no such slot");
      cb.peer.push_back({slot, v.value("what", std::string()), sec});
    }
    if (cb.peer.empty()) throw std::runtime_error("no stage timed");
    cb.peer_name = "torch " + j.value("torch", std::string("?")) + " on " + j.value("device", std::string("?"));
  } catch (const std::exception& e) {
    cb.peer.clear();
    cb.peer_name.clear();
    cb.peer_note = std::string("the peer's output is not its JSON (") + printable(e.what(), 300) + ")";
  }
}

CaseBench bench_case(const Case& c, const BenchOptions& opt, std::ostream& log) {
  CaseBench cb;
  cb.c = c;
  if (opt.sweep) cb.sweep = run_sweep(c, opt, log);  // first: nothing else held while peaks are measured
  log << "  verifying " << c.name << "\n";
  // The verification alone, as `run` does it: its time and peak memory.
  RunOptions ro;
  ro.threads = opt.threads;
  reset_peak_rss();
  const CaseReport rep = run_case(c, ro);
  cb.peak_rss_bytes = peak_rss_bytes();
  cb.estimated_bytes = estimate_case_bytes(c, opt.threads);
  cb.outcome = rep.outcome;
  cb.verify_seconds = rep.seconds;
  // Then the timings: the case runs again and each slot's variants are timed
  // as soon as the streaming runner has run them (RunOptions::after_slot),
  // on the inputs it still holds, so a case that fits to verify fits to
  // bench. Reference and comparison seconds are those of the run above.
  const VariantDecision* dispatch = nullptr;
  const VariantDecision* combine = nullptr;
  ro.after_slot = [&](const Stage& s, const VariantDecision& timed, const Board& board, Mirror* mirror) {
    const VariantDecision* vd = &timed;
    double slot_ref = 0;  // the slot's reference, computed once with its first variant
    for (const auto& d : rep.decisions) {
      if (d.slot == s.slot && d.variant == s.variant) vd = &d;
      if (d.slot == s.slot) slot_ref = std::max(slot_ref, d.ref_seconds);
    }
    log << "  timing " << s.slot << "/" << s.variant << "\n";
    cb.stages.push_back(bench_stage(s, *vd, slot_ref, c, board, mirror, opt));
    const StageBench& sb = cb.stages.back();
    if (!sb.ran || !vd->primary) return;
    // On a device the roof-ratio is of device times against a device copy.
    const double t = mirror ? sb.device_seconds_min : sb.seconds_min;
    if (s.slot == "dispatch") {
      dispatch = vd, cb.dispatch_seconds = t;
      for (int r = 0; r < int(board.ranks.size()); ++r)
        if (board.has("routed_input", r)) cb.routed_bytes += row_bytes(board.at("routed_input", r), c.hidden);
      cb.routed_memcpy_seconds = mirror ? device_copy_seconds(mirror->device(), cb.routed_bytes, opt.repeat)
                                        : memcpy_seconds(cb.routed_bytes, opt.threads, opt.repeat);
    }
    if (s.slot == "combine") combine = vd, cb.combine_seconds = t;
  };
  run_case(c, ro);
  if (dispatch && combine) {
    const double t = cb.dispatch_seconds + cb.combine_seconds;
    cb.roof_ratio = t > 0 ? 2 * cb.routed_memcpy_seconds / t : 0;
  }
  if (!opt.peer.empty()) run_peer(cb, opt, log);
  return cb;
}

/// The stage the peer's slot is compared with: the first timed variant of
/// that slot (the primary one, which `run` reports first), or none.
const StageBench* peer_match(const CaseBench& b, const std::string& slot) {
  for (const auto& s : b.stages)
    if (s.ran && s.slot == slot) return &s;
  return nullptr;
}

/// The peer's table under a case's (BenchOptions::peer).
void print_peer(const CaseBench& b, std::ostream& os) {
  if (b.peer.empty() && b.peer_note.empty()) return;
  const bool on_device = b.c.backend != Backend::host;
  os << "  peer (" << (b.peer_note.empty() ? b.peer_name : "none") << "): the same stage on the same shapes, "
     << (on_device ? "device" : "wall") << " seconds, best of --repeat; ratio = moeverify / peer time\n";
  if (!b.peer_note.empty()) os << "    not run: " << b.peer_note << "\n";
  for (const auto& p : b.peer) {
    const StageBench* mine = peer_match(b, p.slot);
    const double t = mine ? (on_device ? mine->device_seconds_min : mine->seconds_min) : 0;
    os << "    " << std::left << std::setw(16) << p.slot << std::right << std::setw(10) << fmt(t * 1e3, 4)
       << " ms (" << (mine ? mine->variant : std::string("not timed")) << ")" << std::setw(10)
       << fmt(p.seconds * 1e3, 4) << " ms peer  ratio " << (t > 0 && p.seconds > 0 ? fmt(t / p.seconds, 2) : "-")
       << "  [" << p.what << "]\n";
  }
}

/// The device table of print_bench: each stage variant's seconds by the
/// device's clock against a device copy of its bytes, and where they went.
void print_device_table(const CaseBench& b, std::ostream& os) {
  os << "  on the device (" << enum_name(backend_table(), b.c.backend)
     << "): its own clock, the time it was busy with the stage's kernels, sorts, GEMMs and all-to-all copies (their "
        "intervals' union across ranks); roof: a device-to-device copy of half the bytes, timed in the same run (min ms and GB/s above: wall, with the write-back to the "
        "host); parts: that time by kind of work (kernel body, sort, histogram, GEMMs, copies), each its intervals' union (they overlap where ranks ran side by side), "
        "and the share of its calls' intervals the host spent inside them (on a GPU enqueuing: near 100% the device waited for the host; on the emulated device "
        "the host does the work)\n";
  os << "  " << std::left << std::setw(16) << "slot" << std::setw(24) << "variant" << std::right << std::setw(10)
     << "dev ms" << std::setw(10) << "med ms" << std::setw(10) << "GB/s" << std::setw(11) << "copy GB/s"
     << std::setw(8) << "%copy" << "\n";
  for (const auto& s : b.stages) {
    if (!s.ran) continue;
    os << "  " << std::left << std::setw(16) << s.slot << std::setw(24) << s.variant << std::right;
    if (s.device_seconds_median == 0) {
      os << "  no device work timed (no kernel, GEMM, fill or copy)\n";
      continue;
    }
    os << std::setw(10) << fmt(s.device_seconds_min * 1e3, 4) << std::setw(10) << fmt(s.device_seconds_median * 1e3, 4)
       << std::setw(10) << fmt(s.device_gbps, 1) << std::setw(11) << fmt(s.device_copy_gbps, 1) << std::setw(8)
       << fmt(100 * s.ratio_to_device_copy, 1) << "\n";
    if (s.device_parts.size() > 1) {  // where the fastest call's device time went
      os << "  " << std::setw(40) << "" << "parts:";
      for (size_t i = 0; i < s.device_parts.size(); ++i) {
        const WindowPart& p = s.device_parts[i];
        os << (i ? ", " : " ") << p.name << " " << fmt(p.seconds * 1e3, 4) << " ms ("
           << (p.calls > 1 ? std::to_string(p.calls) + " calls, " + fmt(p.interval_seconds / double(p.calls) * 1e6, 1) +
                                 " us each, "
                           : "")
           << "host " << fmt(p.interval_seconds > 0 ? 100 * p.host_seconds / p.interval_seconds : 0, 0) << "%)";
      }
      os << "\n";
    }
  }
}

void print_bench(const CaseBench& b, std::ostream& os) {
  const Case& c = b.c;
  os << "\ncase " << c.name << ": " << c.summary() << "\n";
  os << "  verified: " << outcome_name(b.outcome) << " in " << fmt(b.verify_seconds, 3) << " s; "
     << memory_line(b.estimated_bytes, b.peak_rss_bytes) << "\n";
  os << "  " << std::left << std::setw(16) << "slot" << std::setw(24) << "variant" << std::right << std::setw(10)
     << "min ms" << std::setw(10) << "med ms" << std::setw(11) << "MB" << std::setw(9) << "GB/s" << std::setw(10)
     << "roof GB/s" << std::setw(8) << "%roof" << std::setw(10) << "ref ms" << std::setw(10) << "diff ms"
     << std::setw(11) << "check/fast" << "\n";
  for (const auto& s : b.stages) {
    os << "  " << std::left << std::setw(16) << s.slot << std::setw(24) << s.variant << std::right;
    if (!s.ran) {
      os << "  not timed: " << s.note << "\n";
      continue;
    }
    os << std::setw(10) << fmt(s.seconds_min * 1e3, 3) << std::setw(10) << fmt(s.seconds_median * 1e3, 3)
       << std::setw(11) << fmt(s.bytes / 1e6, 1) << std::setw(9) << fmt(s.gbps, 2) << std::setw(10)
       << fmt(s.roof_gbps, 2) << std::setw(8) << fmt(100 * s.ratio_to_roof, 1) << std::setw(10)
       << fmt(s.ref_seconds * 1e3, 1) << std::setw(10) << fmt(s.compare_seconds * 1e3, 1) << std::setw(11)
       << fmt(s.check_ratio, 2) << (s.spread > kNoisySpread ? "  noisy: repeats spread " + fmt(s.spread, 2) + "x" : "")
       << "\n";
  }
  const bool on_device = c.backend != Backend::host;
  if (on_device) print_device_table(b, os);
  for (const auto& s : b.stages)
    if (s.ran && s.flops > 0)
      os << "  GEMM " << s.slot << "/" << s.variant << ": " << fmt(s.flops / 1e9, 3) << " GFLOP, " << fmt(s.gflops, 2)
         << (on_device ? " GFLOP/s on the device" : " GFLOP/s") << "; Eigen fp32 GEMMs of the same shapes " << fmt(s.eigen_seconds * 1e3, 3) << " ms ("
         << fmt(s.eigen_seconds > 0 ? s.flops / s.eigen_seconds / 1e9 : 0, 2) << " GFLOP/s): ratio to Eigen "
         << fmt(s.eigen_ratio, 3) << "; check/fast " << fmt(s.check_ratio, 2)
         << (s.device_gemm_seconds > 0 ? "; one device GEMM of the same FLOPs " + fmt(s.device_gemm_seconds * 1e3, 3) +
                                             " ms (" + fmt(s.flops / s.device_gemm_seconds / 1e9, 1) +
                                             " GFLOP/s): share " + fmt(100 * s.device_gemm_ratio, 1) + "%"
                                       : std::string())
         << (s.gemm_path.empty() ? "" : "; grouped GEMMs: " + s.gemm_path) << "\n";
  for (const auto& s : b.stages)
    if (s.ran && is_all_to_all(s.slot))
      os << "  all-to-all " << s.slot << "/" << s.variant << ": algbw " << fmt(s.algbw_gbps, 2) << " GB/s, busbw "
         << fmt(s.busbw_gbps, 2) << " GB/s (nccl-tests: busbw = algbw x (R-1)/R"
         << (on_device ? "; device times" : "") << ")\n";
  os << "  bytes: ";
  std::map<std::string, std::vector<std::string>> by_formula;
  for (const auto& s : b.stages)
    if (s.ran) by_formula[s.bytes_formula].push_back(s.slot);
  bool first = true;
  for (auto& [f, slots] : by_formula) {
    slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
    os << (first ? "" : "; ") << f << " (";
    for (size_t i = 0; i < slots.size(); ++i) os << (i ? ", " : "") << slots[i];
    os << ")";
    first = false;
  }
  os << "\n";
  if (b.roof_ratio > 0)
    os << "  roof-ratio (dispatch + combine" << (on_device ? ", device times" : "") << "): 2 x "
       << (on_device ? "device-to-device copy" : "memcpy") << " of " << fmt(b.routed_bytes / 1e6, 1) << " MB routed rows "
       << fmt(b.routed_memcpy_seconds * 1e3, 3) << " ms / (dispatch " << fmt(b.dispatch_seconds * 1e3, 3)
       << " ms + combine " << fmt(b.combine_seconds * 1e3, 3) << " ms) = " << fmt(b.roof_ratio, 3) << "\n";
  print_peer(b, os);
  if (!b.sweep.empty()) {
    os << "  growth (verify time, peak memory):\n";
    for (const auto& p : b.sweep) {
      os << "    " << p.axis << " x " << std::left << std::setw(5) << fmt(p.scale, 2) << std::right << " T=" << p.tokens
         << " D=" << p.hidden << " R=" << p.ep << ": ";
      if (!p.ran) {
        os << "not run: " << p.note << "\n";
        continue;
      }
      os << fmt(p.verify_seconds, 3) << " s, " << memory_line(p.estimated_bytes, p.peak_rss_bytes)
         << (p.note.empty() ? "" : " (" + p.note + ")") << "\n";
    }
  }
}

/// The peer's figures beside the case's (BenchOptions::peer), for the JSON.
nlohmann::json peer_json(const CaseBench& b, const std::string& command) {
  using nlohmann::json;
  const Case& c = b.c;
  json jp = {{"command", command}, {"name", b.peer_name}, {"note", b.peer_note}};
  json ps = json::array();
  for (const auto& p : b.peer) {
    const StageBench* mine = peer_match(b, p.slot);
    const double t = mine ? (c.backend != Backend::host ? mine->device_seconds_min : mine->seconds_min) : 0;
    ps.push_back({{"slot", p.slot},
                  {"what", p.what},
                  {"peer_seconds", p.seconds},
                  {"variant", mine ? mine->variant : ""},
                  {"seconds", t},
                  {"ratio", t > 0 && p.seconds > 0 ? t / p.seconds : 0}});
  }
  jp["stages"] = ps;
  return jp;
}

/// Where a stage's device seconds went (Device::window_parts), for the JSON.
nlohmann::json parts_json(const std::vector<WindowPart>& parts) {
  nlohmann::json js = nlohmann::json::array();
  for (const WindowPart& p : parts)
    js.push_back({{"part", p.name},
                  {"seconds", p.seconds},
                  {"calls", p.calls},
                  {"interval_seconds", p.interval_seconds},
                  {"host_seconds", p.host_seconds}});
  return js;
}

std::string bench_json(const std::vector<CaseBench>& all, const BenchOptions& opt) {
  using nlohmann::json;
  json doc;
  doc["schema"] = "moeverify-bench/1";
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  doc["machine"] = {{"hostname", host},
                    {"cpu", cpu_model()},
                    {"logical_cpus", int(std::thread::hardware_concurrency())},
                    {"memory_bytes", double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE))},
                    {"threads", opt.threads},
                    {"omp_wait_policy", opt.omp_wait_policy},
                    {"compiler", __VERSION__},
                    {"moeverify", MOEVERIFY_VERSION}};
  doc["repeat"] = opt.repeat;
  doc["warmup"] = opt.warmup;
  json cases = json::array();
  for (const auto& b : all) {
    const Case& c = b.c;
    json jc;
    jc["name"] = c.name;
    jc["source"] = c.source;
    jc["config"] = {{"summary", c.summary()}, {"tokens", c.tokens}, {"hidden", c.hidden}, {"ffn", c.ffn},
                    {"experts", c.num_experts}, {"top_k", c.top_k}, {"ep", c.ep}, {"dtype", dtype_name(c.dtype)}};
    jc["backend"] = enum_name(backend_table(), c.backend);
    jc["outcome"] = outcome_name(b.outcome);
    jc["verify_seconds"] = b.verify_seconds;
    jc["peak_rss_bytes"] = b.peak_rss_bytes;
    jc["estimated_bytes"] = b.estimated_bytes;
    json stages = json::array();
    for (const auto& s : b.stages) {
      json js = {{"slot", s.slot}, {"variant", s.variant}, {"backend", s.backend}, {"timed", s.ran}};
      if (!s.ran) {
        js["note"] = s.note;
      } else {
        js.update({{"seconds_min", s.seconds_min},
                   {"seconds_median", s.seconds_median},
                   {"spread", s.spread},
                   {"noisy", s.spread > kNoisySpread},
                   {"bytes", s.bytes},
                   {"bytes_formula", s.bytes_formula},
                   {"gbps", s.gbps},
                   {"roof_seconds", s.roof_seconds},
                   {"roof_gbps", s.roof_gbps},
                   {"ratio_to_roof", s.ratio_to_roof},
                   {"ref_seconds", s.ref_seconds},
                   {"compare_seconds", s.compare_seconds},
                   {"check_ratio", s.check_ratio}});
        if (s.flops > 0)
          js.update({{"gemm_flops", s.flops},
                     {"gflops", s.gflops},
                     {"eigen_seconds", s.eigen_seconds},
                     {"eigen_ratio", s.eigen_ratio}});
        if (s.flops > 0 && c.backend != Backend::host)  // a device's own GEMM, and the way its groups ran
          js.update({{"device_gemm_seconds", s.device_gemm_seconds},
                     {"device_gemm_ratio", s.device_gemm_ratio},
                     {"gemm_path", s.gemm_path}});
        if (is_all_to_all(s.slot)) js.update({{"algbw_gbps", s.algbw_gbps}, {"busbw_gbps", s.busbw_gbps}});
        if (c.backend != Backend::host) {
          js["device_parts"] = parts_json(s.device_parts);
          js.update({{"device_seconds_min", s.device_seconds_min},
                     {"device_summed_seconds_min", s.device_summed_seconds_min},
                     {"device_seconds_median", s.device_seconds_median},
                     {"device_gbps", s.device_gbps},
                     {"device_copy_seconds", s.device_copy_seconds},
                     {"device_copy_gbps", s.device_copy_gbps},
                     {"ratio_to_device_copy", s.ratio_to_device_copy}});
        }
      }
      stages.push_back(js);
    }
    jc["stages"] = stages;
    if (b.roof_ratio > 0)
      jc["dispatch_combine"] = {{"routed_bytes", b.routed_bytes},
                                {"memcpy_seconds", b.routed_memcpy_seconds},
                                {"dispatch_seconds", b.dispatch_seconds},
                                {"combine_seconds", b.combine_seconds},
                                {"roof", c.backend == Backend::host ? "memcpy" : "device copy"},
                                {"roof_ratio", b.roof_ratio}};
    json sw = json::array();
    for (const auto& p : b.sweep) {
      json jp = {{"axis", p.axis}, {"scale", p.scale}, {"tokens", p.tokens}, {"hidden", p.hidden},
                 {"ep", p.ep},     {"ran", p.ran}};
      if (p.ran)
        jp.update({{"verify_seconds", p.verify_seconds},
                   {"peak_rss_bytes", p.peak_rss_bytes},
                   {"estimated_bytes", p.estimated_bytes}});
      if (!p.note.empty()) jp["note"] = p.note;
      sw.push_back(jp);
    }
    jc["sweep"] = sw;
    if (!opt.peer.empty()) jc["peer"] = peer_json(b, opt.peer);
    cases.push_back(jc);
  }
  doc["cases"] = cases;
  return doc.dump(2) + "\n";
}

namespace {

/// Lines of at most `width` characters, broken at spaces.
std::vector<std::string> wrap_words(const std::string& text, size_t width) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string word, line;
  while (in >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

/// A stage's share of its roof: the memcpy on the host, the device copy by
/// device times on a device backend.
double roof_share(const CaseBench& b, const StageBench& s) {
  return b.c.backend == Backend::host ? s.ratio_to_roof : s.ratio_to_device_copy;
}

/// One case's bars: each timed stage's share of its roof (roof_share) on a log
/// scale (shares span several decades: a GEMM stage at 300%, a small copy at
/// 0.1%), decade ticks and the 100% line marked.
void svg_case_bars(const CaseBench& b, int& y, std::ostream& body) {
  const int bar_h = 16, label_w = 330, chart_w = 440;
  for (const std::string& line : wrap_words(b.c.name + ": " + b.c.summary(), 130)) {
    y += 16;
    body << "<text x=\"10\" y=\"" << y << "\" font-size=\"12\" font-weight=\"bold\">" << xml_escape(line)
         << "</text>\n";
  }
  y += 8;
  double lo = 1.0, hi = 1.0;
  for (const auto& s : b.stages)
    if (s.ran && roof_share(b, s) > 0) lo = std::min(lo, roof_share(b, s)), hi = std::max(hi, roof_share(b, s));
  const double l0 = std::floor(std::log10(std::max(lo, 1e-6))), l1 = std::max(0.0, std::ceil(std::log10(hi) - 1e-9));
  auto xs = [&](double r) {
    const double l = std::log10(std::max(r, 1e-6));
    return label_w + chart_w * std::clamp((l - l0) / std::max(l1 - l0, 1.0), 0.0, 1.0);
  };
  const int y0 = y;
  for (const auto& s : b.stages) {
    if (!s.ran) continue;
    const double share = roof_share(b, s), gbps = b.c.backend == Backend::host ? s.gbps : s.device_gbps;
    const double w = xs(share) - label_w;
    body << "<text x=\"" << label_w - 6 << "\" y=\"" << y + bar_h - 4 << "\" font-size=\"11\" text-anchor=\"end\">"
         << xml_escape(s.slot + "/" + s.variant) << "</text>\n";
    body << "<rect x=\"" << label_w << "\" y=\"" << y + 2 << "\" width=\"" << fmt(std::max(w, 1.0), 1) << "\" height=\""
         << bar_h - 4 << "\" fill=\"" << (share >= 0.7 ? "#2a9d8f" : "#e76f51") << "\"/>\n";
    body << "<text x=\"" << label_w + int(w) + 4 << "\" y=\"" << y + bar_h - 4 << "\" font-size=\"10\">"
         << fmt(100 * share, 1) << "% (" << fmt(gbps, 2) << " GB/s)</text>\n";
    y += bar_h;
  }
  for (double l = l0; l <= l1; l += 1) {  // decade ticks: 0.1%, 1%, 10%, 100%, ...
    const double x = xs(std::pow(10.0, l));
    const bool roof = l == 0;
    body << "<line x1=\"" << fmt(x, 1) << "\" y1=\"" << y0 << "\" x2=\"" << fmt(x, 1) << "\" y2=\"" << y << "\" stroke=\""
         << (roof ? "#264653" : "#ccc") << "\"" << (roof ? " stroke-dasharray=\"4 3\"" : "") << "/>\n";
    body << "<text x=\"" << fmt(x, 1) << "\" y=\"" << y + 12 << "\" font-size=\"10\" text-anchor=\"middle\">"
         << fmt(100 * std::pow(10.0, l), l >= -2 ? 0 : int(-2 - l)) << "%" << (roof ? (b.c.backend == Backend::host ? " of memcpy" : " of device copy") : "") << "</text>\n";
  }
  y += 20;
  if (b.roof_ratio > 0) {
    body << "<text x=\"10\" y=\"" << y << "\" font-size=\"11\">roof-ratio of dispatch + combine: " << fmt(b.roof_ratio, 3)
         << " (bars on a log scale)</text>\n";
    y += 16;
  }
}

/// With a sweep, one panel per axis (T, D, R): verify time and peak memory
/// against the scale, each normalised to its largest value.
void svg_sweep_panels(const CaseBench& b, int& y, std::ostream& body) {
  y += 10;
  body << "<text x=\"10\" y=\"" << y << "\" font-size=\"12\">growth with T, D, R (blue: verify time, orange: peak "
          "memory; each scaled to its largest value)</text>\n";
  y += 10;
  const int pw = 260, ph = 120;
  int px = 40;
  for (const char* axis : {"T", "D", "R"}) {
    std::vector<const SweepPoint*> pts;
    double tmax = 0, mmax = 0;
    for (const auto& p : b.sweep)
      if (p.axis == axis && p.ran) {
        pts.push_back(&p);
        tmax = std::max(tmax, p.verify_seconds);
        mmax = std::max(mmax, double(p.peak_rss_bytes));
      }
    body << "<rect x=\"" << px << "\" y=\"" << y << "\" width=\"" << pw << "\" height=\"" << ph
         << "\" fill=\"none\" stroke=\"#999\"/>\n";
    body << "<text x=\"" << px + pw / 2 << "\" y=\"" << y + ph + 28 << "\" font-size=\"11\" text-anchor=\"middle\">"
         << axis << " (scale of the case's value)</text>\n";
    auto sx = [&](double scale) { return px + 10 + (pw - 20) * scale; };
    for (const char* series : {"t", "m"}) {
      std::ostringstream poly;
      for (const auto* p : pts) {
        const double v = series[0] == 't' ? (tmax > 0 ? p->verify_seconds / tmax : 0)
                                          : (mmax > 0 ? double(p->peak_rss_bytes) / mmax : 0);
        const double yy = y + ph - 10 - (ph - 20) * v;
        poly << fmt(sx(p->scale), 1) << "," << fmt(yy, 1) << " ";
        body << "<circle cx=\"" << fmt(sx(p->scale), 1) << "\" cy=\"" << fmt(yy, 1) << "\" r=\"3\" fill=\""
             << (series[0] == 't' ? "#1d3557" : "#f4a261") << "\"/>\n";
      }
      if (!pts.empty())
        body << "<polyline points=\"" << poly.str() << "\" fill=\"none\" stroke=\""
             << (series[0] == 't' ? "#1d3557" : "#f4a261") << "\" stroke-width=\"2\"/>\n";
    }
    for (const auto* p : pts)
      body << "<text x=\"" << fmt(sx(p->scale), 1) << "\" y=\"" << y + ph + 14 << "\" font-size=\"9\" "
           << "text-anchor=\"middle\">" << fmt(p->verify_seconds, 2) << "s " << fmt(double(p->peak_rss_bytes) / (1 << 20), 0)
           << "M</text>\n";
    px += pw + 30;
  }
  y += ph + 40;
}

}  // namespace

std::string bench_svg(const std::vector<CaseBench>& all) {
  // Layout: per case, its bars (svg_case_bars), then, with a sweep, the
  // growth panels (svg_sweep_panels); the page is as tall as its content.
  const int width = 960;
  std::ostringstream body;
  int y = 30;
  body << "<text x=\"10\" y=\"20\" font-size=\"16\" font-weight=\"bold\">moeverify bench: share of the roof "
          "(host: a memcpy; device: a device-to-device copy)"
          "</text>\n";
  for (const auto& b : all) {
    svg_case_bars(b, y, body);
    if (!b.sweep.empty()) svg_sweep_panels(b, y, body);
  }
  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << y + 20
      << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << body.str() << "</svg>\n";
  return svg.str();
}

double spread_of(const std::vector<double>& times) {
  if (times.empty()) return 0;
  const auto [lo, hi] = std::minmax_element(times.begin(), times.end());
  return *lo > 0 ? *hi / *lo : 0;
}

}  // namespace moev
