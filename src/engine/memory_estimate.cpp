// The peak-memory estimate and its limit. The runner streams (docs/architecture.md,
// "Scale and backends"): a slot holds its inputs, each variant's outputs and
// the reference's, and tensors leave the boards after the last slot that
// reads them; the reference chain shares every tensor equal to the fast one.
// The estimate must never be below what a case really uses; `moeverify run`
// prints it beside the measured peak of every case so that this stays checked.
#include "memory_estimate.h"

#include <malloc.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "datagen.h"
#include "error.h"
#include "tensor.h"

namespace moev {
namespace {

// Live copies of each kind of tensor at the peak, counted from the runner and
// the stages, then fitted to the measured peak RSS of cases that each stress
// one term (and kept 1.2x to 2x above it: see tests/cli_contract.sh, which
// runs a mid-size case and compares). "Act" copies are in the case's dtype,
// "float" copies are the reference's fp32 views of the same elements.
//  - token rows (x, shared_out, out): fast board, a slot's variants and its
//    reference in act; the end-to-end error scale and the reference
//    combine's accumulators in fp32.
constexpr double kTokenAct = 4, kTokenFloat = 2;
//  - routed rows (routed_input, recv, permuted, unpadded, recv_out,
//    routed_output), per row routed, in act: at a slot the input, the
//    primary's output and the reference's (with R > 1, Stage::ref_per_rank:
//    the rows of as many ranks at a time as there are threads), plus one per extra variant that will run
//    (equal-count permute under force-LB routing, equal-split or force-LB all-to-all) and the
//    chain's own copy where it differs from the fast rows (SwiGLU); and half
//    a copy of allocator slack.
constexpr double kRoutedAct = 2.5;
//  - the reference's fp32 views of one rank's routed rows at a time (the
//    end-to-end error scale), per row of the largest rank.
constexpr double kRoutedFloatPerRank = 2;
//  - padded rows (expert_input, expert_output) incl. worst-case alignment
//    padding, E * A rows in all: the same copies as the routed rows (never
//    both at once), and the SwiGLU reference's fp32 copy of its input.
constexpr double kPaddedFloat = 1;
//  - SwiGLU intermediates per padded row and ffn column: h13 (2F) and H (F)
//    in the fast path, fp32 in the reference.
constexpr double kSwigluAct = 3, kSwigluFloat = 3;
//  - (T, E) router tensors: logits, scores, the selection copy on both boards
//    and in the reference; measured about 7 fp32 copies.
constexpr double kTokenExpert = 5;
//  - (T, K) index tensors (ids, topk_scores, row_of, token_sorted,
//    score_sorted) on both boards, and the reference's int64 copies.
constexpr double kTokenKBytes = 120;
//  - weights: generated once and shared by every rank's board, the chain's
//    and the EP = 1 reruns' (make_global_inputs): one act copy (none of the
//    routed experts' when streamed: chunks, below). The
//    reference decodes one expert at a time (ref::WeightView) into fp64
//    values and fp32 absolute values, one expert per thread at work
//    (kExpertBytesPerElem per element of an expert's three matrices); the
//    batched variant caches one rank's experts in fp32 per rank at work.
constexpr double kExpertBytesPerElem = 8 + 4;
// The process itself: binary, libraries, allocator slack (7.6 MiB measured
// for `moeverify validate`, 8.7 MiB for the smallest run). The resident
// binary grows as a file's cases touch more of its code: the smallest
// capacity-with-SP cases, run after the rest of capacity.yaml, peak at
// 12.7 MiB.
constexpr double kBaseBytes = 13.0 * (1 << 20);
// Per thread (rank threads and executor threads): stack pages touched and
// thread-local GEMM buffers (see the per-thread term below).
constexpr double kThreadBytes = 64.0 * 1024;

/// The estimate of one pipeline over ranks holding `tokens` in all, at most
/// `tokens_max` on one rank, with `ranks` ranks; `checked`: with its
/// references (the invariance reruns are the fast pipeline alone).
double pipeline_bytes(const Case& c, double tokens, double tokens_max, double ranks, int threads, bool checked) {
  const double s = double(elem_bytes(act_elem(c.dtype)));
  const double D = double(c.hidden), F = double(c.ffn), E = double(c.num_experts), K = double(c.top_k);
  const double A = double(c.align);
  const bool swiglu = c.experts.kind == ExpertKind::swiglu;
  const bool shared_swiglu = c.shared.kind == SharedKind::swiglu;
  // Worst-case alignment padding: every group rounded up to A, and with
  // empty_groups: pad an empty group holding A rows: E * A rows over all ranks.
  const double pad_rows = A > 1 ? E * A : 0;
  // pad_to_capacity (docs/contract.md §11) gives every expert cap rows: up to
  // factor * T * K (+ E rounding, per SP rank with sp > 1) rows per rank.
  const bool cap_pad = c.capacity.factor > 0 && c.capacity.pad_to_capacity == Switch::on;
  const double routed = tokens * K * (cap_pad ? std::max(1.0, c.capacity.factor) : 1.0) +
                        (cap_pad ? E * ranks * double(std::max(1, c.sp)) : 0);
  const double padded = routed + pad_rows;
  // Equal-split all-to-all: every (source, destination) chunk padded to the
  // largest split, at most T_max * min(K, E_l) rows (a token sends one row
  // per chosen expert of the destination): R * R * T_max * min(K, E_l) rows.
  const bool equal = ranks > 1 && (c.equal_split.policy != EqualSplitPolicy::off ||
                                   c.router.force_load_balance == Switch::on);
  const double equal_rows = equal ? ranks * ranks * tokens_max * std::min(K, std::max(1.0, E / ranks)) : 0;
  const double tail = c.combine.buffer == OutBuffer::alias_x_offset ? double(c.combine.alias_offset) : 0;

  double b = 0;
  b += tokens * D * (kTokenAct * s + kTokenFloat * 4) + ranks * tail * (4 * s + 4);
  // The equal-count permute runs only where every (source, expert) segment
  // holds the same count (docs/contract.md §7), which force-load-balance
  // routing guarantees and top-k routing of real data does not: elsewhere it
  // is reported not taken before it allocates anything.
  const bool extra_permute =
      ranks > 1 && c.permute != PermuteMode::generic && c.router.force_load_balance == Switch::on;
  const bool extra_a2a = ranks > 1 && (c.equal_split.policy != EqualSplitPolicy::off ||
                                       c.router.force_load_balance == Switch::on);
  const double side = std::min(std::max(1.0, double(threads)), ranks);  // ranks' references at a time
  const double routed_copies =
      kRoutedAct + side / ranks + (extra_permute ? 1 : 0) + (extra_a2a ? 1 : 0) + (swiglu ? 1 : 0);
  // One slot at a time holds these rows: the padded count bounds the routed
  // one. The end-to-end error scale's fp32 views are made once, right after
  // the chain's dispatch slot has been let go (Pipeline::advance_chain), when
  // one copy of the routed rows is left: the larger of the two moments.
  const double slot_rows = padded * D * (routed_copies * s + (swiglu ? kPaddedFloat * 4 : 0));
  // With SwiGLU experts every rank's row scales (fp32) are made at once,
  // expert by expert across the ranks, from chunks of at most 256 MiB of
  // gathered fp32 rows and their scales (combined_magnitudes).
  const double gathered = std::min(2.0 * 256 * (1 << 20), 2 * routed * D * 4);
  const double magnitude_rows = routed * D * s + (swiglu ? routed * D * 4 + gathered : 0) +
                                tokens_max * K * D * kRoutedFloatPerRank * 4;
  double rows = slot_rows;
  if (swiglu) rows += padded * F * (kSwigluAct * s + kSwigluFloat * 4);
  // The SwiGLU checks' error scales (RefCtx::scales), held for the slot:
  // Y's and h13's, fp32, per padded row.
  if (swiglu) rows += padded * (D + 2 * F) * 4;
  // The end-to-end scale is made at the dispatch slot, before the experts
  // run: their intermediates and scales are not alive then.
  rows = std::max(rows, magnitude_rows);
  b += std::max(rows, tokens * E * 4 * kTokenExpert);
  if (shared_swiglu) b += tokens * F * (kSwigluAct * s + kSwigluFloat * 4);
  b += equal_rows * D * (3 * s + 4);
  // Backward (docs/contract.md §13, src/paths/stages_backward.cpp): grad_out, grad_x_shared
  // and grad_x in act on both boards and grad_x's fp32 error scale, per token;
  // the score gradient and its half-width (fp32, per assignment); and one more
  // routed copy: combine_bwd reads routed_output beside the gradient rows.
  if (c.backward == Switch::on) {
    b += tokens * D * (4 * s + 2 * 4) + routed * 4 * 4;
    b += padded * D * s;
    // SwiGLU weight gradients, fp32 (E, F, D) x 3 over the ranks: the fast
    // path's and, when checked, the reference's and their error scales.
    const double wgrad_copies = checked ? 3 : 1;
    if (swiglu) b += wgrad_copies * (E * 3 * F * D * 4);
    if (shared_swiglu) b += wgrad_copies * ranks * (3 * F * D * 4);
    // The router backward's reference (reference/router_bwd.cpp), a rank at a time: six fp64 (T, D)
    // matrices and fp32 views, (E, D) likewise (measured: 61 bytes per (T, D) element at T 4096, D 4096).
    if (checked) b += side * (tokens_max * D * 56 + E * D * 56 + tokens_max * E * 40);
  }
  b += routed * kTokenKBytes;
  // Weights (elements of one copy): gate, routed experts, shared expert.
  b += E * D * 4;  // the gate's fp32 view in the router reference (its act copy: global_bytes)
  const double expert = swiglu || shared_swiglu ? 3 * F * D : 0;
  b += std::max(1.0, double(threads)) * expert * kExpertBytesPerElem;
  // (The invariance reruns run the primary variant alone: the cache only
  // when batched is the primary.)
  if (swiglu && !c.streams_weights() && (checked || c.experts.impl == ExpertsImpl::batched))
    b += side * (E / ranks) * expert * 4;
  // Streamed routed weights (experts.weights): each rank at work holds one
  // generated chunk in act, and the batched variant its fp32 cache of it;
  // the chunk is largest where a stage streams all E experts.
  if (swiglu && c.streams_weights()) b += (side + 1) * double(streamed_chunk_experts(c, c.num_experts)) * expert * (s + 4);
  // Per thread: the GEMM's thread-local fp32 copies of one weight matrix (at
  // most 2F x D or E x D), a 64-row tile of X and of the product.
  // Stacks: rank threads and executor threads. GEMM buffers: the threads
  // that run GEMMs at once, the ranks' executors (threads / ranks each, at
  // least one) or the run's threads, whichever is more.
  const double nthreads = ranks + double(threads);
  const double gemm_threads = std::max(ranks, double(threads));
  const double Fg = swiglu || shared_swiglu ? F : 0;  // F is no GEMM's dimension without SwiGLU
  const double per_thread = 4 * (std::max(2 * Fg * D, E * D) + 64 * (D + Fg) + 64 * std::max(2 * Fg, E));
  b += nthreads * kThreadBytes + gemm_threads * per_thread;
  return b;
}

}  // namespace

/// The global inputs (make_global_inputs), held once by the whole run:
/// gate, routed experts, shared expert in act.
double global_bytes(const Case& c) {
  const double D = double(c.hidden), F = double(c.ffn), E = double(c.num_experts);
  const double w = E * D + (c.experts.kind == ExpertKind::swiglu && !c.streams_weights() ? 3 * E * F * D : 0) +
                   (c.shared.kind == SharedKind::swiglu ? 3 * F * D : 0);
  return w * double(elem_bytes(act_elem(c.dtype)));
}

double estimate_case_bytes(const Case& c, int threads) {
  double total = 0, most = 0;
  // Sequence parallel (docs/contract.md §10): tail padding adds up to sp - 1 rows per
  // EP rank; the SP layout, the global nlt*S rows and the kept rows are about
  // three more (T, D) buffers.
  const double sp_pad = c.sp > 1 && c.sp_padding == SpPadding::tail ? double(c.sp - 1) : 0;
  for (int r = 0; r < c.ep; ++r) {
    total += double(c.tokens_on(r)) + sp_pad;
    most = std::max(most, double(c.tokens_on(r)) + sp_pad);
  }
  const double sp_rows = c.sp > 1 ? 3 * total * double(c.hidden) * 4 : 0;
  const double main_run = kBaseBytes + global_bytes(c) + pipeline_bytes(c, total, most, double(c.ep), threads, true) + sp_rows;
  // After the pipeline only its results stay (out in act, its fp32 error
  // scale, sp_out) while the invariance reruns run: EP = 1 reruns of each
  // rank's tokens (as many side by side as there are threads), then an
  // sp = 1 rerun of the whole case.
  // With backward on, grad_x (act) and its fp32 error scale stay too.
  const double bwd_results = c.backward == Switch::on ? double(elem_bytes(act_elem(c.dtype))) + 4 : 0;
  const double results =
      kBaseBytes + global_bytes(c) + sp_rows + total * double(c.hidden) * (2 * double(elem_bytes(act_elem(c.dtype))) + 4 + bwd_results);
  double b = main_run;
  if (c.ep > 1) {
    const int side = std::min(std::max(1, threads), c.ep);
    b = std::max(b, results + side * pipeline_bytes(c, most, most, 1, std::max(1, threads / side), false));
  }
  if (c.sp > 1) b = std::max(b, results + pipeline_bytes(c, total, most, double(c.ep), threads, false));
  return b;
}

namespace {

/// The first line of `path` as a byte count; 0 when absent, "max" or not a
/// number.
uint64_t read_limit_file(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s) || s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) return 0;
  return uint64_t(std::strtoull(s.c_str(), nullptr, 10));
}

