// The invariance reruns of a case: properties that compare two fast runs
// (docs/contract.md §3 EP invariance, §10 SP invariance) rather than a fast run with
// the reference.
#include <algorithm>
#include <string>
#include <vector>

#include "../reference/reference.h"
#include "runner.h"
#include "stages.h"  // ref_padding

namespace moev {

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
    std::vector<Check> row{ch};
    // The token gradients too (backward: on): bitwise where the outputs are,
    // since a token's gradient is made of its own rows only (docs/contract.md §13).
    if (exact && c.backward == Switch::on) {
      const OutputSpec og{"grad_x", CompareClass::exact, Coords::token_col, nullptr};
      row.push_back(check_output(c, "sp_invariance", variant, og, fast.has("grad_x", r) ? &fast.at("grad_x", r) : nullptr,
                                 r1.fast.has("grad_x", r) ? &r1.fast.at("grad_x", r) : nullptr, fast.ranks[size_t(r)], r,
                                 R, "sp = 1 run"));
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

}  // namespace moev
