// Stage variants of sequence parallelism (CONTRACT §10, FRAMEWORKS §10.2-§10.3).
//
// Model: SP ranks are a separate axis from the EP ranks (FRAMEWORKS §10: the
// MoE region is sequence-parallel over the TP axis). Each EP rank's board
// holds its T = B*L tokens; the slot sp_shard replaces x by the S SP ranks'
// local tokens stacked SP rank after SP rank (kernels/sp_host.h, "SP layout"),
// so that routing, dispatch, experts and combine run on exactly the rows the
// SP ranks hold, each token once. A token's combined row depends only on its
// own routing and expert rows (CONTRACT §2, §3), so this equals S separate
// dispatches. sp_pad_route gives tail pad rows expert 0 with score 0, and
// sp_gather writes the combine output to the global nlt*S rows and keeps the
// first T (CONTRACT §10). Every slot applies only when sp > 1; with sp = 1 the
// pipeline is untouched, which is what the SP invariance check compares with.
#include <algorithm>
#include <cstring>

#include "../kernels/ep_host.h"
#include "../kernels/sp_host.h"
#include "../reference/reference.h"
#include "runner.h"
#include "stages.h"

namespace moev {
namespace {

Decision sp_on(const Case& c) {
  if (c.sp > 1) return {};
  return {false, "sp = 1"};
}

Decision sp_tail(const Case& c) {
  if (c.sp > 1 && c.sp_padding == SpPadding::tail) return {};
  return {false, c.sp > 1 ? "virtual padding routes no pad rows" : "sp = 1"};
}

ref::SpPadding ref_padding(const Case& c) {
  return c.sp_padding == SpPadding::tail ? ref::SpPadding::tail : ref::SpPadding::virtual_;
}

/// The EP rank's own token count, from the untouched input x of sp_shard or
/// the sp_tokens the shard records for the later slots.
int64_t tokens_of(const RankBoard& b) {
  auto it = b.find("sp_tokens");
  return it != b.end() ? to_ints(it->second).at(0) : b.at("x").shape[0];
}

}  // namespace

void register_sp_stages(std::vector<Stage>& reg) {
  // --- sp_shard: each SP rank's slice of the tokens -------------------------
  {
    Stage s;
    s.slot = "sp_shard";
    s.variant = "sp_slices";
    s.summary = "x -> the SP ranks' local tokens, stacked; virtual or tail padding (CONTRACT §10)";
    s.applies = sp_on;
    s.primary = [](const Case&) { return true; };
    s.inputs = fixed_inputs({"x"});
    s.outputs = {{"x", CompareClass::exact, Coords::token_col, promise_always},
                 {"sp_rows", CompareClass::exact, Coords::flat, nullptr},
                 {"sp_tokens", CompareClass::exact, Coords::flat, nullptr}};
    s.fast = [](FastCtx& ctx) {
      const Case& c = ctx.c;
      const Tensor& x = ctx.input("x");
      const int64_t T = x.shape[0];
      const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
      const std::vector<int64_t> map = sp_shard_map(l);
      Tensor& xs = ctx.output("x", x.type, {int64_t(map.size()), c.hidden});
      apply_row_map(ctx.exec, c.dtype, x.data(), map.data(), int64_t(map.size()), c.hidden, xs.data());
      Tensor& rows = ctx.output("sp_rows", ElemType::i64, {int64_t(c.sp)});
      for (int64_t q = 0; q < c.sp; ++q) rows.as<int64_t>()[q] = l.rows(q);
      ctx.output("sp_tokens", ElemType::i64, {1}).as<int64_t>()[0] = T;
    };
    s.ref = [](RefCtx& r) {
      const Case& c = r.c;
      for (size_t q = 0; q < r.in.ranks.size(); ++q) {
        const Tensor& x = r.in.at("x", int(q));
        const int64_t T = x.shape[0];
        const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
        RankBoard& out = r.out.ranks[q];
        out["x"] = from_floats(ref::sp_shard_rows(sh, to_floats(x), T, c.hidden), x.type,
                               {int64_t(sh.position.size()), c.hidden});
        out["sp_rows"] = from_ints(sh.rows_per_rank, ElemType::i64, {int64_t(c.sp)});
        out["sp_tokens"] = from_ints({T}, ElemType::i64, {1});
      }
    };
    s.backends = kHostAndDevice;
    reg.push_back(s);
  }
  // --- sp_pad_route: tail pad rows to expert 0 with score 0 -------------------
  {
    Stage s;
    s.slot = "sp_pad_route";
    s.variant = "tail_pad_rows";
    s.summary = "tail pad rows routed to expert 0 with score 0, counts recomputed (FRAMEWORKS §10.2)";
    s.applies = sp_tail;
    s.primary = [](const Case&) { return true; };
    s.inputs = fixed_inputs({"ids", "topk_scores", "counts", "sp_tokens"});
    s.outputs = {{"ids", CompareClass::exact, Coords::token_k, nullptr},
                 {"topk_scores", CompareClass::exact, Coords::token_k, nullptr},
                 {"counts", CompareClass::exact, Coords::expert, nullptr}};
    s.fast = [](FastCtx& ctx) {
      const Case& c = ctx.c;
      const Tensor& ids = ctx.input("ids");
      const SpLayout l = sp_layout(tokens_of(ctx.in), c.batch, c.sp, c.sp_padding, ctx.exec.faults);
      Tensor& oi = ctx.output("ids", ElemType::i32, ids.shape);
      Tensor& os = ctx.output("topk_scores", ElemType::f32, ids.shape);
      if (ids.bytes()) {  // a rank with no tokens has no storage
        copy_bytes(ctx.exec, oi.data(), ids.data(), ids.bytes());
        copy_bytes(ctx.exec, os.data(), ctx.input("topk_scores").data(), os.bytes());
      }
      Tensor& counts = ctx.output("counts", ElemType::i64, {int64_t(c.num_experts)});
      sp_route_pad_rows(ctx.exec, l, c.top_k, c.num_experts, oi.as<int32_t>(), os.as<float>(), counts.as<int64_t>());
    };
    s.ref = [](RefCtx& r) {
      const Case& c = r.c;
      for (size_t q = 0; q < r.in.ranks.size(); ++q) {
        const RankBoard& in = r.in.ranks[q];
        const int64_t T = tokens_of(in);
        const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
        const Tensor& ids_in = in.at("ids");
        ref::Ids ids = ref_ids(ids_in);
        ref::Vec sc = to_floats(in.at("topk_scores"));
        ref::Counts counts;
        ref::sp_route_pad_rows(sh, T, c.top_k, c.num_experts, ids, sc, counts);
        RankBoard& out = r.out.ranks[q];
        out["ids"] = ids_tensor(ids, ElemType::i32, ids_in.shape);
        out["topk_scores"] = from_floats(sc, ElemType::f32, ids_in.shape);
        out["counts"] = from_ints(counts, ElemType::i64, {int64_t(c.num_experts)});
      }
    };
    s.backends = kHostAndDevice;
    reg.push_back(s);
  }
  // --- sp_gather: the global nlt*S rows, the first T kept ---------------------
  {
    Stage s;
    s.slot = "sp_gather";
    s.variant = "global_rows";
    s.summary = "combine output of the SP ranks -> global nlt*S rows -> first B*L kept (CONTRACT §10)";
    s.applies = sp_on;
    s.primary = [](const Case&) { return true; };
    s.inputs = fixed_inputs({"out", "sp_tokens"});
    s.outputs = {{"sp_out_global", CompareClass::exact, Coords::token_col, promise_combined},
                 {"sp_out", CompareClass::exact, Coords::token_col, promise_combined}};
    s.fast = [](FastCtx& ctx) {
      const Case& c = ctx.c;
      const Tensor& out = ctx.input("out");
      const int64_t T = tokens_of(ctx.in);
      const SpLayout l = sp_layout(T, c.batch, c.sp, c.sp_padding, ctx.exec.faults);
      const std::vector<int64_t> map = sp_gather_map(l);
      Tensor& g = ctx.output("sp_out_global", out.type, {l.global_rows(), c.hidden});
      apply_row_map(ctx.exec, c.dtype, out.data(), map.data(), l.global_rows(), c.hidden, g.data());
      Tensor& kept = ctx.output("sp_out", out.type, {T, c.hidden});
      copy_bytes(ctx.exec, kept.data(), g.data(), kept.bytes());  // no tokens: no storage, no copy
    };
    s.ref = [](RefCtx& r) {
      const Case& c = r.c;
      for (size_t q = 0; q < r.in.ranks.size(); ++q) {
        const RankBoard& in = r.in.ranks[q];
        const int64_t T = tokens_of(in);
        const Tensor& out = in.at("out");
        const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
        ref::Vec g = ref::sp_global_rows(sh, to_floats(out), c.sp, c.hidden);
        RankBoard& o = r.out.ranks[q];
        o["sp_out_global"] = from_floats(g, out.type, {sh.nlt * c.sp, c.hidden});
        g.resize(size_t(T * c.hidden));
        o["sp_out"] = from_floats(g, out.type, {T, c.hidden});
      }
    };
    s.backends = kHostAndDevice;
    reg.push_back(s);
  }
}

namespace {

/// The SP invariance checks of each EP rank against the sp = 1 run r1
/// (described at check_sp_invariance).
void sp_invariance_checks(const Case& c, const CaseReport& r1, const Board& fast, std::vector<Check>& out) {
  const Check* first_bad = nullptr;
  for (const auto& ch : r1.checks)
    if (ch.outcome != Outcome::PASSED && !first_bad) first_bad = &ch;
  const bool exact = c.data == DataMode::exact && c.experts.kind == ExpertKind::identity &&
                     c.shared.kind != SharedKind::swiglu;
  const OutputSpec os{"sp_out", exact ? CompareClass::exact : CompareClass::end_to_end, Coords::token_col,
                      promise_combined, nullptr};
  const int R = int(fast.ranks.size());
  for (int r = 0; r < R; ++r) {
    const std::string variant = "sp1_vs_sp" + std::to_string(c.sp);
    // tokens whose routing differs between the two runs (near-ties)
    int64_t routed_apart = 0;
    if (fast.has("ids", r) && r1.fast.has("ids", r) && fast.has("sp_tokens", r)) {
      const int64_t T = to_ints(fast.at("sp_tokens", r)).at(0);
      const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
      const std::vector<int64_t> a = to_ints(fast.at("ids", r)), b = to_ints(r1.fast.at("ids", r));
      const size_t K = size_t(c.top_k);
      for (size_t i = 0; i < sh.position.size(); ++i) {
        const int64_t pos = sh.position[i];
        if (pos >= T || (i + 1) * K > a.size() || size_t(pos + 1) * K > b.size()) continue;
        if (!std::equal(a.begin() + long(i * K), a.begin() + long((i + 1) * K), b.begin() + long(size_t(pos) * K)))
          ++routed_apart;
      }
    }
    if (routed_apart > 0 && !exact) {
      Check ch;
      ch.slot = "sp_invariance";
      ch.variant = variant;
      ch.tensor = R > 1 ? "sp_out@" + std::to_string(r) : "sp_out";
      ch.against = "sp = 1 run";
      ch.cls = os.cls;
      ch.tol = tolerance_for(c, os.cls);
      ch.note = std::to_string(routed_apart) + " token(s) routed differently by the sp = 1 run (near-ties of router "
                "logits computed over other rows): not compared";
      out.push_back(ch);
      continue;
    }
    const bool have = r1.fast.has("out", r);
    Check ch = check_output(c, "sp_invariance", variant, os, fast.has("sp_out", r) ? &fast.at("sp_out", r) : nullptr,
                            have ? &r1.fast.at("out", r) : nullptr, fast.ranks[size_t(r)], r, R, "sp = 1 run",
                            !exact && r1.fast.has("out_magnitude", r) ? &r1.fast.at("out_magnitude", r) : nullptr);
    if (first_bad) {
      ch.outcome = worst(ch.outcome, r1.outcome);
      ch.note = std::string("the sp = 1 run was ") + outcome_name(r1.outcome) + " at " + first_bad->slot + "/" +
                first_bad->variant + "/" + first_bad->tensor + (ch.note.empty() ? "" : "; " + ch.note);
    }
    out.push_back(ch);
  }
}

}  // namespace

// The SP ranks' outputs, gathered, equal the sp = 1 output (CONTRACT §10).
// Bitwise where every GEMM is exact whatever its shape: exact data, identity
// routed experts, no SwiGLU shared expert. Otherwise the router logits and
// the shared expert are GEMMs over other rows (the SP layout holds other row
// counts, tail pad rows included) and may differ in the last bits, so the
// comparison uses the end-to-end bound scaled by the sp = 1 run's magnitude;
// and where a near-tie made the two runs route a token differently, the
// outputs are not comparable at all: that is reported in the note, not failed.
void check_sp_invariance(const Case& c, const RunOptions& opt, const Board& fast, CaseReport& rep) {
  Case c1 = c;
  c1.sp = 1;
  c1.layers = 1;  // this layer entry alone (c.layer stays: its router weights)
  RunOptions o1 = opt;
  o1.after_slot = nullptr;
  o1.dump_dir.clear();
  o1.progress = nullptr;
  o1.keep = RunOptions::Keep::fast_board;
  // The sp = 1 run is the fast pipeline alone; only when a comparison fails
  // is it run again with every stage checked, to name its first failing stage.
  o1.fast_only = true;
  o1.fast_only_magnitude = !(c.data == DataMode::exact && c.experts.kind == ExpertKind::identity &&
                             c.shared.kind != SharedKind::swiglu);  // the exact condition of sp_invariance_checks
  std::vector<Check> checks;
  sp_invariance_checks(c, run_case(c1, o1), fast, checks);
  bool failed = false;
  for (const auto& ch : checks) failed = failed || ch.outcome != Outcome::PASSED;
  if (failed) {
    o1.fast_only = false;
    checks.clear();
    sp_invariance_checks(c, run_case(c1, o1), fast, checks);
  }
  rep.checks.insert(rep.checks.end(), checks.begin(), checks.end());
}


}  // namespace moev