/// This process's cgroup memory limit, 0 when none. v2: memory.max of the
/// cgroup named in /proc/self/cgroup ("0::/path"), else of the mount's root
/// (a container's namespace shows its own cgroup there); v1: the memory
/// controller's memory.limit_in_bytes, where "unlimited" reads as a value
/// near 2^63.
uint64_t cgroup_limit() {
  std::ifstream f("/proc/self/cgroup");
  std::string line, v2, v1;
  while (std::getline(f, line)) {
    if (line.rfind("0::", 0) == 0) v2 = line.substr(3);
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a != std::string::npos && b != std::string::npos) {
      const std::string ctl = line.substr(a + 1, b - a - 1);
      if (ctl == "memory" || ctl.find("memory,") == 0 || ctl.find(",memory") != std::string::npos)
        v1 = line.substr(b + 1);
    }
  }
  uint64_t lim = 0;
  if (!v2.empty() && (lim = read_limit_file("/sys/fs/cgroup" + v2 + "/memory.max")) > 0) return lim;
  if ((lim = read_limit_file("/sys/fs/cgroup/memory.max")) > 0) return lim;
  for (const std::string& p : {"/sys/fs/cgroup/memory" + v1 + "/memory.limit_in_bytes",
                               std::string("/sys/fs/cgroup/memory/memory.limit_in_bytes")})
    if ((lim = read_limit_file(p)) > 0 && lim < (uint64_t(1) << 62)) return lim;
  return 0;
}

}  // namespace

