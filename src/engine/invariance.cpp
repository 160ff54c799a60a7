// The invariance reruns of a case: properties that compare two fast runs
// (docs/contract.md §3 EP invariance, §10 SP invariance) rather than a fast run with
// the reference.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../reference/reference.h"
#include "pipeline.h"
#include "registry.h"
#include "runner.h"
#include "stages.h"  // ref_padding

namespace moev {

namespace {

/// Per token of one EP rank: whether the SP run and the sp = 1 run keep the
/// same experts for it under capacity (docs/contract.md §11, "Capacity with
/// sequence parallelism": each SP rank drops with a cap of its own, so the
/// runs legitimately keep other experts for some tokens). All true without
/// capacity, or where either board lacks the metadata.
std::vector<uint8_t> same_kept_experts(const Case& c, const Board& fast, const Board& one, int r, int64_t T) {
  std::vector<uint8_t> same(size_t(T), 1);
  if (c.capacity.factor <= 0) return same;
  for (const char* n : {"ids", "row_of"})
    if (!fast.has(n, r) || !one.has(n, r)) return same;
  const ref::SpShard sh = ref::sp_shard(T, c.batch, c.sp, ref_padding(c));
  const std::vector<int64_t> ids = to_ints(fast.at("ids", r)), row_of = to_ints(fast.at("row_of", r));
  const std::vector<int64_t> ids1 = to_ints(one.at("ids", r)), row_of1 = to_ints(one.at("row_of", r));
  const size_t K = size_t(c.top_k);
  auto kept = [K](const std::vector<int64_t>& e, const std::vector<int64_t>& row, size_t i) {
    std::vector<int64_t> k;
    for (size_t j = i * K; j < (i + 1) * K && j < e.size() && j < row.size(); ++j)
      if (row[j] >= 0) k.push_back(e[j]);
    std::sort(k.begin(), k.end());
    return k;
  };
  for (size_t i = 0; i < sh.position.size(); ++i) {
    const int64_t t = sh.position[i];
    if (t < T) same[size_t(t)] = kept(ids, row_of, i) == kept(ids1, row_of1, size_t(t));
  }
  return same;
}

/// `t` (T, D) with the rows of the tokens not compared taken from `from`, so
/// that only the compared tokens can differ.
Tensor compared_rows(const Tensor& t, const Tensor& from, const std::vector<uint8_t>& same) {
  if (t.shape != from.shape || t.type != from.type || t.shape.size() != 2) return t;
  Tensor o = t.clone();
  const size_t row = size_t(t.shape[1]) * elem_bytes(t.type);
  for (size_t i = 0; i < same.size() && int64_t(i) < t.shape[0]; ++i)
    if (!same[i])
      std::memcpy(static_cast<uint8_t*>(o.data()) + i * row, static_cast<const uint8_t*>(from.data()) + i * row, row);
  return o;
}

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
    // Under capacity only the tokens that keep the same experts in both runs
    // are compared (docs/contract.md §11); the others take the sp = 1 rows.
    const int64_t T = fast.has("sp_tokens", r) ? to_ints(fast.at("sp_tokens", r)).at(0) : 0;
    const std::vector<uint8_t> same = same_kept_experts(c, fast, r1.fast, r, T);
    const int64_t apart = int64_t(std::count(same.begin(), same.end(), uint8_t(0)));
    auto pair = [&](const char* sp_name, const char* one_name, Tensor& a, Tensor& b) -> std::pair<Tensor*, Tensor*> {
      if (!fast.has(sp_name, r) || !r1.fast.has(one_name, r)) return {nullptr, nullptr};
      b = r1.fast.at(one_name, r);
      a = apart ? compared_rows(fast.at(sp_name, r), b, same) : fast.at(sp_name, r);
      return {&a, &b};
    };
    Tensor out_a, out_b, gx_a, gx_b;
    const auto outs = pair("sp_out", "out", out_a, out_b);
    const Tensor* sp_out = outs.first ? outs.first : fast.has("sp_out", r) ? &fast.at("sp_out", r) : nullptr;
    Check ch = check_output(c, "sp_invariance", variant, os, sp_out, outs.second, fast.ranks[size_t(r)], r, R,
                            "sp = 1 run",
                            !exact && r1.fast.has("out_magnitude", r) ? &r1.fast.at("out_magnitude", r) : nullptr);
    std::vector<Check> row{ch};
    // The token gradients too (backward: on): bitwise where the outputs are,
    // since a token's gradient is made of its own rows only (docs/contract.md §13).
    if (exact && c.backward == Switch::on) {
      const OutputSpec og{"grad_x", CompareClass::exact, Coords::token_col, nullptr};
      const auto gxs = pair("grad_x", "grad_x", gx_a, gx_b);
      row.push_back(check_output(c, "sp_invariance", variant, og,
                                 gxs.first ? gxs.first : fast.has("grad_x", r) ? &fast.at("grad_x", r) : nullptr,
                                 gxs.second, fast.ranks[size_t(r)], r, R, "sp = 1 run"));
    }
    if (apart > 0)
      for (Check& k : row) {
        const std::string n = std::to_string(apart) + " of " + std::to_string(T) +
                              " token(s) keep other experts than under the sp = 1 run's capacity (each SP rank drops "
                              "with its own cap, docs/contract.md §11): not compared";
        k.note = k.note.empty() ? n : k.note + "; " + n;
      }
    for (Check& k : row) {
      if (first_bad) {
        k.outcome = worst(k.outcome, r1.outcome);
        k.note = std::string("the sp = 1 run was ") + outcome_name(r1.outcome) + " at " + first_bad->slot + "/" +
                 first_bad->variant + "/" + first_bad->tensor + (k.note.empty() ? "" : "; " + k.note);
      }
      out.push_back(k);
    }
  }
}

}  // namespace

