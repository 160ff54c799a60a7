// `moeverify bench`: times every stage variant of a case on its backend
// against a memcpy of the same bytes measured in the same run (on a device
// also by the device's clock against a device-to-device copy of them),
// beside the cost of verifying it (reference, comparison). The bytes formula
// of each stage and the JSON schema are documented in README.md,
// "Benchmarks"; bytes_formula() below is the one place they are computed.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "case.h"
#include "device.h"
#include "diff.h"

namespace moev {

struct BenchOptions {
  int threads = 1;
  int repeat = 5;   // timed calls of each fast function
  int warmup = 1;   // untimed calls before them
  /// Also run the case at 1/4, 1/2 and 1 of its T, D and R (one axis at a
  /// time) and record verify time and peak memory (the growth plot).
  bool sweep = false;
  std::vector<std::string> sets;  // --set overrides, re-applied by the sweep
  std::string file;               // the case's file, re-loaded by the sweep
  /// The peer command (`--peer`): run after a case's stages with `{spec}`
  /// replaced by a JSON file of the case's shape (appended when absent);
  /// its stdout is one JSON object of its stage seconds
  /// (python/moeverify/peer.py is PyTorch's). Empty: no peer.
  std::string peer;
  double peer_timeout_s = 600;
  std::string omp_wait_policy;  // as in effect (the JSON's machine.omp_wait_policy)
};

/// Repeats whose slowest is more than this times the fastest: the machine
/// was busy, and the table marks the row noisy.
constexpr double kNoisySpread = 1.5;
/// The slowest of `times` over the fastest (0 when empty or the fastest is 0).
double spread_of(const std::vector<double>& times);

/// One stage variant's timings. Seconds are wall time of the fast function on
/// all ranks together (ranks as threads, as the runner runs them); on a
/// device backend that includes writing its outputs back to the host (the
/// mirror's write-through), and the device_* figures are the device's own.
struct StageBench {
  std::string slot, variant, backend = "host";
  bool ran = false;
  std::string note;  // why it was not timed, when ran is false
  double seconds_min = 0, seconds_median = 0;
  double spread = 0;          // slowest / fastest repeat; past kNoisySpread the figures are marked noisy
  double bytes = 0;           // traffic by bytes_formula, summed over ranks
  std::string bytes_formula;  // the formula's name, for the table and JSON
  double gbps = 0;            // bytes / seconds_min / 1e9
  double roof_seconds = 0;    // a memcpy moving the same traffic (bytes / 2 copied), min over repeats
  double roof_gbps = 0, ratio_to_roof = 0;  // ratio = roof_seconds / seconds_min
  /// All-to-all stages: nccl-tests algbw = average bytes sent per rank /
  /// seconds (device_seconds_min on a device), busbw = algbw * (R - 1) / R;
  /// 0 elsewhere.
  double algbw_gbps = 0, busbw_gbps = 0;
  /// Device backends (0 on the host): seconds by the device's clock (the
  /// union of its kernels', GEMMs' and the all-to-all's device copies'
  /// intervals across ranks; CUDA events on a GPU), min and median over the
  /// timed calls; the roof,
  /// a device-to-device copy of bytes / 2 timed the same way in the same run;
  /// ratio_to_device_copy = device_copy_seconds / device_seconds_min.
  double device_seconds_min = 0, device_seconds_median = 0, device_gbps = 0;
  /// The fast call's device intervals summed over the ranks' streams, not
  /// their union (overlapping in-process ranks count once each).
  double device_summed_seconds_min = 0;
  /// Where the fastest call's device seconds went (Device::window_parts):
  /// each kind of device work (a kernel body by class name, sort, histogram,
  /// gemm, gemm_group, copy), the union of its intervals and their count,
  /// longest first.
  std::vector<WindowPart> device_parts;
  double device_copy_seconds = 0, device_copy_gbps = 0, ratio_to_device_copy = 0;
  /// The verification's own cost in the run that built the board.
  double ref_seconds = 0, compare_seconds = 0;
  /// (slot reference seconds + compare_seconds) / seconds_min: what checking
  /// this variant alone costs per fast call. A slot's reference is computed
  /// once, with the first variant that runs (ref_seconds is 0 for the
  /// others), but each variant's ratio counts it, as if it ran alone.
  double check_ratio = 0;
  /// GEMM stages (gemm_shapes in bench.cpp): the FLOPs of the GEMMs the
  /// contract names (2 M K N each, summed over ranks), GFLOP/s at
  /// seconds_min (device_seconds_min on a device), and an Eigen fp32 GEMM of
  /// the same shapes on the host's threads timed in the same run:
  /// eigen_ratio = eigen_seconds / that time (above 1: faster than Eigen).
  /// 0 for other stages.
  double flops = 0, gflops = 0, eigen_seconds = 0, eigen_ratio = 0;
  /// On a device: one GEMM of the same FLOPs there (device_gemm_seconds in
  /// bench.cpp), and device_gemm_ratio = that / device_seconds_min (1: the
  /// stage's GEMMs as fast as one big GEMM; issue 36 asks 0.6).
  double device_gemm_seconds = 0, device_gemm_ratio = 0;
  /// On a device, where the stage ran grouped GEMMs (Device::gemm_group):
  /// how they ran there (a grouped cuBLAS call, or single GEMMs); else empty.
  std::string gemm_path;
};

/// A point of the growth sweep: the case with one of T, D, R scaled.
struct SweepPoint {
  std::string axis;  // "T", "D" or "R"
  double scale = 1;
  int64_t tokens = 0, hidden = 0;
  int ep = 1;
  bool ran = false;
  std::string note;  // why the point did not run
  double verify_seconds = 0;
  double estimated_bytes = 0;
  uint64_t peak_rss_bytes = 0;
};

struct CaseBench {
  Case c;
  Outcome outcome = Outcome::PASSED;  // of the verifying run
  double verify_seconds = 0;
  uint64_t peak_rss_bytes = 0;
  double estimated_bytes = 0;
  std::vector<StageBench> stages;
  /// The issue-7 roof-ratio of local dispatch + combine (primary variants):
  /// 2 x time(memcpy of the routed rows) / time(dispatch + combine). On a
  /// device: device seconds, and a device-to-device copy for the memcpy.
  /// 0 when the case has no such pair.
  double routed_bytes = 0, routed_memcpy_seconds = 0, dispatch_seconds = 0, combine_seconds = 0, roof_ratio = 0;
  std::vector<SweepPoint> sweep;
  /// The peer's figures (BenchOptions::peer): what it did for each slot and
  /// its best seconds, beside this case's primary variant of that slot.
  struct PeerStage {
    std::string slot, what;
    double seconds = 0;
  };
  std::vector<PeerStage> peer;
  std::string peer_name;  // e.g. "torch 2.11.0+cu130 on NVIDIA H100 80GB HBM3"
  std::string peer_note;  // why the peer gave no figures
};

/// Runs the case once (verifying it), then times each stage variant that
/// ran. Progress lines go to `log`.
CaseBench bench_case(const Case& c, const BenchOptions& opt, std::ostream& log);

void print_bench(const CaseBench& b, std::ostream& os);
/// The "moeverify-bench/1" document (README.md, "Benchmarks").
std::string bench_json(const std::vector<CaseBench>& all, const BenchOptions& opt);
/// A self-contained SVG: each stage's share of the roof, and the sweep.
std::string bench_svg(const std::vector<CaseBench>& all);

}  // namespace moev