MemorySources memory_sources() {
  MemorySources s;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  s.physical = pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : uint64_t(10) << 30;  // unknown: 10 GiB
  s.cgroup = cgroup_limit();
  rlimit r{};
  if (getrlimit(RLIMIT_AS, &r) == 0 && r.rlim_cur != RLIM_INFINITY) s.address_space = uint64_t(r.rlim_cur);
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* e = std::getenv(v);
    if (e && std::atoi(e) > 0) {
      s.local_ranks = std::atoi(e);
      break;
    }
  }
  return s;
}

uint64_t memory_limit_from(const MemorySources& s, std::string* origin) {
  const bool by_cgroup = s.cgroup > 0 && s.cgroup < s.physical;
  const uint64_t node = by_cgroup ? s.cgroup : s.physical;
  const int ranks = std::max(1, s.local_ranks);
  const double shared = 0.8 * double(node) / ranks, own = 0.8 * double(s.address_space);
  const bool by_rlimit = s.address_space > 0 && own < shared;
  if (origin) {
    if (by_rlimit) {
      *origin = "the default: 80% of the address-space limit (ulimit -v) " + format_bytes(double(s.address_space));
    } else {
      *origin = std::string("the default: 80% of ") + (by_cgroup ? "the cgroup limit " : "physical memory ") +
                format_bytes(double(node));
      if (ranks > 1) *origin += ", shared by " + std::to_string(ranks) + " ranks on this node";
    }
  }
  return uint64_t(by_rlimit ? own : shared);
}