// The SP ranks' outputs, gathered, equal the sp = 1 output (docs/contract.md §10).
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

/// EP invariance (docs/contract.md §3): each rank's output equals an EP = 1 run on
/// that rank's tokens; bitwise when the experts are row-wise exact. The
/// EP = 1 run is the fast pipeline alone (the property compares two fast
/// runs; the case's own stages are checked by run_pipeline); only when the outputs
/// differ is it run again with every stage checked, to name the first stage
/// of the EP = 1 run that fails. Its error scale for the GEMM class is that
/// of the EP = 1 run's own routed rows and scores.
void check_ep_invariance(const Case& c, const RunOptions& opt, const std::vector<RankBoard>& inputs,
                         const std::map<std::string, Tensor>& globals, const Board& fast, const Board& chain,
                         CaseReport& rep) {
  const int R = c.ep;
  Case c1 = c;
  c1.ep = 1;
  c1.tokens_per_rank.clear();
  RunOptions o1 = opt;
  o1.dump_dir.clear();
  o1.after_slot = nullptr;
  const bool exact = c.experts.kind == ExpertKind::identity;
  const OutputSpec oi{"out", exact ? CompareClass::exact : CompareClass::gemm, Coords::token_col, promise_combined,
                      nullptr};
  // The ranks' EP = 1 runs are independent: on the host they run side by
  // side on the run's threads, each with its share of them (on a device,
  // one at a time).
  const int side = opt.mirror ? 1 : ranks_side_by_side(opt.threads, R);
  if (side > 1) {
    o1.threads = std::max(1, opt.threads / side);
    o1.progress = nullptr;  // one progress line per case, not interleaved ones
  }
  std::vector<std::vector<Check>> per_rank(static_cast<size_t>(R));
  each_rank(R, side, [&](int p) {
    Case cp = c1;
    cp.tokens = c.tokens_on(p);
    RunOptions op = o1;
    // Streamed weights: the EP = 1 run is scaled by this rank's error scale
    // on the reference chain (the same tokens, experts and rows), not by one
    // of its own, which would generate every expert's weights once more per
    // rank.
    const Tensor* chain_scale = !exact && c.streams_weights() && chain.has("out_magnitude", p)
                                    ? &chain.at("out_magnitude", p)
                                    : nullptr;
    auto rerun = [&](bool fast_only, CaseReport& r1, Board& f1) {
      r1.c = cp;
      op.fast_only = fast_only;
      op.fast_only_magnitude = !exact && !chain_scale;
      std::vector<RankBoard> in1 = {RankBoard{}};
      // Per-rank tensors are cloned (an in-place stage may write into x);
      // the global ones are shared, read-only like every stage input.
      for (auto& [n, t] : inputs[size_t(p)]) in1[0][n] = globals.count(n) ? t : t.clone();
      run_pipeline(cp, op, in1, false, r1, f1);
      return make_check(c, "ep_invariance", "ep1_vs_ep" + std::to_string(R), oi,
                        fast.has("out", p) ? &fast.at("out", p) : nullptr, f1.has("out", 0) ? &f1.at("out", 0) : nullptr,
                        fast.ranks[size_t(p)], p, R, "EP = 1 run",
                        chain_scale ? chain_scale
                        : !exact && f1.has("out_magnitude", 0) ? &f1.at("out_magnitude", 0)
                                                                : nullptr);
    };
    CaseReport r1;
    Board f1;
    Check ch = rerun(true, r1, f1);
    for (const auto& e : r1.checks) ch.outcome = worst(ch.outcome, e.outcome);  // a fast stage that failed
    if (ch.outcome != Outcome::PASSED) {
      r1 = CaseReport{};
      f1 = Board{};
      ch = rerun(false, r1, f1);
      Outcome w1 = Outcome::PASSED;
      const Check* first_bad = nullptr;
      for (const auto& e : r1.checks) {
        if (e.outcome != Outcome::PASSED && !first_bad) first_bad = &e;
        w1 = worst(w1, e.outcome);
      }
      if (first_bad) {
        ch.outcome = worst(ch.outcome, w1);
        ch.note = std::string("the EP = 1 run of this rank's tokens was ") + outcome_name(w1) + " at " +
                  first_bad->slot + "/" + first_bad->variant + "/" + first_bad->tensor + " against " +
                  first_bad->against + (first_bad->note.empty() ? "" : " (" + first_bad->note + ")") +
                  (ch.note.empty() ? "" : "; " + ch.note);
      }
    }
    per_rank[size_t(p)].push_back(ch);
    // The gradients too (docs/contract.md §3 EP invariance, run backwards): bitwise
    // with identity experts; with SwiGLU experts in the end-to-end class,
    // scaled by this rank's error scales on the reference chain (the same
    // tokens and rows as the EP = 1 run's).
    for (const EndToEndOutput& e : backward_end_to_end(c)) {
      const std::string& n = e.spec.name;
      const Tensor* scale = !exact && chain.has(e.scale, p) ? &chain.at(e.scale, p) : nullptr;
      if (!exact && !scale) continue;
      const OutputSpec og = exact ? OutputSpec{n, CompareClass::exact, e.spec.coords, nullptr} : e.spec;
      per_rank[size_t(p)].push_back(make_check(c, "ep_invariance", "ep1_vs_ep" + std::to_string(R), og,
                                               fast.has(n, p) ? &fast.at(n, p) : nullptr,
                                               f1.has(n, 0) ? &f1.at(n, 0) : nullptr, fast.ranks[size_t(p)], p, R,
                                               "EP = 1 run", scale));
    }
  });
  for (const auto& v : per_rank) rep.checks.insert(rep.checks.end(), v.begin(), v.end());
}

}  // namespace moev
