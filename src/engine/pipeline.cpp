// The pipeline of one case's layer entry (run_pipeline): each slot's
// applicable stage variants run on every rank and are compared with the
// reference fed the same inputs, the primary variant feeds the next slot, and
// a reference chain runs from the inputs alone for the end-to-end checks
// (docs/architecture.md ideas 1-5). The boards stream: a tensor leaves once
// no later slot reads it (Streaming).
#include "pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "board_exchange.h"
#include "comm.h"
#include "cuda_probe.h"
#include "dump.h"
#include "error.h"
#include "../kernels/overload_host.h"

namespace moev {
namespace {

/// Whether two variants of a slot have the same reference: the same plain
/// function reading the same inputs (the variants of one operation, e.g. the
/// in-place and out-of-place combine, share the reference of that operation).
/// Same type, shape and bytes (then one may stand for the other).
bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.storage == b.storage && a.offset_bytes == b.offset_bytes && a.type == b.type && a.shape == b.shape) return true;
  return a.type == b.type && a.shape == b.shape && (b.bytes() == 0 || std::memcmp(a.data(), b.data(), b.bytes()) == 0);
}

bool same_reference(const Stage& a, const Stage& b, const Case& c) {
  using Fn = void (*)(RefCtx&);
  const Fn* fa = a.ref.target<Fn>();
  const Fn* fb = b.ref.target<Fn>();
  return fa && fb && *fa == *fb && a.inputs(c) == b.inputs(c);
}

/// Ranks by the bytes of their tensors in `b`, largest first. A stage's
/// reference outputs of a rank are about the size of its fast outputs, so
/// computing them in this order lets each rank's transient reference reuse
/// the heap block the previous one freed (one no smaller), where sizes in
/// rank order would keep taking fresh pages.
std::vector<int> largest_first(const Board& b) {
  std::vector<int> order(b.ranks.size());
  std::vector<size_t> bytes(b.ranks.size(), 0);
  for (size_t r = 0; r < b.ranks.size(); ++r) {
    order[r] = int(r);
    for (const auto& [n, t] : b.ranks[r]) bytes[r] += t.bytes();
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return bytes[size_t(a)] > bytes[size_t(c)]; });
  return order;
}