uint64_t default_memory_limit() { return memory_limit_from(memory_sources()); }

std::string default_memory_limit_origin() {
  std::string origin;
  memory_limit_from(memory_sources(), &origin);
  return origin;
}

namespace {
std::optional<MemoryLimit> g_command_limit;
}

void set_command_memory_limit(const MemoryLimit& limit) { g_command_limit = limit; }

MemoryLimit command_memory_limit() {
  if (g_command_limit) return *g_command_limit;
  return {default_memory_limit(), default_memory_limit_origin()};
}

uint64_t parse_memory_size(const std::string& text, const std::string& flag) {
  const std::string valid = "valid: a size such as 512M, 8G or 1.5GiB (units B, K, M, G, T; powers of 1024)";
  auto fail = [&](const std::string& what) { bad_input(flag + ": " + what + "; " + valid); };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  std::string unit = text.substr(i);
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".")
    fail("expected a size, got '" + printable(text) + "'");
  for (char& ch : unit) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  if (!unit.empty() && unit[0] == 'E' && unit.size() > 1 && std::isdigit(static_cast<unsigned char>(unit[1])))
    fail("'" + printable(text) + "' has an exponent; write the size in digits and a unit");
  double scale = 0;
  const char* units = "BKMGT";
  for (int p = 0; p < 5; ++p) {
    const std::string u(1, units[p]);
    if (unit == u || (p > 0 && (unit == u + "B" || unit == u + "IB")) || (p == 0 && unit.empty()))
      scale = std::ldexp(1.0, 10 * p);
  }
  if (scale == 0) fail("unknown unit '" + printable(unit) + "' in '" + printable(text) + "'");
  const double v = std::strtod(number.c_str(), nullptr) * scale;
  if (!(v >= 1)) fail("the size '" + printable(text) + "' is below one byte");
  if (v > 1e18) fail("the size '" + printable(text) + "' is beyond any machine");
  return uint64_t(v);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (u < 6 && bytes >= 1024) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  if (bytes >= 1e6) std::snprintf(buf, sizeof buf, "%.3g %s", bytes, units[u]);
  else std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
  return buf;
}