/// Runs one stage variant's fast function on every rank. Returns the error
/// message ("" when it ran), fills outputs, notes and the skip reason.
std::string run_fast(const Stage& s, const Case& c, const RunOptions& opt, const Board& in, Board& out,
                     std::vector<std::vector<std::string>>& notes, std::string& skipped, bool use_mpi) {
  const int R = int(in.ranks.size());
  std::vector<std::string> skip(static_cast<size_t>(R)), err(static_cast<size_t>(R));
  // Out of memory is no verdict on the stage: it ends the run (exit 3), the
  // lowest rank's rethrown once every rank is done.
  std::vector<std::exception_ptr> oom(static_cast<size_t>(R));
  auto one = [&](int r, Comm* comm) {
    // In-process ranks share the machine: each gets its share of the
    // threads, so R ranks never run R x threads OpenMP workers (results do
    // not depend on the thread count).
    ExecCtx ex{use_mpi ? opt.threads : std::max(1, opt.threads / R), opt.faults, opt.mirror};
    FastCtx ctx{c, r, R, ex, comm, in.ranks[size_t(r)], out.ranks[size_t(r)], notes[size_t(r)], &skip[size_t(r)]};
    try {
      s.fast(ctx);
    } catch (const std::bad_alloc&) {
      oom[size_t(r)] = std::current_exception();
      err[size_t(r)] = "out of memory";
      comm->abort("out of memory");
    } catch (const std::exception& e) {
      err[size_t(r)] = e.what();
      comm->abort(e.what());
    }
    comm->leave();  // a peer still waiting in a collective fails now, naming this rank
  };
  auto rethrow_oom = [&] {
    for (const auto& e : oom)
      if (e) std::rethrow_exception(e);
  };
  if (!use_mpi) {
    // On a device the ranks are threads on it, exchanging device buffers
    // with device-to-device copies (issue 12 item 4), timed as the
    // all-to-all stage's own device work (its device_seconds).
    DeviceCopy copy;
    if (opt.mirror)
      copy = [dev = &opt.mirror->device()](void* d, const void* s, size_t n) { dev->copy_timed(d, s, n); };
    auto comms = make_local_comms(R, std::chrono::milliseconds(opt.collective_timeout_ms), std::move(copy));
    if (R == 1) {
      one(0, comms[0].get());
    } else {
      std::vector<std::thread> th;
      for (int r = 0; r < R; ++r) th.emplace_back([&, r] { one(r, comms[size_t(r)].get()); });
      for (auto& t : th) t.join();
    }
    rethrow_oom();
  } else {
    Comm& w = mpi_world();
    const int me = w.rank();
    // On a GPU, one per process, the token rows move over NCCL (the
    // metadata and the board exchange below stay on MPI).
    one(me, c.backend == Backend::cuda && opt.mirror
                ? &nccl_world(cuda_device_ordinal(), std::chrono::milliseconds(opt.collective_timeout_ms))
                : &w);
    rethrow_oom();  // the peers' deadline ends their wait for this rank
    exchange_boards(w, out, notes, skip, err);
  }
  skipped.clear();
  for (int r = 0; r < R; ++r)
    if (!skip[size_t(r)].empty() && skipped.empty()) skipped = skip[size_t(r)];
  std::string first;
  for (int r = 0; r < R; ++r)
    if (!err[size_t(r)].empty()) {
      first += (first.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + err[size_t(r)];
    }
  return first;
}

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// The streaming and memory policy of a pipeline (docs/architecture.md "Scale and
/// backends"), stated once. last_read[n]: the last slot (index into
/// slot_order) whose applicable variants read tensor n. After that slot, n
/// leaves both boards unless it is integer metadata (small, and it names
/// mismatches in MoE coordinates) or a result of the pipeline
/// (pipeline_results); so the boards hold a few stages' rows, not the whole
/// pipeline's. The fast board keeps everything when the caller asked for it
/// (RunOptions::Keep::fast_board). Within a slot, the variants' outputs and
/// references live until the slot's primary has fed the chain, then go
/// (SlotRun). Reference rows equal byte for byte to the fast ones share the
/// fast storage (share_equal), so the chain holds its own copy only where it
/// differs.
struct Streaming {
  std::map<std::string, size_t> last_read;
  bool keep_fast = false;

  Streaming(const Case& c, const RunOptions& opt) : keep_fast(opt.keep == RunOptions::Keep::fast_board) {
    for (size_t i = 0; i < slot_order().size(); ++i)
      for (const Stage& s : registry())
        if (s.slot == slot_order()[i] && s.applies(c).applies)
          for (const auto& n : s.inputs(c)) last_read[n] = i;
  }
  /// Drops what no slot after `slot_index` reads.
  void release(Board& b, size_t slot_index) const {
    for (RankBoard& rb : b.ranks)
      for (auto it = rb.begin(); it != rb.end();) {
        const auto lr = last_read.find(it->first);
        const bool metadata = it->second.type == ElemType::i32 || it->second.type == ElemType::i64;
        const bool dead = !metadata && !pipeline_results().count(it->first) &&
                          (lr == last_read.end() || lr->second <= slot_index);
        it = dead ? rb.erase(it) : std::next(it);
      }
  }
  void release_fast(Board& fast, size_t slot_index) const {
    if (!keep_fast) release(fast, slot_index);
  }
  /// `t`, or the fast board's tensor of that name when its bytes are the same.
  static const Tensor& share_equal(const RankBoard& fast, const std::string& n, const Tensor& t) {
    const auto fi = fast.find(n);
    return fi != fast.end() && same_bytes(fi->second, t) ? fi->second : t;
  }
};

/// What one slot's variants leave for the slot's end: the variants that ran
/// with their outputs, their references, and the routing adoption reason.
struct SlotRun {
  std::string adopt_reason;
  std::vector<std::pair<const Stage*, Board>> ran;
  std::map<const Stage*, Board> refs;  // each variant's reference outputs, for the chain
  const Stage* last_ref = nullptr;     // the last reference run in this slot, its outputs and error scales
  Board last_refout, last_scales;
  // Each variant's error scales (shared storage): a function of the slot's
  // inputs alone, so the cross-variant checks reuse them, never recompute.
  std::map<const Stage*, Board> scales_of;
};

/// The pipeline on R ranks (run_pipeline_stages): the phases of one case's
/// layer entry as methods, the boards and the report as members.
class Pipeline {
 public:
  Pipeline(const Case& c, const RunOptions& opt, bool use_mpi, CaseReport& rep, Board& fast, std::string& stage)
      : c_(c), opt_(opt), use_mpi_(use_mpi), rep_(rep), fast_(fast), stage_(stage), streaming_(c, opt) {}

  bool run(const std::vector<RankBoard>& inputs, Board* chain_out) {
    start(inputs);
    size_t slot_index = size_t(-1);
    for (const std::string& slot : slot_order()) {
      ++slot_index;
      if (c_.fp8() && !opt_.fast_only && slot == fp8_first_slot()) act_start_ = chain_;
      const std::vector<const Stage*> runs = plan_variants(slot);
      if (runs.empty()) continue;
      SlotRun sr;
      for (const Stage* s : runs)
        if (run_variant(*s, sr)) break;  // fast_only: the first variant that runs
      if (sr.ran.empty()) return stop_at(slot);
      auto [primary, primary_out] = pick_primary(slot, sr, runs);
      cross_variant_checks(*primary, primary_out, sr);
      feed_next_slot(primary_out, sr);
      if (opt_.fast_only) {
        fast_only_magnitude(slot);
        sr = SlotRun{};
        primary_out = Board{};
        streaming_.release_fast(fast_, slot_index);
        continue;
      }
      advance_chain(slot, *primary, primary_out, sr);
      streaming_.release(chain_, slot_index);
      streaming_.release_fast(fast_, slot_index);
    }
    if (opt_.fast_only) return true;
    end_to_end_checks();
    if (chain_out) *chain_out = std::move(chain_);
    dump_.finish(c_);
    return true;
  }

 private:
  std::string rank_tag(int r) const { return R_ > 1 ? "@" + std::to_string(r) : std::string(); }
  VariantDecision& decision_of(const Stage& s) {
    VariantDecision* vd = nullptr;
    for (auto& d : rep_.decisions)
      if (d.slot == s.slot && d.variant == s.variant) vd = &d;
    return *vd;
  }

  /// Both boards start from the inputs (no stage writes its inputs: each
  /// call is checked for that); --dump writes them.
  void start(const std::vector<RankBoard>& inputs) {
    R_ = int(inputs.size());
    fast_.ranks = inputs;
    chain_ = fast_;
    if (!opt_.dump_dir.empty()) {
      dump_.open(opt_.dump_dir, c_.name);
      for (int r = 0; r < R_; ++r)
        for (auto& [n, t] : fast_.ranks[size_t(r)]) dump_.put("input." + n + rank_tag(r), t);
    }
  }

  /// The slot's variants that apply to the case (a decision recorded for
  /// each); under fast_only the primary first.
  std::vector<const Stage*> plan_variants(const std::string& slot) {
    std::vector<const Stage*> runs;
    for (const Stage& s : registry()) {
      if (s.slot != slot || (s.listed && !s.listed(c_))) continue;
      Decision d = s.applies(c_);
      // On a device a variant without a device form is not taken: never run
      // on the host in its place (backend_unsupported kept the primary ones).
      if (d.applies && opt_.mirror && !has_device_form(s))
        d = {false, "no device implementation (backend " + std::string(enum_name(backend_table(), c_.backend)) + ")"};
      rep_.decisions.push_back({s.slot, s.variant, d.applies, false, d.applies ? "" : d.reason, {}});
      if (d.applies) runs.push_back(&s);
    }
    if (opt_.fast_only)  // the variant the case asks for first; the loop stops at the first that runs
      std::stable_partition(runs.begin(), runs.end(), [&](const Stage* s) { return s->primary(c_); });
    return runs;
  }

  void input_modified(const Stage& s, const std::string& tensor, const std::string& against, const std::string& note) {
    Check ch;
    ch.slot = s.slot;
    ch.variant = s.variant;
    ch.tensor = tensor;
    ch.against = against;
    ch.outcome = Outcome::INCORRECT;
    ch.note = note;
    rep_.checks.push_back(ch);
  }

  /// One variant: the fast call, then (unless fast_only) its reference and
  /// comparisons. Returns true when the slot's loop should stop (fast_only
  /// and the variant ran).
  bool run_variant(const Stage& s, SlotRun& sr) {
    VariantDecision& vd = decision_of(s);
    stage_ = s.slot + "/" + s.variant;
    if (opt_.progress) opt_.progress(s.slot, s.variant);
    Board out;
    if (!fast_call(s, vd, out)) return false;
    if (opt_.fast_only) {
      sr.ran.push_back({&s, out});
      return true;
    }
    reference_checks(s, vd, out, sr);
    sr.ran.push_back({&s, out});
    return false;
  }

  /// The fast function on every rank, its inputs hashed before and after (on
  /// the device too). False when it failed (an ERROR check) or declined.
  bool fast_call(const Stage& s, VariantDecision& vd, Board& out) {
    auto tc = Clock::now();
    const std::vector<std::string> inputs_used = s.inputs(c_);
    const std::vector<std::vector<uint64_t>> sums = input_sums(inputs_used);
    std::vector<std::vector<uint64_t>> dsums = device_before_call(inputs_used);
    out.ranks.resize(size_t(R_));
    std::vector<std::vector<std::string>> notes(static_cast<size_t>(R_));
    std::string skipped;
    vd.compare_seconds += since(tc);
    const auto tf = Clock::now();
    const double busy0 = opt_.mirror ? opt_.mirror->device().busy_seconds() : 0;
    const std::string err = run_fast(s, c_, opt_, fast_, out, notes, skipped, use_mpi_);
    vd.fast_seconds = since(tf);
    if (opt_.mirror) vd.device_seconds = opt_.mirror->device().busy_seconds() - busy0;
    if (opt_.mirror) device_after_call(s, inputs_used, dsums, out, err);
    tc = Clock::now();
    for (int r = 0; r < R_; ++r)
      for (const auto& n : notes[size_t(r)]) vd.notes.push_back(n);
    if (!err.empty()) {
      Check ch;
      ch.slot = s.slot;
      ch.variant = s.variant;
      ch.tensor = "-";
      ch.outcome = Outcome::ERROR;
      ch.note = "fast stage failed: " + err;
      rep_.checks.push_back(ch);
      return false;
    }
    if (!skipped.empty()) {
      vd.ran = false;
      vd.reason = skipped;
      return false;
    }
    const std::vector<std::vector<uint64_t>> after = input_sums(inputs_used);
    for (int r = 0; r < R_; ++r)
      for (size_t i = 0; i < inputs_used.size(); ++i)
        if (after[size_t(r)][i] != sums[size_t(r)][i])
          input_modified(s, inputs_used[i] + rank_tag(r), "its value before the call",
                         "input '" + inputs_used[i] + "' was modified by the fast stage");
    vd.compare_seconds += since(tc);
    return true;
  }

  /// The checksum of each rank's inputs `names`. A tensor every rank's board
  /// shares (the global gate and weights: one storage) is hashed once, not
  /// once per rank: at EP 8 the SwiGLU weights were most of a variant's
  /// check time.
  std::vector<std::vector<uint64_t>> input_sums(const std::vector<std::string>& names) {
    std::map<std::pair<const void*, size_t>, uint64_t> shared;
    auto key = [](const Tensor& t) { return std::make_pair(static_cast<const void*>(t.data()), t.bytes()); };
    for (const auto& n : names) {
      const Tensor& t0 = fast_.at(n, 0);
      bool everywhere = R_ > 1 && t0.storage;
      for (int r = 1; r < R_ && everywhere; ++r) {
        const Tensor& t = fast_.at(n, r);
        everywhere = t.storage == t0.storage && t.offset_bytes == t0.offset_bytes && t.bytes() == t0.bytes();
      }
      if (everywhere) shared[key(t0)] = checksum(t0);
    }
    std::vector<std::vector<uint64_t>> sums(static_cast<size_t>(R_));
    each_rank(R_, opt_.threads, [&](int r) {
      for (const auto& n : names) {
        const Tensor& t = fast_.at(n, r);
        const auto it = t.storage ? shared.find(key(t)) : shared.end();
        sums[size_t(r)].push_back(it != shared.end() ? it->second : checksum(t));
      }
    });
    return sums;
  }

  /// On a device: the stage's inputs are resident there (uploaded the first
  /// time a stage reads them), and hashed there before the call.
  std::vector<std::vector<uint64_t>> device_before_call(const std::vector<std::string>& inputs_used) {
    std::vector<std::vector<uint64_t>> dsums(static_cast<size_t>(R_));
    if (!opt_.mirror) return dsums;
    begin_device_call(*opt_.mirror, fast_, inputs_used);
    for (int r = 0; r < R_; ++r)
      for (const auto& n : inputs_used) {
        const Tensor& t = fast_.at(n, r);
        dsums[size_t(r)].push_back(t.bytes() ? opt_.mirror->device_hash(t.data(), t.bytes()) : 0);
      }
    return dsums;
  }

  /// Host-written outputs go to the device (sync_device_outputs). Then the
  /// inputs' device copies must hash as before the call: a kernel writing
  /// past its output into another buffer shows here, not only where it lands.
  void device_after_call(const Stage& s, const std::vector<std::string>& inputs_used,
                         const std::vector<std::vector<uint64_t>>& dsums, Board& out, const std::string& err) {
    sync_device_outputs(*opt_.mirror, out.ranks);
    for (int r = 0; r < R_ && err.empty(); ++r)
      for (size_t i = 0; i < inputs_used.size(); ++i) {
        const Tensor& t = fast_.at(inputs_used[i], r);
        if (t.bytes() && opt_.mirror->device_hash(t.data(), t.bytes()) != dsums[size_t(r)][i])
          input_modified(s, inputs_used[i] + rank_tag(r), "its device copy before the call",
                         "input '" + inputs_used[i] + "' was modified on the device by the fast stage");
      }
    opt_.mirror->end_call();
  }

  /// The check of one output on rank r: against the reference's, or against
  /// what the reference derives from the variant's own outputs.
  Check check_rank(const Stage& s, const OutputSpec& o, int r, const Board& out, const Board& refout,
                   const Board& merged, const Board& scales) {
    const RankBoard& fo = out.ranks[size_t(r)];
    const RankBoard& ro = refout.ranks[size_t(r)];
    auto fi = fo.find(o.name);
    if (o.from_fast) {
      Tensor scale;
      const Tensor expect = o.from_fast(c_, merged.ranks[size_t(r)], r, R_, true, scale);
      return make_check(c_, s.slot, s.variant, o, fi == fo.end() ? nullptr : &fi->second, &expect,
                        merged.ranks[size_t(r)], r, R_, o.from_fast_label, &scale);
    }
    auto ri = ro.find(o.name);
    const Tensor* pre = nullptr;
    if (size_t(r) < scales.ranks.size()) {
      const auto si = scales.ranks[size_t(r)].find(o.name);
      if (si != scales.ranks[size_t(r)].end()) pre = &si->second;
    }
    return make_check(c_, s.slot, s.variant, o, fi == fo.end() ? nullptr : &fi->second,
                      ri == ro.end() ? nullptr : &ri->second, merged.ranks[size_t(r)], r, R_, "reference", nullptr, pre);
  }

  void dump_rank(const Stage& s, int r, const Board& out, const Board& refout) {
    for (auto& [n, t] : out.ranks[size_t(r)]) dump_.put(s.slot + "." + s.variant + "." + n + rank_tag(r) + ".fast", t);
    for (auto& [n, t] : refout.ranks[size_t(r)]) dump_.put(s.slot + "." + s.variant + "." + n + rank_tag(r) + ".ref", t);
  }

  /// The reference on the same inputs (stage isolation) and the comparisons.
  void reference_checks(const Stage& s, VariantDecision& vd, const Board& out, SlotRun& sr) {
    const auto tr = Clock::now();
    Board refout;
    Board merged = fast_;  // this variant's outputs over its inputs
    for (int r = 0; r < R_; ++r)
      for (auto& [n, t] : out.ranks[size_t(r)]) merged.ranks[size_t(r)][n] = t;
    const bool reuse = sr.last_ref && same_reference(*sr.last_ref, s, c_);  // computed once per slot
    Clock::time_point tc;
    Board scales;
    if (s.ref_per_rank && R_ > 1 && !s.check) {
      reference_per_rank(s, vd, out, merged, reuse, refout, sr);
      tc = Clock::now();
    } else {
      if (reuse) {
        refout = sr.last_refout;
        scales = sr.last_scales;
      } else {
        refout.ranks.resize(size_t(R_));
        scales.ranks.resize(size_t(R_));
        RefCtx rctx{c_, fast_, refout, -1, opt_.threads, &scales};
        s.ref(rctx);
        sr.last_ref = &s;
        sr.last_refout = refout;
        sr.last_scales = scales;
      }
      vd.ref_seconds = since(tr);
      tc = Clock::now();
      for (int r = 0; r < R_; ++r) dump_rank(s, r, out, refout);
      if (s.check) {
        std::vector<Check> checks;
        CheckCtx cc{c_, merged, refout, checks, ""};
        s.check(cc);
        for (auto& ch : checks) ch.variant = s.variant;
        rep_.checks.insert(rep_.checks.end(), checks.begin(), checks.end());
        sr.adopt_reason = cc.adopt_fast_reason;
      } else {
        for (const OutputSpec& o : s.outputs)
          for (int r = 0; r < R_; ++r) rep_.checks.push_back(check_rank(s, o, r, out, refout, merged, scales));
      }
    }
    vd.compare_seconds += since(tc);
    sr.scales_of[&s] = sr.last_scales;
    if (s.primary(c_) || sr.ran.empty()) sr.refs[&s] = std::move(refout);
  }

  /// One rank's reference at a time on each of the run's threads: computed,
  /// compared, then kept only as the fast output's own storage where the
  /// bytes agree. The loop's wall time is split between reference and
  /// comparison in the ratio of their summed per-rank times.
  void reference_per_rank(const Stage& s, VariantDecision& vd, const Board& out, const Board& merged, bool reuse,
                          Board& refout, SlotRun& sr) {
    refout.ranks.resize(size_t(R_));
    Board scales;
    scales.ranks.resize(size_t(R_));
    std::vector<std::vector<Check>> by_output(s.outputs.size(), std::vector<Check>(size_t(R_)));
    std::vector<double> ref_s(static_cast<size_t>(R_)), cmp_s(static_cast<size_t>(R_));
    const auto tl = Clock::now();
    const int side = ranks_side_by_side(opt_.threads, R_);
    each_rank(R_, side, [&](int q) {
      auto tq = Clock::now();
      if (reuse) {
        refout.ranks[size_t(q)] = sr.last_refout.ranks[size_t(q)];
        scales.ranks[size_t(q)] = sr.last_scales.ranks[size_t(q)];
      } else {
        Board rq, sq;
        rq.ranks.resize(size_t(R_));
        sq.ranks.resize(size_t(R_));
        RefCtx rctx{c_, fast_, rq, q, std::max(1, opt_.threads / side), &sq};
        s.ref(rctx);
        refout.ranks[size_t(q)] = std::move(rq.ranks[size_t(q)]);
        scales.ranks[size_t(q)] = std::move(sq.ranks[size_t(q)]);
      }
      ref_s[size_t(q)] = since(tq);
      tq = Clock::now();
      for (size_t i = 0; i < s.outputs.size(); ++i)
        by_output[i][size_t(q)] = check_rank(s, s.outputs[i], q, out, refout, merged, scales);
      for (auto& [n, t] : refout.ranks[size_t(q)]) {  // (the same bytes: the dump below is unchanged)
        const auto fi = out.ranks[size_t(q)].find(n);
        if (fi != out.ranks[size_t(q)].end() && same_bytes(fi->second, t)) t = fi->second;
      }
      cmp_s[size_t(q)] = since(tq);
    }, largest_first(out));
    const double wall = since(tl), rs = std::accumulate(ref_s.begin(), ref_s.end(), 0.0),
                 cs = std::accumulate(cmp_s.begin(), cmp_s.end(), 0.0);
    vd.ref_seconds += rs + cs > 0 ? wall * rs / (rs + cs) : 0;
    vd.compare_seconds += rs + cs > 0 ? wall * cs / (rs + cs) : 0;
    for (int q = 0; q < R_; ++q) dump_rank(s, q, out, refout);
    for (auto& v : by_output) rep_.checks.insert(rep_.checks.end(), v.begin(), v.end());
    if (!reuse) {
      sr.last_ref = &s;
      sr.last_refout = refout;
      sr.last_scales = std::move(scales);
    }
  }

  /// Every variant failed or declined: later slots have no inputs. The case
  /// ends here as ERROR (the failures are already checks); the next case
  /// still runs.
  bool stop_at(const std::string& slot) {
    bool failed = false;
    for (const auto& ch : rep_.checks) failed = failed || (ch.slot == slot && ch.outcome == Outcome::ERROR);
    if (!failed) {
      Check ch;
      ch.slot = slot;
      ch.variant = "-";
      ch.tensor = "-";
      ch.outcome = Outcome::ERROR;
      ch.note = "no variant of this stage ran";
      rep_.checks.push_back(ch);
    }
    rep_.notes.push_back("the case stopped at stage " + slot + ": no variant produced outputs for the next stage");
    dump_.finish(c_);
    return false;
  }

  /// The primary feeds the next slot: the one the case asks for, else the
  /// first that ran. Where a variant the case names itself (Stage::asked)
  /// did not run (equal_count on unequal counts), a case note says so, also
  /// in a passing case's summary: the case was meant to test it.
  std::pair<const Stage*, Board> pick_primary(const std::string& slot, const SlotRun& sr,
                                              const std::vector<const Stage*>& planned) {
    const Stage* primary = sr.ran.front().first;
    Board primary_out = sr.ran.front().second;
    for (auto& [s, out] : sr.ran)
      if (s->primary(c_)) {
        primary = s;
        primary_out = out;
        break;
      }
    for (auto& d : rep_.decisions)
      if (d.slot == slot) d.primary = d.variant == primary->variant && d.ran;
    for (const Stage* s : planned) {
      if (!s->asked || !s->asked(c_) || s == primary) continue;
      for (const auto& d : rep_.decisions)
        if (d.slot == slot && d.variant == s->variant && !d.ran)
          rep_.notes.push_back("stage " + slot + ": " + s->variant + ", which the case asks for, did not run (" +
                               d.reason + "); " + primary->variant + " fed the next stage");
    }
    return {primary, primary_out};
  }

  /// Cross-variant agreement: every other variant against the primary, in
  /// the output's own class (bitwise for exact outputs).
  void cross_variant_checks(const Stage& primary, const Board& primary_out, const SlotRun& sr) {
    for (const auto& [s, out] : sr.ran) {
      if (s == &primary) continue;
      const auto tx = Clock::now();
      const auto own = sr.scales_of.find(s);
      for (const OutputSpec& o : s->outputs)
        for (int r = 0; r < R_; ++r) {
          if (o.from_fast) continue;
          auto fi = out.ranks[size_t(r)].find(o.name);
          auto pi = primary_out.ranks[size_t(r)].find(o.name);
          if (fi == out.ranks[size_t(r)].end() || pi == primary_out.ranks[size_t(r)].end()) continue;
          const Tensor* pre = nullptr;
          if (own != sr.scales_of.end() && size_t(r) < own->second.ranks.size()) {
            const auto si = own->second.ranks[size_t(r)].find(o.name);
            if (si != own->second.ranks[size_t(r)].end()) pre = &si->second;
          }
          rep_.checks.push_back(make_check(c_, s->slot, s->variant, o, &fi->second, &pi->second, fast_.ranks[size_t(r)],
                                           r, R_, primary.variant, nullptr, pre));
        }
      decision_of(*s).compare_seconds += since(tx);  // counted as this variant's comparison time
    }
  }

  /// The primary's outputs join the fast board; after_slot sees it.
  void feed_next_slot(const Board& primary_out, const SlotRun& sr) {
    for (int r = 0; r < R_; ++r)
      for (auto& [n, t] : primary_out.ranks[size_t(r)]) fast_.ranks[size_t(r)][n] = t;
    if (opt_.after_slot)
      for (const auto& [s, out] : sr.ran)
        for (const auto& d : rep_.decisions)
          if (d.slot == s->slot && d.variant == s->variant) opt_.after_slot(*s, d, fast_, opt_.mirror);
  }

  /// out_magnitude (combined_magnitudes) on every rank of `b`.
  void put_magnitudes(const Case& c, Board& b) const {
    std::vector<Tensor> m = combined_magnitudes(c, b.ranks, opt_.threads);
    for (int r = 0; r < R_; ++r) b.ranks[size_t(r)]["out_magnitude"] = std::move(m[size_t(r)]);
  }

  void fast_only_magnitude(const std::string& slot) {
    if (slot == magnitude_slot(c_) && opt_.fast_only_magnitude) put_magnitudes(c_, fast_);
  }

  /// Whether the chain holds the fast board's own tensors (same storage) for
  /// the primary's inputs and for all integer metadata (which a reference may
  /// read besides its inputs): then the stage check's reference is the chain's.
  bool chain_inputs_fast(const Stage& primary) const {
    const std::vector<std::string> primary_inputs = primary.inputs(c_);
    for (int r = 0; r < R_; ++r)
      for (const auto& [n, t] : chain_.ranks[size_t(r)]) {
        const bool metadata = t.type == ElemType::i32 || t.type == ElemType::i64;
        if (!metadata && std::find(primary_inputs.begin(), primary_inputs.end(), n) == primary_inputs.end()) continue;
        const auto fi = fast_.ranks[size_t(r)].find(n);
        if (fi == fast_.ranks[size_t(r)].end() || fi->second.storage != t.storage || fi->second.offset_bytes != t.offset_bytes)
          return false;
      }
    return true;
  }

  /// The reference chain advances with the primary's reference function:
  /// reused from the stage check where the chain holds the fast board's own
  /// tensors, else run on the chain. Either way, an output equal to the fast
  /// one, byte for byte, shares the fast storage (Streaming::share_equal):
  /// past routing the chain's own copies are the tolerance-class scores and
  /// what they scale, while the row stages share their rows.
  void advance_chain(const std::string& slot, const Stage& primary, Board& primary_out, SlotRun& sr) {
    stage_ = slot + " (reference chain)";
    const bool inputs_fast = chain_inputs_fast(primary);
    Board next;
    if (!sr.adopt_reason.empty()) {
      rep_.notes.push_back(sr.adopt_reason);
      next = primary_out;
    } else if (inputs_fast && sr.refs.count(&primary)) {
      next = sr.refs[&primary];
    } else if (primary.ref_per_rank && R_ > 1) {  // one rank's reference rows at a time, as for the stage check
      next.ranks.resize(size_t(R_));
      const int side = ranks_side_by_side(opt_.threads, R_);
      each_rank(R_, side, [&](int q) {
        Board rq;
        rq.ranks.resize(size_t(R_));
        RefCtx rc{c_, chain_, rq, q, std::max(1, opt_.threads / side)};
        primary.ref(rc);
        for (auto& [n, t] : rq.ranks[size_t(q)]) next.ranks[size_t(q)][n] = Streaming::share_equal(fast_.ranks[size_t(q)], n, t);
      }, largest_first(primary_out));
    } else {
      next.ranks.resize(size_t(R_));
      RefCtx rc{c_, chain_, next, -1, opt_.threads};
      primary.ref(rc);
    }
    if (primary.chain_adopt)
      for (int r = 0; r < R_; ++r) {
        const std::string why = primary.chain_adopt(c_, next.ranks[size_t(r)], primary_out.ranks[size_t(r)]);
        if (why.empty()) continue;
        next.ranks[size_t(r)] = primary_out.ranks[size_t(r)];
        rep_.notes.push_back(slot + (R_ > 1 ? " (rank " + std::to_string(r) + ")" : "") + ": " + why);
        if (slot == "capacity" && c_.fp8()) {  // the act chain of fp8_against_act keeps the same rows
          capacity_kept_.ranks.resize(size_t(R_));
          for (const char* n : {"token_sorted", "counts"})
            capacity_kept_.ranks[size_t(r)][n] = primary_out.ranks[size_t(r)].at(n);
        }
      }
    for (int r = 0; r < R_; ++r)
      for (auto& [n, t] : next.ranks[size_t(r)]) chain_.ranks[size_t(r)][n] = Streaming::share_equal(fast_.ranks[size_t(r)], n, t);
    sr = SlotRun{};  // the slot's outputs and references go before the next slot
    primary_out = Board{};
    // The end-to-end error scale reads the chain's routed rows: computed as
    // soon as the chain has them, so they need not live to the end.
    if (slot == magnitude_slot(c_)) put_magnitudes(c_, chain_);
  }

  /// End to end: the fast pipeline's output against the reference chain's,
  /// with the error scale of the chain's combine (it also scales the EP
  /// invariance check, so it stays on the fast board as out_magnitude); the
  /// backward's gradients (src/paths/stages_backward.cpp) likewise.
  void end_to_end_checks() {
    stage_ = "end_to_end";
    const OutputSpec oe{"out", CompareClass::end_to_end, Coords::token_col, promise_combined, nullptr};
    for (int r = 0; r < R_; ++r) {
      const bool hf = fast_.has("out", r), hc = chain_.has("out", r) && chain_.has("out_magnitude", r);
      if (hc) fast_.ranks[size_t(r)]["out_magnitude"] = chain_.at("out_magnitude", r);
      rep_.checks.push_back(make_check(c_, "end_to_end", "pipeline", oe, hf ? &fast_.at("out", r) : nullptr,
                                       hc ? &chain_.at("out", r) : nullptr, fast_.ranks[size_t(r)], r, R_,
                                       "reference chain", hc ? &fast_.at("out_magnitude", r) : nullptr));
    }
    for (const EndToEndOutput& e : backward_end_to_end(c_))
      for (int r = 0; r < R_; ++r) {
        const std::string& n = e.spec.name;
        const bool hs = !e.scale.empty() && chain_.has(e.scale, r);
        rep_.checks.push_back(make_check(c_, "end_to_end", "backward", e.spec, fast_.has(n, r) ? &fast_.at(n, r) : nullptr,
                                         chain_.has(n, r) ? &chain_.at(n, r) : nullptr, fast_.ranks[size_t(r)], r, R_,
                                         "reference chain", hs ? &chain_.at(e.scale, r) : nullptr));
      }
    if (!act_start_.ranks.empty()) fp8_against_act();
  }

  /// FP8 dispatch end to end (docs/contract.md §16 "End to end"): the fast
  /// pipeline's output against the reference chain of the same case under
  /// act dispatch (no quantisation), from the reference chain's board before
  /// the quantisation on: each slot's primary reference under act dispatch.
  /// The bound is the end_to_end one plus the FP8 term B of fp8_error_bound:
  /// |fast - ref| <= atol + rtol * max(|ref|, m) + B, written for the diff as
  /// atol + rtol' * max(|ref|, S) with S = max(|ref|, (rtol * max(|ref|, m) + B) / rtol').
  void fp8_against_act() {
    stage_ = "end_to_end (act chain)";
    Case ca = c_;
    ca.dispatch.dtype = DispatchDtype::act;
    Board act = std::move(act_start_);
    act_start_ = Board{};
    const Board kept = std::move(capacity_kept_);
    capacity_kept_ = Board{};
    std::vector<Tensor> bound(static_cast<size_t>(R_));
    bool on = false;
    for (const std::string& slot : slot_order()) {
      on = on || slot == fp8_first_slot();
      const Stage* pick = nullptr;
      for (const Stage& s : registry())
        if (on && s.slot == slot && s.applies(ca).applies && (!pick || (!pick->primary(ca) && s.primary(ca)))) pick = &s;
      if (!pick) continue;
      Board next;
      next.ranks.resize(size_t(R_));
      RefCtx rc{ca, act, next, -1, opt_.threads};
      pick->ref(rc);
      // Where the FP8 chain took the fast path's kept rows (a near-tie at an
      // expert's capacity), the act chain keeps the same assignments.
      for (size_t r = 0; slot == "capacity" && r < kept.ranks.size(); ++r)
        if (!kept.ranks[r].empty()) {
          next.ranks[r].clear();
          capacity_with_kept(ca, act.ranks[r], kept.ranks[r], next.ranks[r]);
        }
      for (int r = 0; r < R_; ++r)
        for (auto& [n, t] : next.ranks[size_t(r)]) act.ranks[size_t(r)][n] = t;
      if (slot == magnitude_slot(ca)) {
        put_magnitudes(ca, act);
        for (int r = 0; r < R_; ++r) bound[size_t(r)] = fp8_error_bound(c_, act.ranks[size_t(r)]);
      }
    }
    const OutputSpec oe{"out", CompareClass::end_to_end, Coords::token_col, promise_combined, nullptr};
    const Tolerance base = tolerance_for(c_, CompareClass::end_to_end);
    Tolerance tol = base;
    if (!(tol.rtol > 0)) tol.rtol = 0.0625;  // an rtol override of 0 cannot carry B: e4m3's unit roundoff does
    // An element whose act value, or the bound around it, reaches past act's
    // largest finite value is not compared: either side may overflow there.
    const double max_finite = c_.dtype == DType::fp16 ? 65504.0 : double(std::numeric_limits<float>::max());
    for (int r = 0; r < R_; ++r) {
      const bool hf = fast_.has("out", r), ha = act.has("out", r) && bound[size_t(r)].storage;
      Tensor S;
      std::vector<uint8_t> mask;
      int64_t skipped = 0;
      if (ha) {
        const std::vector<float> ref = to_floats(act.at("out", r)), m = to_floats(act.at("out_magnitude", r)),
                                 b = to_floats(bound[size_t(r)]);
        std::vector<float> s(ref.size());
        mask.assign(ref.size(), 1);
        for (size_t i = 0; i < s.size(); ++i) {
          const double top = std::max(std::fabs(double(ref[i])), double(m[i]));
          const double si = std::max(std::fabs(double(ref[i])), (base.rtol * top + double(b[i])) / tol.rtol) * (1 + 1e-6);
          s[i] = float(si);
          if (!std::isfinite(ref[i]) || !(std::fabs(double(ref[i])) + tol.atol + tol.rtol * si < max_finite) ||
              !(double(m[i]) + double(b[i]) < max_finite)) {
            mask[i] = 0;
            ++skipped;
          }
        }
        S = from_floats(s, ElemType::f32, act.at("out", r).shape);
      }
      Check ch = make_check(c_, "end_to_end", "fp8_vs_act", oe, hf ? &fast_.at("out", r) : nullptr,
                            ha ? &act.at("out", r) : nullptr, fast_.ranks[size_t(r)], r, R_, "act reference chain",
                            ha ? &S : nullptr, nullptr, &tol, ha ? &mask : nullptr);
      ch.note += std::string(ch.note.empty() ? "" : ", ") + "plus the FP8 term of docs/contract.md §16";  // of the bound clause
      if (skipped)
        ch.note += "; " + std::to_string(skipped) + " element(s) not compared: the act value or its bound reaches past " +
                   dtype_name(c_.dtype) + "'s largest finite value";
      rep_.checks.push_back(ch);
    }
  }

  const Case& c_;
  const RunOptions& opt_;
  const bool use_mpi_;
  CaseReport& rep_;
  Board& fast_;         // every primary output (the inputs of the next slot)
  std::string& stage_;  // what runs now, for an out-of-memory message
  Streaming streaming_;
  int R_ = 1;
  Board chain_;         // the reference chain
  Board act_start_;     // FP8 dispatch: the chain before fp8_first_slot(), where the act chain starts
  Board capacity_kept_;  // FP8 dispatch: per rank, the fast kept rows (token_sorted, counts) where the chain adopted them
  Dumper dump_;
};

/// The pipeline on R ranks with the given inputs: every slot's applicable
/// variants against the reference, the primary feeding the next slot, and the
/// end-to-end reference chain. `fast` ends holding every primary output.
/// Returns false when a stage had no variant to feed the next one (the case
/// is then ERROR and stops there).
bool run_pipeline_stages(const Case& c, const RunOptions& opt, const std::vector<RankBoard>& inputs, bool use_mpi,
                         CaseReport& rep, Board& fast, Board* chain_out, std::string& stage) {
  return Pipeline(c, opt, use_mpi, rep, fast, stage).run(inputs, chain_out);
}

}  // namespace

bool run_pipeline(const Case& c, const RunOptions& opt, const std::vector<RankBoard>& inputs, bool use_mpi,
                  CaseReport& rep, Board& fast, Board* chain_out) {
  std::string stage = "pipeline setup";
  try {
    return run_pipeline_stages(c, opt, inputs, use_mpi, rep, fast, chain_out, stage);
  } catch (const std::bad_alloc&) {
    rethrow_out_of_memory(c.name, stage);
  }
}


}  // namespace moev