void check_case_memory(const Case& c, int threads, uint64_t limit_bytes, const std::string& limit_origin,
                       double extra_bytes) {
  const double est = estimate_case_bytes(c, threads) + extra_bytes;
  if (est <= double(limit_bytes)) return;
  bad_input(c.source + ": case '" + printable(c.name) + "': estimated peak memory " + format_bytes(est) +
            " exceeds the limit " + format_bytes(double(limit_bytes)) + " (" + limit_origin +
            "); valid: smaller shapes (tokens, hidden, ffn, experts, align), or a larger --max-memory");
}

bool reset_peak_rss() {
  // main() keeps freed memory in glibc's heaps (no trimming): hand it back
  // first, so that a case's peak is its own, not the retained heap of the
  // cases before it.
  malloc_trim(0);
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return bool(f);
}

uint64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return uint64_t(std::strtoull(line.c_str() + 6, nullptr, 10)) * 1024;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return uint64_t(u.ru_maxrss) * 1024;  // Linux: kilobytes
}

std::string memory_line(double estimated_bytes, uint64_t measured_bytes) {
  auto mib = [](double b) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / double(1 << 20));
    return std::string(buf);
  };
  return "memory: estimated " + mib(estimated_bytes) + ", measured peak " + mib(double(measured_bytes));
}

}  // namespace moev
