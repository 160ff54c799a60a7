// The stage-by-stage check of export and check (docs/contract.md §15; the
// golden format in export_check.h): the reference pipeline fed an
// implementation's own stage outputs (run_external), one golden folder
// judged (check_folder) and `moeverify check`. The manifest and `export`
// are golden_manifest.cpp, reading the implementation's files npy_read.cpp.
#include "export_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "datagen.h"
#include "dump.h"
#include "error.h"
#include "golden.h"
#include "selection.h"
#include "stages.h"
#include "subprocess.h"

namespace moev {
using golden::layout_of;

namespace {

/// The variant whose reference the external pipeline uses for a slot: the
/// one `run` makes primary, else the first that applies.
const Stage* stage_for(const Case& c, const std::string& slot) {
  const Stage* first = nullptr;
  for (const Stage& s : registry()) {
    if (s.slot != slot || !s.applies(c).applies) continue;
    if (s.primary(c)) return &s;
    if (!first) first = &s;
  }
  return first;
}

/// A token's expected ids against which its ids `a` are compared: the valid
/// selection `s` (a set, docs/contract.md §15) in the implementation's own
/// order for the members it got right, its wrong members' places taken by
/// the members it missed, so that only the wrong members mismatch.
void expected_ids_row(const int32_t* a, const int32_t* s, int64_t K, int32_t* out) {
  std::set<int32_t> left(s, s + K);
  std::vector<int64_t> wrong;
  for (int64_t k = 0; k < K; ++k) {
    if (left.erase(a[k])) out[k] = a[k];
    else wrong.push_back(k);
  }
  for (int64_t k : wrong) {
    out[k] = left.empty() ? s[k] : *left.begin();
    if (!left.empty()) left.erase(left.begin());
  }
}

/// Stage names of a case's L layer entries ("routing", "layer2/routing")
/// for the coverage note: each stage once, its layers after it ("routing in
/// every layer", "experts in layers 1,3"); the JSON keeps each entry's name.
std::string stage_list(const std::vector<std::string>& names, int L) {
  std::vector<std::pair<std::string, std::set<int>>> by_stage;
  for (const auto& n : names) {
    int layer = 1;
    std::string base = n;
    if (n.rfind("layer", 0) == 0 && n.find('/') != std::string::npos) {
      layer = std::atoi(n.c_str() + 5);
      base = n.substr(n.find('/') + 1);
    }
    auto it = std::find_if(by_stage.begin(), by_stage.end(), [&](const auto& e) { return e.first == base; });
    if (it == by_stage.end()) it = by_stage.insert(by_stage.end(), {base, {}});
    it->second.insert(layer);
  }
  std::string m;
  for (const auto& [base, layers] : by_stage)
    m += (m.empty() ? "" : ", ") + base +
         (L == 1                       ? ""
          : int(layers.size()) == L    ? " in every layer"
          : layers.size() == 1         ? " in layer " + int_ranges(layers)
                                       : " in layers " + int_ranges(layers));
  return m;
}

/// How routing.topk_scores is judged: steps 5, 7 and 8 on the
/// implementation's own scores where it wrote them (judged on their own),
/// so that only these steps are judged here. Held scores are act values:
/// the chain's roundings are the class rounding's, and the reference's held
/// scores standing for unwritten ones are each known within their
/// half-width. fp32 scores it did not write: the reference's, each known
/// only within the scores tolerance, carried through route_norm and
/// route_scale (a tolerance fit for scores, unscaled, failed correct
/// topk_scores of scores it would accept).
struct TopkJudgement {
  Tensor expect, halfwidth;
  CompareClass cls = CompareClass::scores;
  std::string against, note;
};
TopkJudgement topk_judgement(const ref::RouterSpec& spec, const Tensor& logits, const ref::Vec& judged,
                             const ref::Vec& ref_scores, const ref::Ids& ids, int64_t T, bool own_scores,
                             const Tolerance& stol) {
  const int64_t K = spec.K;
  const bool held = spec.held != ref::Act::fp32;
  TopkJudgement j;
  j.expect = from_floats(ref::topk_scores_for(spec, judged, ids, T), ElemType::f32, {T, K});
  j.against = own_scores ? "ref on its scores" : "ref at its ids";
  if (!own_scores) j.note = "the scores tolerance carried through route_norm and route_scale";
  if (!held && own_scores) return j;
  j.cls = CompareClass::rounding;
  if (held) {
    ref::Vec score_half;
    if (!own_scores) score_half = ref::router_scores_halfwidth(spec, to_floats(logits), T, stol.rtol, stol.atol);
    j.halfwidth = from_floats(ref::topk_scores_halfwidth(spec, judged, ids, T, own_scores ? nullptr : &score_half),
                              ElemType::f32, {T, K});
  } else {
    j.halfwidth = from_floats(ref::topk_scores_tolerance_halfwidth(spec, ref_scores, ids, T, stol.rtol, stol.atol),
                              ElemType::f32, {T, K});
  }
  return j;
}

/// Routing of an implementation (docs/contract.md §15):
/// `scores` against the reference; `ids` per token as a selection, judged on
/// the implementation's own scores (the reference's when it wrote none) by
/// judge_selection: any member of an exact tie, at the K-th expert or at the
/// group boundary, is accepted. Judged on the reference's scores, a selection
/// valid only within the scores tolerance is a near-tie: reported, not
/// failed. With strict_ties the set must be the lowest-index one. topk_scores
/// as topk_judgement says; counts against the histogram of its ids. Under
/// router.score_dtype act (docs/contract.md §14) scores are class rounding.
void check_routing_external(const Case& c, const Board& ref, const Board& merged,
                            const std::vector<std::map<std::string, Tensor>>& given, const ExternalOptions& opt,
                            CaseReport& rep) {
  const ref::RouterSpec spec = ref_router_spec(c);
  const int R = int(merged.ranks.size());
  const int64_t K = c.top_k, E = c.num_experts;
  for (int q = 0; q < R; ++q) {
    const auto& g = given[size_t(q)];
    const RankBoard& mb = merged.ranks[size_t(q)];
    const int64_t T = ref.at("scores", q).shape[0];
    const Tolerance stol = tolerance_for(c, CompareClass::scores);
    auto add = [&](const std::string& name, CompareClass cls, Coords co, const Tensor& f, const Tensor& r,
                   const std::string& against, const std::string& note, const Tensor* halfwidth = nullptr) {
      const OutputSpec o(name, cls, co, nullptr);
      Check ch = check_output(c, "routing", "actual", o, &f, &r, mb, q, R, against, halfwidth);
      if (!note.empty()) ch.note += (ch.note.empty() ? "" : "; ") + note;
      rep.checks.push_back(ch);
    };
    const bool own_scores = g.count("scores") > 0;
    const bool held = spec.held != ref::Act::fp32;
    const CompareClass score_cls = held ? CompareClass::rounding : CompareClass::scores;
    if (own_scores) {
      Tensor hw;
      if (held)
        hw = from_floats(ref::router_scores_halfwidth(spec, to_floats(mb.at("logits")), T, stol.rtol, stol.atol),
                         ElemType::f32, {T, E});
      add("scores", score_cls, Coords::token_expert, g.at("scores"), ref.at("scores", q), "reference", "",
          held ? &hw : nullptr);
    }
    const ref::Vec ref_scores = to_floats(ref.at("scores", q));
    const ref::Vec judged = own_scores ? to_floats(g.at("scores")) : ref_scores;
    const ref::Ids ids_used = ref_ids(mb.at("ids"));
    if (g.count("ids")) {
      const ref::Vec bias = to_floats(mb.at("bias"));
      ref::Vec choice, ref_choice;
      ref::Ids sel, ref_sel;
      ref::select_experts(spec, judged, bias, T, choice, sel);
      ref::select_experts(spec, ref_scores, bias, T, ref_choice, ref_sel);
      ref::Ids expect(ids_used.size());
      int64_t ties = 0, near = 0, differs_from_ref = 0;
      std::string first_why;
      const bool force_lb = spec.selection == ref::Selection::force_load_balance;
      std::vector<float> raw(static_cast<size_t>(E));
      for (int64_t t = 0; t < T; ++t) {
        const int32_t* a = &ids_used[size_t(t * K)];
        const int32_t* s = &sel[size_t(t * K)];
        const std::set<int32_t> aset(a, a + K), sset(s, s + K), rset(&ref_sel[size_t(t * K)], &ref_sel[size_t(t * K)] + K);
        bool ok = aset == sset && int64_t(aset.size()) == K, is_near = false, is_tie = false;
        if (!ok && !force_lb && !opt.strict_ties) {
          // The selection values before any group mask.
          for (int64_t e = 0; e < E; ++e) raw[size_t(e)] = float(double(judged[size_t(t * E + e)]) + double(bias[size_t(e)]));
          SelectionRule rule{int(E), int(K), spec.groups, spec.limited_groups, 0.0};
          if (!spec.bias) rule.group_held = spec.held;
          const SelectionVerdict exact = judge_selection(rule, raw.data(), a);
          ok = is_tie = exact.valid;
          if (ok) {
            ++ties;
          } else if (!own_scores) {
            // Held scores (router.score_dtype act) may differ by one act unit
            // where a score lies at a rounding boundary.
            const double rtol = held ? std::max(stol.rtol, spec.held == ref::Act::bf16 ? 0x1p-8 : 0x1p-11) : stol.rtol;
            rule.slack = near_tie_slack(stol.atol, rtol, int(K), raw.data(), s);
            ok = is_near = judge_selection(rule, raw.data(), a).valid;
            near += is_near;
          }
          if (!ok && first_why.empty()) first_why = "token " + std::to_string(t) + ": " + exact.why;
        }
        if (ok && !is_near && !is_tie && aset != rset) ++differs_from_ref;  // a tie is counted once, above
        expected_ids_row(a, ok ? a : s, K, &expect[size_t(t * K)]);
      }
      std::ostringstream note;
      note << kSelectionNote << (own_scores ? "implementation's" : "reference's")
           << " scores (docs/contract.md §15)";
      if (opt.strict_ties) note << "; strict: the lowest-index member of every tie";
      if (ties) note << "; " << ties << " token(s) pick another member of an exact tie (accepted)";
      rep.accepted_ties += ties;
      if (near) note << "; " << near << " near-tie token(s): valid within the scores tolerance (reported, not failed)";
      if (own_scores && differs_from_ref)
        note << "; " << differs_from_ref << " near-tie token(s): the selection differs from the reference's own where the scores agree within tolerance (reported, not failed)";
      if (!first_why.empty()) note << "; first wrong " << first_why;
      add("ids", CompareClass::exact, Coords::token_k, g.at("ids"), ids_tensor(expect, ElemType::i32, {T, K}),
          opt.strict_ties ? "ref, lowest index" : "ref, as a selection", note.str());
    }
    if (g.count("topk_scores")) {
      const TopkJudgement j = topk_judgement(spec, mb.at("logits"), judged, ref_scores, ids_used, T, own_scores, stol);
      add("topk_scores", j.cls, Coords::token_k, g.at("topk_scores"), j.expect, j.against, j.note,
          j.cls == CompareClass::rounding ? &j.halfwidth : nullptr);
    }
    if (g.count("counts")) {
      std::vector<int64_t> hist(size_t(E), 0);
      for (int32_t e : ids_used)
        if (e >= 0 && e < E) ++hist[size_t(e)];
      add("counts", CompareClass::exact, Coords::expert, g.at("counts"), from_ints(hist, ElemType::i64, {E}),
          "histogram of ids", "");
    }
  }
}

}  // namespace

namespace {


/// The name of the counts tensor that groups a row tensor's rows into
/// segments ("" for tensors that are not grouped).
std::string segments_name(Coords co) {
  switch (co) {
    case Coords::dispatch_row: return "counts";
    case Coords::rank_major_row: return "recv_counts";
    case Coords::expert_row: return "expert_counts_real";
    case Coords::padded_row: return "expert_counts";
    default: return "";
  }
}

std::string list_ints(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 16; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() > 16 ? ", ... (" + std::to_string(v.size()) + " in all)]" : "]");
}

/// "expert 2 has 1 row short, expert 5 has 1 row too many": the first
/// segments where the implementation's row counts differ from the
/// reference's (issue 34's diagnosing hints); "" when they cannot be paired.
std::string segment_hint(const std::vector<int64_t>& want, const std::vector<int64_t>& got) {
  if (want.size() != got.size() || want == got) return "";
  std::ostringstream h;
  int shown = 0;
  for (size_t e = 0; e < want.size() && shown < 3; ++e) {
    if (want[e] == got[e]) continue;
    const int64_t d = got[e] - want[e];
    h << (shown++ ? ", " : "hint: ") << "expert " << e << " has " << (d < 0 ? -d : d) << " row"
      << ((d < 0 ? -d : d) == 1 ? "" : "s") << (d < 0 ? " short" : " too many");
  }
  return h.str();
}

/// A tensor of the implementation with another number of rows than the
/// reference's: INCORRECT at its stage, with the rows per segment of the
/// counts that group them (the reference's, fed the implementation's earlier
/// stages; and the implementation's own where it wrote them).
Check rows_check(const std::string& slot, const OutputSpec& o, int r, int R, const Tensor& expected,
                 const std::vector<int64_t>& shape, const RankBoard& ref_rank, const RankBoard& given_rank) {
  Check ch;
  ch.slot = slot;
  ch.variant = "actual";
  ch.tensor = R > 1 ? o.name + "@" + std::to_string(r) : o.name;
  ch.cls = o.cls;
  ch.outcome = Outcome::INCORRECT;
  ch.rows.expected = expected.shape.empty() ? 1 : expected.shape[0];
  ch.rows.actual = shape.empty() ? 1 : shape[0];
  std::ostringstream n;
  n << "rows: the implementation wrote " << ch.rows.actual << " (shape " << Tensor{expected.type, shape, nullptr, 0}.shape_str()
    << ") where the reference, fed the implementation's earlier stages, has " << ch.rows.expected;
  if (R > 1) n << " on rank " << r;
  const std::string seg = segments_name(o.coords);
  if (!seg.empty() && ref_rank.count(seg)) {
    ch.rows.segments_of = seg;
    ch.rows.expected_segments = to_ints(ref_rank.at(seg));
    n << "; rows per segment of " << seg << ": reference " << list_ints(ch.rows.expected_segments);
    if (given_rank.count(seg)) {
      ch.rows.actual_segments = to_ints(given_rank.at(seg));
      n << ", the implementation's " << list_ints(ch.rows.actual_segments);
      const std::string hint = segment_hint(ch.rows.expected_segments, ch.rows.actual_segments);
      if (!hint.empty()) n << "; " << hint;
    }
  }
  ch.note = n.str();
  return ch;
}

/// The capacity boundary (docs/contract.md §11, §15): under policy probs rows whose
/// scores tie exactly at an expert's cap may be kept either way. When the
/// implementation's kept tokens (its token_sorted, grouped by its counts) are
/// such a choice for every expert (as many as the reference keeps, none
/// beaten by a dropped row) but not the reference's, its choice is laid out
/// by the reference (capacity_reference with a keep mask) and becomes what
/// the stage is judged against. Returns whether that happened.
bool adopt_capacity_ties(const Case& c, const RankBoard& in, const std::map<std::string, Tensor>& given,
                         std::map<std::string, Tensor>& expected) {
  if (c.capacity.policy != CapacityPolicy::probs || !given.count("token_sorted") || !given.count("counts")) return false;
  const std::vector<int64_t> counts = to_ints(in.at("counts")), tok = to_ints(in.at("token_sorted"));
  const std::vector<float> score = to_floats(in.at("score_sorted"));
  const std::vector<int64_t> gcounts = to_ints(given.at("counts")), gtok = to_ints(given.at("token_sorted"));
  if (gcounts.size() != counts.size() || to_ints(expected.at("token_sorted")) == gtok) return false;
  // per capacity group (docs/contract.md §11: one per SP rank with sp > 1)
  const ref::CapacityGroups groups = capacity_groups_of(c, in);
  const size_t G = groups.cap.size();
  std::vector<uint8_t> keep(tok.size(), 0);
  int64_t s = 0, gs = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (gcounts[e] < 0 || gs + gcounts[e] > int64_t(gtok.size())) return false;
    std::set<int64_t> mine;
    for (int64_t i = gs; i < gs + gcounts[e]; ++i)
      if (gtok[size_t(i)] >= 0) mine.insert(gtok[size_t(i)]);
    gs += gcounts[e];
    int64_t kept_all = 0;
    std::vector<int64_t> kept(G, 0), rows(G, 0);
    std::vector<float> lowest_kept(G, INFINITY), highest_dropped(G, -INFINITY);
    for (int64_t i = s; i < s + counts[e]; ++i) {
      keep[size_t(i)] = mine.count(tok[size_t(i)]) > 0;
      kept_all += keep[size_t(i)];
      const int32_t g = groups.group[size_t(tok[size_t(i)])];
      if (g < 0) {
        if (keep[size_t(i)]) return false;  // a row in no group is never kept
        continue;
      }
      ++rows[size_t(g)];
      kept[size_t(g)] += keep[size_t(i)];
      if (keep[size_t(i)]) lowest_kept[size_t(g)] = std::min(lowest_kept[size_t(g)], score[size_t(i)]);
      else highest_dropped[size_t(g)] = std::max(highest_dropped[size_t(g)], score[size_t(i)]);
    }
    if (kept_all != int64_t(mine.size())) return false;
    for (size_t g = 0; g < G; ++g)
      if (kept[g] != std::min(groups.cap[g], rows[g]) || highest_dropped[g] > lowest_kept[g]) return false;
    s += counts[e];
  }
  RankBoard out;
  capacity_reference(c, in, out, &keep);
  for (auto& [n, t] : out) expected[n] = t;
  return true;
}

/// The local dispatch (docs/contract.md §2) of an implementation whose
/// token_sorted holds, within each expert's segment of the counts, the
/// reference's tokens in another order (a sort that is not stable). The
/// stage stays INCORRECT; the later stages are judged in the implementation's
/// own row order, so that its combine, which sums the same rows, is not
/// failed for pairing the reference's row map with its rows. Each dispatch
/// output it did not write, or wrote unlike the reference's in its order, is
/// fed as the reference's rows in its order (row_of remapped). `fed` is one
/// rank's board the reference saw; `expected` the reference's outputs.
/// Returns whether the order was paired (then `set` names what was set in
/// `merged`, the rest being the implementation's own).
bool adopt_own_row_order(const Stage& s, const RankBoard& fed, const std::map<std::string, Tensor>& given,
                         const std::map<std::string, Tensor>& expected, RankBoard& merged,
                         std::vector<std::string>& set) {
  if (s.slot != "dispatch" || !given.count("token_sorted") || !expected.count("token_sorted") || !fed.count("counts"))
    return false;
  const Tensor& gt = given.at("token_sorted");
  const Tensor& et = expected.at("token_sorted");
  if (gt.shape != et.shape) return false;
  const std::vector<int64_t> mine = to_ints(gt), ref_tok = to_ints(et), counts = to_ints(fed.at("counts"));
  if (mine == ref_tok) return false;
  // perm[i]: the reference's row that the implementation's row i is.
  const int64_t N = int64_t(ref_tok.size());
  std::vector<int64_t> perm(size_t(N), -1);
  int64_t at = 0;
  for (int64_t n : counts) {
    if (n < 0 || at + n > N) return false;
    std::map<int64_t, int64_t> row_of_token;  // within one segment a token appears once
    for (int64_t i = at; i < at + n; ++i)
      if (!row_of_token.emplace(ref_tok[size_t(i)], i).second) return false;
    for (int64_t i = at; i < at + n; ++i) {
      auto f = row_of_token.find(mine[size_t(i)]);
      if (f == row_of_token.end()) return false;
      perm[size_t(i)] = f->second;
      row_of_token.erase(f);
    }
    at += n;
  }
  if (at != N) return false;
  std::vector<int64_t> inverse(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) inverse[size_t(perm[size_t(i)])] = i;
  std::map<std::string, Tensor> adopted;
  for (const OutputSpec& o : s.outputs) {
    auto e = expected.find(o.name);
    if (e == expected.end()) continue;
    const Tensor& ref = e->second;
    Tensor t = Tensor::alloc(ref.type, ref.shape);
    if (o.coords == Coords::token_k) {  // row_of: the reference's row numbers, renumbered
      if (ref.type != ElemType::i32) return false;  // (the stage writes i32 row numbers)
      const int32_t* a = ref.as<int32_t>();
      int32_t* b = t.as<int32_t>();
      for (int64_t i = 0; i < ref.numel(); ++i) b[i] = a[i] >= 0 && a[i] < N ? int32_t(inverse[size_t(a[i])]) : a[i];
    } else if (!ref.shape.empty() && ref.shape[0] == N) {  // rows: the reference's, in the implementation's order
      const size_t width = N ? size_t(ref.bytes() / uint64_t(N)) : 0;
      for (int64_t i = 0; i < N; ++i)
        std::memcpy(static_cast<char*>(t.data()) + size_t(i) * width,
                    static_cast<const char*>(ref.data()) + size_t(perm[size_t(i)]) * width, width);
    } else {
      continue;  // not laid out by row (a per-expert tensor): as it is
    }
    auto g = given.find(o.name);
    if (g != given.end() && g->second.shape == t.shape && g->second.bytes() == t.bytes() &&
        std::memcmp(g->second.data(), t.data(), t.bytes()) == 0)
      continue;  // the implementation's own, consistent with its order
    adopted[o.name] = t;
  }
  for (auto& [n, t] : adopted) merged[n] = t, set.push_back(n);
  return true;
}

/// The inputs of one layer entry as golden tensors. Entry 1 gives every
/// input; a later entry only those it draws anew (its router gate, bias).
/// With combine.buffer alias_x_offset the output starts alias_offset
/// elements into x and runs past its end: those elements are input too, as
/// x_tail.
void golden_inputs(const Case& c, const std::string& prefix, const Board& board, const Board* first,
                   std::vector<GoldenTensor>& out) {
  for (int r = 0; r < c.ep; ++r)
    for (const auto& [n, t] : board.ranks[size_t(r)]) {
      if (first && first->has(n, r) && checksum(first->at(n, r)) == checksum(t)) continue;
      out.push_back({n, prefix + "inputs", "input", r, t, layout_of(n)});
      if (n == "x" && c.combine.buffer == OutBuffer::alias_x_offset) {
        const Tensor tail = t.view(t.type, {c.combine.alias_offset}, t.offset_bytes + t.bytes());
        out.push_back({"x_tail", prefix + "inputs", "input", r, tail, layout_of("x_tail")});
      }
    }
}

/// A check's tensor "name@rank" (or "name": rank 0) as its name and rank.
std::pair<std::string, int> tensor_and_rank(const Check& ch) {
  const auto [name, rank] = split_tensor_rank(ch.tensor);
  return {name, std::max(rank, 0)};
}

/// The pipeline of one layer entry (see run_external), its stages labelled
/// prefix + slot.
struct ExternalEntry {
  const Case& c;
  std::string prefix;
  const ActualFn* actual;
  std::vector<GoldenTensor>* golden;
  const ExternalOptions& opt;
  CaseReport& rep;
  int64_t expected_total = 0, checked = 0;
  std::vector<std::string> not_checked, partly;

  /// Runs slot `s` on `board`; false when the check cannot go on.
  bool stage(const Stage& s, Board& board);
  void run(Board& board);

 private:
  void mark_row_consequences();
  void mark_right_on_right_inputs(const Stage& s, size_t first_check,
                                  const std::vector<std::map<std::string, Tensor>>& given);
  bool run_reference(const Stage& s, const Board& board, Board& refout);
  void read_given(const Stage& s, const std::vector<std::map<std::string, Tensor>>& expected, const Board& fed,
                  Board& merged, std::vector<std::map<std::string, Tensor>>& given);
  void feed_next(const Stage& s, size_t first_check, const Board& fed,
                 const std::vector<std::map<std::string, Tensor>>& given,
                 const std::vector<std::map<std::string, Tensor>>& expected, Board& merged);
  void feed_reference_metadata(size_t first_check, const std::vector<std::map<std::string, Tensor>>& given,
                               const std::vector<std::map<std::string, Tensor>>& expected, const std::string& slot,
                               const std::vector<std::set<std::string>>& own_order, Board& merged);

 public:
  /// The stage after which the board pairs the reference's index metadata
  /// with the implementation's wrong rows ("" while consistent): later
  /// verdicts of the implementation's values are not judged.
  std::string inconsistent_since;
  std::string inconsistent_why;  // what is paired with what, for the notes
  /// Per rank, every tensor the implementation wrote so far (by name).
  std::vector<std::set<std::string>> written;
};

bool ExternalEntry::run_reference(const Stage& s, const Board& board, Board& refout) {
  bool failed_before = false;
  for (const auto& ch : rep.checks) failed_before = failed_before || ch.outcome == Outcome::INCORRECT;
  RefCtx rc{c, board, refout};
  try {
    s.ref(rc);
    return true;
  } catch (const std::exception& e) {
    // Outputs of a wrong earlier stage can contradict each other (counts
    // that do not match the rows): the reference cannot be fed them. That
    // is part of the earlier failure; otherwise it is an ERROR.
    Check ch;
    ch.slot = s.slot;
    ch.variant = actual ? "actual" : "reference";
    ch.tensor = "-";
    ch.outcome = failed_before ? Outcome::INCORRECT : Outcome::ERROR;
    ch.note = std::string("the reference cannot run on the previous stages' outputs: ") + e.what() +
              (failed_before ? " (an earlier stage is already INCORRECT)" : "");
    rep.checks.push_back(ch);
    rep.notes.push_back("the check stopped at stage " + prefix + s.slot);
    return false;
  }
}

/// The expert-stage outputs in the padded group layout (docs/contract.md §4)
/// that an implementation may hand over in a longer buffer: GroupedExperts
/// allocates max_len rows and never reads those past the real groups.
bool padded_buffer(const std::string& file) {
  for (const char* p : {"align_pad.expert_input.", "experts.expert_output.", "experts.expert_h13.",
                        "experts.expert_hidden."})
    if (file.rfind(p, 0) == 0) return true;
  return false;
}

/// A padded buffer with more rows than the layout: judged on its first rows
/// (the layout's), the rows past them ignored and said so.
void trim_padded(const std::string& path, const Tensor& expected, ActualTensor& r) {
  // The layout's rows only: the rest of the buffer is never read.
  Tensor t = read_npy(path, expected.type, r.shape, nullptr, expected.shape.at(0));
  r.note = std::to_string(r.shape[0] - expected.shape[0]) + " rows past its " + std::to_string(expected.shape[0]) +
           " rows in the padded group layout ignored (a longer buffer, such as GroupedExperts' max_len rows: never "
           "read)";
  r.t = t;
  r.kind = ActualTensor::Kind::present;
  r.shape.clear();
}

/// "rank 1" or "ranks 0, 2".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

/// The stages that move rows between EP ranks. At EP 1 each is an identity
/// (the rows stay on their rank; one rank's permute leaves its groups as
/// they are), which an implementation without expert parallelism need not
/// write: `--require all` does not ask for them there (naming one does).
bool rank_exchange(const std::string& slot) {
  static const std::set<std::string> s = {"ep_dispatch",     "ep_permute",     "ep_unpermute",     "ep_combine",
                                          "ep_dispatch_bwd", "ep_permute_bwd", "ep_unpermute_bwd", "ep_combine_bwd"};
  return s.count(slot) > 0;
}

/// INCORRECT at `slot`: tensor `name` missing on `absent_on`; written on
/// `written_on` (a partial run) or, when that is empty, on no rank although
/// --require asks for the stage.
Check missing_check(const std::string& slot, const std::string& name, const std::vector<int>& absent_on,
                    const std::vector<int>& written_on) {
  Check ch;
  ch.slot = slot;
  ch.variant = "actual";
  ch.tensor = name;
  ch.outcome = Outcome::INCORRECT;
  ch.absent = true;
  ch.note = "missing on " + ranks_text(absent_on) +
            (written_on.empty() ? " (required by --require)"
                                : ", written on " + ranks_text(written_on) + ": a partial run (a rank that crashed or "
                                  "stopped before writing?)");
  return ch;
}

void ExternalEntry::read_given(const Stage& s, const std::vector<std::map<std::string, Tensor>>& expected,
                               const Board& fed, Board& merged, std::vector<std::map<std::string, Tensor>>& given) {
  const int R = c.ep;
  std::set<std::string> missing;
  int64_t written = 0;
  const bool required = std::find(opt.require.begin(), opt.require.end(), s.slot) != opt.require.end() &&
                        (opt.require_named.count(s.slot) || R > 1 || !rank_exchange(s.slot));
  // Row-count checks wait for the stage's other outputs: the counts that
  // group a tensor's rows may come after it (expert_input, expert_counts).
  struct RowsDiffer { const OutputSpec* o; int r; const Tensor* expected; std::vector<int64_t> shape; };
  std::vector<RowsDiffer> rows_differ;
  for (const OutputSpec& o : s.outputs) {
    std::vector<int> absent_on, written_on;
    for (int r = 0; r < R; ++r) {
      auto e = expected[size_t(r)].find(o.name);
      if (e == expected[size_t(r)].end()) continue;
      ++expected_total;
      ActualTensor a = (*actual)(golden_file(prefix + s.slot, o.name, r), e->second);
      if (a.kind == ActualTensor::Kind::absent) {
        missing.insert(o.name);
        absent_on.push_back(r);
        continue;
      }
      written_on.push_back(r);
      if (!a.note.empty())
        rep.notes.push_back("stage " + prefix + s.slot + ": " + o.name + " on rank " + std::to_string(r) + ": " + a.note);
      ++written;
      ++checked;
      if (a.kind == ActualTensor::Kind::rows_differ) {
        rows_differ.push_back({&o, r, &e->second, a.shape});
      } else {
        given[size_t(r)][o.name] = a.t;
        merged.ranks[size_t(r)][o.name] = a.t;
      }
    }
    // Written on some ranks only (a rank that crashed or stopped), or not at
    // all where --require asks for it: INCORRECT, never a silent pass.
    if (!absent_on.empty() && (!written_on.empty() || required))
      rep.checks.push_back(missing_check(s.slot, o.name, absent_on, written_on));
  }
  for (const RowsDiffer& d : rows_differ)
    rep.checks.push_back(rows_check(s.slot, *d.o, d.r, R, *d.expected, d.shape, fed.ranks[size_t(d.r)],
                                    given[size_t(d.r)]));
  if (missing.empty()) return;
  std::string m;
  for (const auto& n : missing) m += (m.empty() ? "" : ", ") + n;
  if (written == 0) not_checked.push_back(prefix + s.slot);
  else partly.push_back(prefix + s.slot + " (" + m + ")");
}

/// Stage isolation: the next stage's reference is fed the implementation's
/// outputs, except wrong index metadata (ids, counts, splits, row maps): the
/// reference indexes rows with it, so wrong counts would make it read past
/// its buffers. Those are replaced by the reference's, and said.
void ExternalEntry::feed_reference_metadata(size_t first_check, const std::vector<std::map<std::string, Tensor>>& given,
                                            const std::vector<std::map<std::string, Tensor>>& expected,
                                            const std::string& slot, const std::vector<std::set<std::string>>& own_order,
                                            Board& merged) {
  const int R = c.ep;
  bool metadata_replaced = false, wrong_rows_kept = false, ids_beside_own_scores = false;
  for (size_t i = first_check; i < rep.checks.size(); ++i) {
    const Check& ch = rep.checks[i];
    if (ch.outcome == Outcome::PASSED) continue;
    const auto [name, r] = tensor_and_rank(ch);
    if (r < 0 || r >= R || own_order[size_t(r)].count(name)) continue;
    auto e = expected[size_t(r)].find(name);
    if (e == expected[size_t(r)].end()) continue;
    auto g = given[size_t(r)].find(name);
    const bool rows = ch.rows.expected >= 0;
    if (!rows && (g == given[size_t(r)].end() || (g->second.type != ElemType::i32 && g->second.type != ElemType::i64))) {
      // A wrong tensor of values, fed on as the implementation's.
      wrong_rows_kept = wrong_rows_kept || (g != given[size_t(r)].end() && ch.outcome == Outcome::INCORRECT);
      continue;
    }
    metadata_replaced = metadata_replaced || !rows;
    // The implementation's top-K scores belong to its own ids, slot by
    // slot: beside the reference's ids they are a pair no stage computes.
    if (name == "ids" && given[size_t(r)].count("topk_scores")) ids_beside_own_scores = true;
    merged.ranks[size_t(r)][name] = e->second;
    rep.notes.push_back("stage " + prefix + slot + ": the implementation's " + ch.tensor + " is wrong; later stages are fed the reference's" +
                        (rows ? " (its rows differ)" : " (index metadata)"));
  }
  if (metadata_replaced && (wrong_rows_kept || ids_beside_own_scores) && inconsistent_since.empty()) {
    inconsistent_since = prefix + slot;
    inconsistent_why = wrong_rows_kept ? "its index metadata fed on is the reference's, its wrong values yours"
                                       : "its ids fed on are the reference's, its top-K scores yours, of its own ids";
    rep.notes.push_back("stage " + prefix + slot + ": " + inconsistent_why +
                        ": later stages that disagree are not judged (inputs inconsistent)");
  }
}

/// What the next stage is fed after stage `s` was judged: a later stage fed
/// inconsistent inputs is not judged (inconsistent_since); a dispatch in
/// another row order within each expert is followed in that order
/// (adopt_own_row_order); wrong index metadata is replaced by the
/// reference's (feed_reference_metadata).
void ExternalEntry::feed_next(const Stage& s, size_t first_check, const Board& fed,
                              const std::vector<std::map<std::string, Tensor>>& given,
                              const std::vector<std::map<std::string, Tensor>>& expected, Board& merged) {
  const int R = c.ep;
  // Fed the reference's row metadata beside the implementation's wrong rows
  // (an earlier stage), the reference's values here mean nothing.
  if (!inconsistent_since.empty())
    for (size_t i = first_check; i < rep.checks.size(); ++i) {
      Check& ch = rep.checks[i];
      if (ch.outcome != Outcome::INCORRECT || ch.rows.expected >= 0 || ch.absent) continue;
      ch.outcome = Outcome::NOT_VERIFIED;
      ch.note = "not judged: inputs inconsistent with stage " + inconsistent_since + " (" + inconsistent_why + ")" +
                (ch.note.empty() ? "" : "; " + ch.note);
    }
  std::vector<std::set<std::string>> own_order(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    std::vector<std::string> set;
    if (!adopt_own_row_order(s, fed.ranks[size_t(r)], given[size_t(r)], expected[size_t(r)], merged.ranks[size_t(r)],
                             set))
      continue;
    // Every dispatch output is now in the implementation's order: none is
    // replaced by the reference's own below.
    for (const OutputSpec& o : s.outputs) own_order[size_t(r)].insert(o.name);
    std::string names;
    for (const auto& n : set) names += (names.empty() ? "" : ", ") + n;
    rep.notes.push_back("stage " + prefix + s.slot + (R > 1 ? " rank " + std::to_string(r) : "") +
                        ": the implementation's rows are the reference's in another order within each expert; "
                        "later stages are judged in its order (its token_sorted" +
                        (names.empty() ? "" : "; the reference's " + names + " in that order") + ")");
  }
  feed_reference_metadata(first_check, given, expected, s.slot, own_order, merged);
}

/// Routing that wrote its ids but not its counts: the counts fed on are the
/// histogram of the ids fed on (called after feed_next): the
/// implementation's where they were accepted, not the reference's (whose
/// ids may be another valid choice among tied scores, docs/contract.md §15),
/// so the next stages see one routing, the implementation's; the
/// reference's where its ids were wrong and replaced, so that ids and
/// counts fed on never disagree (ids all out of range once left counts of
/// zero beside the reference's ids, and the combine's reference read past
/// its rows).
void counts_from_fed_ids(const std::vector<std::map<std::string, Tensor>>& given, Board& merged) {
  for (size_t r = 0; r < given.size(); ++r) {
    if (!given[r].count("ids") || given[r].count("counts") || !merged.ranks[r].count("counts")) continue;
    std::vector<int64_t> hist(size_t(merged.ranks[r].at("counts").numel()), 0);
    for (int64_t e : to_ints(merged.ranks[r].at("ids")))
      if (e >= 0 && e < int64_t(hist.size())) ++hist[size_t(e)];
    merged.ranks[r]["counts"] = from_ints(hist, ElemType::i64, {int64_t(hist.size())});
  }
}

/// The capacity stage judged on the implementation's choice among rows tied
/// exactly at an expert's capacity, on each rank where it made another
/// (adopt_capacity_ties): accepted, and said.
void adopt_capacity_choices(const Case& c, const std::string& stage, const Board& board,
                            const std::vector<std::map<std::string, Tensor>>& given,
                            std::vector<std::map<std::string, Tensor>>& expected, CaseReport& rep) {
  const int R = int(given.size());
  for (int r = 0; r < R; ++r)
    if (adopt_capacity_ties(c, board.ranks[size_t(r)], given[size_t(r)], expected[size_t(r)])) {
      ++rep.accepted_ties;
      rep.notes.push_back("stage " + stage + (R > 1 ? " rank " + std::to_string(r) : "") +
                          ": the implementation keeps other rows among scores tied exactly at an expert's "
                          "capacity (accepted; judged on its choice)");
    }
}

/// The error scale `check` judges output o of rank r with: the one derived
/// beside it (OutputSpec::from_fast, in `derived`), or one that depends on
/// whether the implementation wrote o.own_input (OutputSpec::magnitude_own)
/// into `own`; null: check_output's own (OutputSpec::magnitude).
const Tensor* external_scale(const Case& c, const OutputSpec& o, int r, int R,
                             const std::map<std::string, Tensor>& derived, const RankBoard& merged,
                             const std::set<std::string>& written, Tensor& own) {
  auto d = derived.find(o.name);
  if (d != derived.end()) return &d->second;
  if (!o.magnitude_own) return nullptr;
  own = o.magnitude_own(c, merged, r, R, written.count(o.own_input) > 0);
  return &own;
}

/// An output judged a second time on the implementation's own input
/// (OutputSpec::on_own: the SwiGLU output on its H), where it wrote both:
/// the rounding points between them.
void judge_on_own(const Case& c, const std::string& slot, const OutputSpec& o,
                  const std::vector<std::map<std::string, Tensor>>& given, const Board& merged, CaseReport& rep) {
  const int R = int(given.size());
  for (int r = 0; r < R && o.on_own; ++r) {
    auto gi = given[size_t(r)].find(o.name);
    if (gi == given[size_t(r)].end() || !given[size_t(r)].count(o.on_own_input)) continue;
    Tensor scale;
    const Tensor expect = o.on_own(c, merged.ranks[size_t(r)], r, R, scale);
    if (expect.shape.empty()) continue;
    OutputSpec spec = o;
    spec.cls = CompareClass::rounding;
    spec.cls_for = nullptr;
    rep.checks.push_back(check_output(c, slot, "actual", spec, &gi->second, &expect, merged.ranks[size_t(r)], r, R,
                                      "ref on its " + o.on_own_input.substr(o.on_own_input.find('_') + 1), &scale));
  }
}

bool ExternalEntry::stage(const Stage& s, Board& board) {
  const int R = c.ep;
  rep.decisions.push_back({s.slot, actual ? "actual" : "reference", true, true, "", {}});
  Board refout;
  refout.ranks.resize(size_t(R));
  if (!run_reference(s, board, refout)) return false;
  Board merged = board;
  for (int r = 0; r < R; ++r)
    for (auto& [n, t] : refout.ranks[size_t(r)]) merged.ranks[size_t(r)][n] = t;
  // Expected outputs: the reference's; an intermediate checked on the
  // implementation's own inputs (the SwiGLU activation H) is derived from
  // the board's h13: the reference's here, the implementation's once read.
  std::vector<std::map<std::string, Tensor>> expected(static_cast<size_t>(R)), scales(static_cast<size_t>(R));
  // (h13 of the implementation's only where it wrote one: else the scale
  // also allows what a correct h13 of its own may differ by)
  auto h13_of = [](const OutputSpec& o) { return o.name.substr(0, o.name.size() - std::string("hidden").size()) + "h13"; };
  auto derive = [&](const OutputSpec& o, int r, bool own) {
    if (!merged.has(h13_of(o), r)) return;
    Tensor scale;
    expected[size_t(r)][o.name] = o.from_fast(c, merged.ranks[size_t(r)], r, R, own, scale);
    scales[size_t(r)][o.name] = scale;
  };
  for (const OutputSpec& o : s.outputs)
    for (int r = 0; r < R; ++r) {
      if (o.from_fast) derive(o, r, true);  // the expected values; the scale is derived again once read
      else if (refout.ranks[size_t(r)].count(o.name)) expected[size_t(r)][o.name] = refout.ranks[size_t(r)].at(o.name);
    }
  if (golden)
    for (const OutputSpec& o : s.outputs)
      for (int r = 0; r < R; ++r)
        if (expected[size_t(r)].count(o.name))
          golden->push_back({o.name, prefix + s.slot, "expected", r, expected[size_t(r)].at(o.name), layout_of(o.name)});
  if (!actual) {
    for (int r = 0; r < R; ++r)
      for (auto& [n, t] : expected[size_t(r)]) merged.ranks[size_t(r)][n] = t;
    board = std::move(merged);
    return true;
  }
  std::vector<std::map<std::string, Tensor>> given(static_cast<size_t>(R));
  const size_t first_check = rep.checks.size();
  const Board fed = merged;  // what the reference saw, and its outputs
  try {
    read_given(s, expected, fed, merged, given);
  } catch (const Error& e) {
    if (e.kind != ErrorKind::bad_input) throw;
    rep.bad_input = e.what();
    Check ch;
    ch.slot = s.slot;
    ch.variant = "actual";
    ch.tensor = "-";
    ch.outcome = Outcome::ERROR;
    ch.note = std::string("bad input: ") + e.what();
    rep.checks.push_back(ch);
    rep.notes.push_back("the check stopped at stage " + prefix + s.slot + ": a file of the implementation was refused (its line ends the output; exit 2)");
    return false;
  }
  if (s.slot == "capacity" && !opt.strict_ties) adopt_capacity_choices(c, prefix + s.slot, board, given, expected, rep);
  for (const OutputSpec& o : s.outputs)
    for (int r = 0; r < R; ++r)
      if (o.from_fast && given[size_t(r)].count(o.name)) derive(o, r, given[size_t(r)].count(h13_of(o)) > 0);
  if (s.slot == "routing") {
    check_routing_external(c, refout, merged, given, opt, rep);
  } else {
    for (const OutputSpec& o : s.outputs)
      for (int r = 0; r < R; ++r) {
        auto gi = given[size_t(r)].find(o.name);
        if (gi == given[size_t(r)].end()) continue;
        Tensor own_scale;
        const Tensor* scale =
            external_scale(c, o, r, R, scales[size_t(r)], merged.ranks[size_t(r)], written[size_t(r)], own_scale);
        // The dispatch gathers the top-K scores bit for bit; where the
        // implementation did not write its own, it gathered scores the
        // reference's may differ from within the scores tolerance (routing
        // is judged so), and its gather is judged within that tolerance.
        const bool own_scores = written[size_t(r)].count("topk_scores") > 0;
        const bool loose = s.slot == "dispatch" && o.name == "score_sorted" && !own_scores;
        OutputSpec spec = o;
        if (loose) spec.cls = CompareClass::scores;
        Check ch = check_output(c, s.slot, "actual", spec, &gi->second, &expected[size_t(r)].at(o.name),
                                merged.ranks[size_t(r)], r, R,
                                !o.from_fast                         ? std::string("reference")
                                : given[size_t(r)].count(h13_of(o)) ? o.from_fast_label
                                                                     : std::string("ref on reference h13"),
                                scale);
        if (loose)
          ch.note += std::string(ch.note.empty() ? "" : "; ") +
                     "judged within the scores tolerance: the implementation's own routing.topk_scores were not "
                     "written, and the reference's, gathered here, may differ from them within it";
        rep.checks.push_back(ch);
      }
    for (const OutputSpec& o : s.outputs) judge_on_own(c, s.slot, o, given, merged, rep);
  }
  for (int r = 0; r < R; ++r)
    for (const auto& [n, t] : given[size_t(r)]) written[size_t(r)].insert(n);
  mark_right_on_right_inputs(s, first_check, given);
  feed_next(s, first_check, fed, given, expected, merged);
  if (s.slot == "routing") counts_from_fed_ids(given, merged);
  board = std::move(merged);
  return true;
}

/// After a stage that failed, a later one is judged on the inputs fed on,
/// the implementation's wrong ones included. Where its output is, bit for
/// bit, the exported expected one (the reference's own chain), it is right
/// on right inputs: it undid the earlier stage's layout (a source-major
/// permute, then its own unpermute). Such a check stays INCORRECT, marked a
/// consequence of the first failing stage.
void ExternalEntry::mark_right_on_right_inputs(const Stage& s, size_t first_check,
                                               const std::vector<std::map<std::string, Tensor>>& given) {
  if (!opt.equals_exported) return;
  std::string cause;
  // (a missing output is fed on as the reference's: never the cause)
  for (size_t i = 0; i < first_check && cause.empty(); ++i)
    if (rep.checks[i].outcome == Outcome::INCORRECT && !rep.checks[i].absent) cause = rep.checks[i].slot;
  if (cause.empty()) return;
  for (size_t i = first_check; i < rep.checks.size(); ++i) {
    Check& ch = rep.checks[i];
    if (ch.outcome != Outcome::INCORRECT || ch.absent || ch.rows.expected >= 0 || !ch.consequence_of.empty()) continue;
    const auto [name, r] = tensor_and_rank(ch);
    if (r < 0 || r >= int(given.size())) continue;
    const auto g = given[size_t(r)].find(name);
    if (g == given[size_t(r)].end()) continue;
    if (!opt.equals_exported(golden_file(prefix + s.slot, name, r), g->second)) continue;
    ch.consequence_of = prefix + cause;
    ch.note += std::string(ch.note.empty() ? "" : "; ") + "a consequence of stage " + ch.consequence_of +
               ": yours equals the exported expected output bit for bit (right on right inputs), and differs "
               "only from the reference fed stage " + ch.consequence_of + "'s wrong outputs";
  }
}

void ExternalEntry::run(Board& board) {
  written.assign(size_t(c.ep), {});
  for (const std::string& slot : slot_order()) {
    const Stage* s = stage_for(c, slot);
    if (s && !stage(*s, board)) break;
  }
  mark_row_consequences();
}

/// A stage whose rows differ from the reference's is fed the reference's
/// rows; the implementation's later stages were built on its own, so they
/// differ by the same rows. Such a later row-count failure (the same count
/// off, on the same rank) is marked a consequence of the first.
void ExternalEntry::mark_row_consequences() {
  std::map<int, std::pair<int64_t, std::string>> first;  // rank -> (rows off, stage)
  for (Check& ch : rep.checks) {
    if (ch.outcome != Outcome::INCORRECT || ch.rows.expected < 0) continue;
    const int r = tensor_and_rank(ch).second;
    const int64_t off = ch.rows.actual - ch.rows.expected;
    auto f = first.find(r);
    if (f == first.end()) {
      first[r] = {off, ch.slot};
      continue;
    }
    if (f->second.second == ch.slot || f->second.first != off) continue;
    ch.consequence_of = prefix + f->second.second;
    ch.note += "; a consequence of stage " + ch.consequence_of + "'s rows (the first cause there: " +
               std::to_string(off < 0 ? -off : off) + " row" + (off == 1 || off == -1 ? "" : "s") +
               (off < 0 ? " short" : " too many") + " as here)";
  }
}

}  // namespace

CaseReport run_external(const Case& given, const ActualFn* actual, std::vector<GoldenTensor>* golden,
                        const ExternalOptions& opt) {
  // A golden folder holds every input as .npy, the routed weights included:
  // streamed weights are written, and read back, whole. A streamed run
  // computes what the held one does byte for byte (tests/test_streamed.cpp),
  // so a case whose weights fit kExportWeightBytes is exported held; a larger
  // one is refused rather than written as gigabytes of .npy.
  constexpr double kExportWeightBytes = 256.0 * (1 << 20);
  Case c = given;
  const bool held_here = c.streams_weights();
  if (held_here && c.routed_weight_bytes() > kExportWeightBytes)
    bad_input(c.source + ": case " + printable(c.name) + ": the routed weights are streamed (experts.weights; " +
              std::to_string(int64_t(c.routed_weight_bytes()) >> 20) +
              " MiB in all), and export and check exchange every input as .npy (up to 256 MiB of routed weights); "
              "valid: a smaller case (experts, hidden, ffn), or experts.weights held with the memory for it");
  if (held_here) c.experts.weights = WeightStorage::held;
  const auto t0 = std::chrono::steady_clock::now();
  CaseReport rep;
  rep.c = c;
  if (held_here)
    rep.notes.push_back("experts.weights: streamed in `run`; written whole here (" +
                        std::to_string(int64_t(c.routed_weight_bytes()) >> 20) +
                        " MiB of routed weights; a streamed run computes the same bytes)");
  const int R = c.ep;
  Board first;
  int64_t expected_total = 0, checked = 0;
  std::vector<std::string> not_checked, partly;
  // Layer entries (docs/contract.md §12) one after another, each its own pipeline
  // with its own router weights; entry l >= 2 is labelled "layer<l>/".
  for (int l = 0; l < c.layers; ++l) {
    Case cl = c;
    cl.layer = l;
    const std::string prefix = c.layers > 1 && l > 0 ? "layer" + std::to_string(l + 1) + "/" : "";
    Board board;
    board.ranks.resize(size_t(R));
    for (int r = 0; r < R; ++r) board.ranks[size_t(r)] = make_inputs(cl, r, cl.tokens_on(r));
    if (golden) golden_inputs(cl, prefix, board, l > 0 ? &first : nullptr, *golden);
    if (l == 0) first = board;
    CaseReport rl;
    ExternalEntry entry{cl, prefix, actual, golden, opt, rl, 0, 0, {}, {}, {}, {}, {}};
    entry.run(board);
    for (auto& ch : rl.checks) ch.slot = prefix + ch.slot, rep.checks.push_back(std::move(ch));
    for (auto& d : rl.decisions) d.slot = prefix + d.slot, rep.decisions.push_back(std::move(d));
    for (auto& n : rl.notes) rep.notes.push_back(n);
    rep.accepted_ties += rl.accepted_ties;
    if (!rl.bad_input.empty()) rep.bad_input = rl.bad_input;
    expected_total += entry.expected_total;
    if (!rep.bad_input.empty()) break;
    checked += entry.checked;
    not_checked.insert(not_checked.end(), entry.not_checked.begin(), entry.not_checked.end());
    partly.insert(partly.end(), entry.partly.begin(), entry.partly.end());
  }
  if (actual && rep.bad_input.empty()) {
    auto joined = [L = c.layers](const std::vector<std::string>& v) { return stage_list(v, L); };
    std::ostringstream cov;
    cov << "coverage: " << checked << " of " << expected_total << " expected tensors written and checked";
    if (!partly.empty()) cov << "; stages partly written (missing tensors in parentheses): " << joined(partly);
    if (!not_checked.empty())
      cov << "; stages not written (the reference's outputs fed the next stage): " << joined(not_checked);
    rep.notes.push_back(cov.str());
    rep.coverage = {true, expected_total, checked, partly, not_checked};
    if (checked == 0) {
      Check ch;
      ch.slot = "-";
      ch.variant = "actual";
      ch.tensor = "-";
      ch.outcome = Outcome::NOT_VERIFIED;
      ch.note = "no actual output file matches a stage output of the manifest: nothing was checked";
      rep.checks.push_back(ch);
    }
    if (opt.require_all && c.ep == 1)
      rep.notes.push_back("--require all at EP 1: the stages that move rows between ranks (ep_dispatch, ep_permute, "
                          "ep_unpermute, ep_combine and their backward) are identities here and not required; "
                          "--require all,ep_dispatch,... names them to require them");
    // A stage --require names that this case does not run: what the
    // requirement asks for was not checked, so the case cannot pass.
    for (const std::string& slot : opt.require_named) {
      if (stage_for(c, slot)) continue;
      Check ch;
      ch.slot = slot;
      ch.variant = "actual";
      ch.tensor = "-";
      ch.outcome = Outcome::NOT_VERIFIED;
      ch.note = "required by --require, but this case has no stage " + slot +
                " (its configuration does not run it: see `moeverify list`); nothing of it was checked";
      rep.checks.push_back(ch);
    }
  }
  for (const auto& ch : rep.checks) rep.outcome = worst(rep.outcome, ch.outcome);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

/// cmd_check refuses a missing --actual folder up front.
CaseReport check_case_folder(const std::string& folder, const std::string& actual_dir, const CheckArgs& a) {
  const golden::Manifest manifest = golden::read_manifest(folder);
  const Case& c = manifest.c;
  // No folder: nothing written, nothing to judge; under --require it is
  // judged as an empty folder (each required stage missing).
  const bool none = !golden::is_dir(actual_dir);
  if (none && a.external.require.empty()) {
    CaseReport rep;
    rep.c = c;
    Check ch;
    ch.slot = "-";
    ch.variant = "actual";
    ch.tensor = "-";
    ch.outcome = Outcome::NOT_VERIFIED;
    ch.note = "no folder " + printable(actual_dir, 200) + ": the implementation wrote no outputs for this case";
    rep.checks.push_back(ch);
    rep.outcome = ch.outcome;
    return rep;
  }
  const std::set<std::string> expected_files = golden::expected_files(manifest.tensors);
  std::vector<std::string> ignored;
  const std::set<std::string> present =
      none ? std::set<std::string>{} : golden::actual_files(actual_dir, expected_files, a.allow_unknown, ignored);
  std::map<std::string, Tensor> loaded;
  const ActualFn fn = [&](const std::string& f, const Tensor& expected) {
    ActualTensor r;
    if (!present.count(f)) return r;
    std::vector<int64_t> rows;
    r.t = read_npy(actual_dir + "/" + f, expected.type, expected.shape, &rows);
    r.kind = rows.empty() ? ActualTensor::Kind::present : ActualTensor::Kind::rows_differ;
    r.shape = rows;
    if (!rows.empty() && padded_buffer(f) && rows[0] > expected.shape[0]) trim_padded(actual_dir + "/" + f, expected, r);
    return r;
  };
  ExternalOptions opt = a.external;
  opt.equals_exported = [&](const std::string& f, const Tensor& yours) {
    const std::string p = folder + "/" + f;
    struct stat st {};
    if (stat(p.c_str(), &st) != 0) return false;
    try {
      const Tensor t = read_npy(p, yours.type, yours.shape);
      return t.bytes() == yours.bytes() && std::memcmp(t.data(), yours.data(), size_t(t.bytes())) == 0;
    } catch (const Error&) {  // the exported file unreadable: no claim either way
      return false;
    }
  };
  CaseReport rep = run_external(c, &fn, nullptr, opt);
  if (!ignored.empty()) {
    std::string l;
    for (const auto& n : ignored) l += (l.empty() ? "" : ", ") + n;
    rep.notes.push_back("ignored (--allow-unknown; no expected tensor has these names): " + l);
  }
  return rep;
}

/// The end of a check that did not pass: each failing case folder, its
/// first check that did not pass (the stage where the fault shows first)
/// with its note, and the command that checks that folder alone.
void print_check_failures(const std::vector<CaseReport>& reports,
                          const std::vector<std::pair<std::string, std::string>>& folders, const CheckArgs& a,
                          std::ostream& out) {
  print_failure_list(reports, [&](size_t i, const CaseReport& r, const Check* first, std::ostream& out) {
    if (first) out << " at " << first->slot << " / " << first->tensor;
    if (first && !first->note.empty()) out << " (" << printable(first->note, 160) << ")";
    int64_t by_rows = 0, right = 0;  // the two kinds of consequence (mark_row_consequences, mark_right_on_right_inputs)
    // the stages the consequences follow; other stages with wrong values of
    // their own; stages missing (required)
    std::vector<std::string> causes, others, missing;
    const auto add_once = [](std::vector<std::string>& v, const std::string& s) {
      if (std::find(v.begin(), v.end(), s) == v.end()) v.push_back(s);
    };
    for (const Check& ch : r.checks) {
      if (!ch.consequence_of.empty()) {
        (ch.rows.expected >= 0 ? by_rows : right) += 1;
        add_once(causes, ch.consequence_of);
      } else if (first && ch.outcome == Outcome::INCORRECT && ch.slot != first->slot) {
        add_once(ch.absent ? missing : others, ch.slot);
      }
    }
    std::string of;  // "of the first", or of the stages they follow where that is another
    for (const auto& c : causes) of += (of.empty() ? "" : ", ") + c;
    of = first && causes.size() == 1 && causes[0] == first->slot ? "of the first" : "of stage " + of;
    if (!others.empty()) {
      out << "\n      also wrong on its own at:";
      for (size_t k = 0; k < others.size(); ++k) out << (k ? ", " : " ") << others[k];
    }
    if (!missing.empty()) out << "\n      and " << missing.size() << " more stage(s) with outputs missing";
    if (by_rows)
      out << "\n      then " << by_rows << " later check(s) off by the same rows: consequences " << of
          << ", marked in the report";
    if (right)
      out << "\n      then " << right << " later check(s) INCORRECT only on the wrong inputs fed on: their outputs "
          << "equal the exported expected ones (consequences " << of << ", marked in the report)";
    out << "\n      repro: " << self_command() << " check " << shell_word(folders[i].first);
    if (a.has_actual) out << " --actual " << shell_word(folders[i].second);
    if (!a.require.empty()) out << " --require " << shell_word(a.require);
    if (a.external.strict_ties) out << " --strict-ties";
    if (a.allow_unknown) out << " --allow-unknown";
  }, out);
}

void parse_require(const std::string& text, ExternalOptions& o) {
  const auto& slots = slot_order();
  std::stringstream ss(text);
  for (std::string st; std::getline(ss, st, ',');) {
    if (st == "all") {
      o.require_all = true;
      continue;
    }
    if (std::find(slots.begin(), slots.end(), st) == slots.end()) {
      std::string valid;
      for (const auto& n : slots) valid += (valid.empty() ? "" : ", ") + n;
      bad_input("--require " + printable(text, 200) + ": '" + printable(st, 60) + "' is not a stage; valid: all, " +
                "stage names separated by commas, or all with names (all,ep_dispatch): " + valid);
    }
    o.require_named.insert(st);
  }
  o.require = o.require_all ? slots : std::vector<std::string>(o.require_named.begin(), o.require_named.end());
}

/// The case folders of one DIR of `check` (one golden folder, or the folders
/// in it that hold a manifest, by name), each with its actual/ folder.
std::vector<std::pair<std::string, std::string>> check_folders(std::string dir, const CheckArgs& a) {
  if (dir.empty()) bad_input("check: the folder is empty; valid: a folder written by `moeverify export`");
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // DIR/ names its case folders DIR/CASE, not DIR//CASE
  std::vector<std::pair<std::string, std::string>> folders;  // (golden, actual)
  if (golden::is_file(dir + "/manifest.json")) {
    folders.push_back({dir, a.has_actual ? a.actual_dir : dir + "/actual"});
  } else if (golden::is_dir(dir)) {
    std::vector<std::string> subs, nested;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (!e.is_directory()) continue;
      const std::string p = e.path().string();
      if (golden::is_file(p + "/manifest.json")) {
        subs.push_back(e.path().filename().string());
        continue;
      }
      // A folder of case folders inside DIR (another export's): never
      // passed over in silence, as its cases would be.
      for (const auto& f : std::filesystem::directory_iterator(p))
        if (f.is_directory() && golden::is_file(f.path().string() + "/manifest.json")) {
          nested.push_back(p);
          break;
        }
    }
    std::sort(nested.begin(), nested.end());
    if (!nested.empty()) {
      std::string list;
      for (const auto& n : nested) list += (list.empty() ? "" : " ") + printable(n, 200);
      bad_input(printable(dir, 200) + " holds folders of case folders (" + list + "), which check does not look " +
                "into; valid: name them, e.g. moeverify check " + list);
    }
    std::sort(subs.begin(), subs.end());
    for (const auto& s : subs)
      folders.push_back({dir + "/" + s, a.has_actual ? a.actual_dir + "/" + s : dir + "/" + s + "/actual"});
  }
  if (folders.empty() && !golden::is_dir(dir))
    bad_input(printable(dir, 200) + (golden::is_file(dir) ? ": a file, not a folder" : ": no such folder") +
              "; valid: a folder written by `moeverify export`");
  if (folders.empty())
    bad_input(printable(dir, 200) + ": holds no manifest.json (nor folders that do); valid: a folder written by "
              "`moeverify export`");
  return folders;
}

int cmd_check(const CheckArgs& a) {
  if (a.has_actual && a.actual_dir.empty()) bad_input("--actual: the path is empty; valid: a folder of .npy files");
  if (a.has_actual && a.dirs.size() > 1)
    bad_input("--actual with " + std::to_string(a.dirs.size()) + " folders: it names the outputs of one; valid: one "
              "DIR with --actual, or several DIRs each with its own actual/ folders");
  if (a.want_json && a.json.empty()) bad_input("--json: the path is empty; valid: a file path such as report.json");
  CheckArgs args = a;
  if (!a.require.empty()) parse_require(a.require, args.external);
  if (a.has_actual && !golden::is_dir(a.actual_dir))
    bad_input("--actual " + printable(a.actual_dir, 200) + ": no such folder; valid: the folder holding the "
              "implementation's .npy files, named as in the manifest");
  // Each DIR is one golden folder (it holds manifest.json) or a folder of
  // them; a case folder two DIRs reach is judged once.
  std::vector<std::pair<std::string, std::string>> folders;
  std::set<std::string> seen;
  for (const std::string& d : a.dirs)
    for (auto& f : check_folders(d, a))
      if (seen.insert(std::filesystem::weakly_canonical(f.first).string()).second) folders.push_back(std::move(f));
  // the JSON's "file": the folder, or "(several)" as `run` says of its files
  std::string dir = a.dirs.size() == 1 ? a.dirs[0] : "(several)";
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (a.want_json) {
    std::vector<std::string> reads;
    for (const auto& [g, act] : folders) reads.insert(reads.end(), {g, act});
    check_output_file("--json", a.json, reads);
  }
  std::vector<CaseReport> reports;
  Outcome all = Outcome::PASSED;
  std::cout << "moeverify check: the reference fed the implementation's own previous-stage outputs "
               "(docs/contract.md §15)\n";
  for (const auto& [golden, act] : folders) {
    reports.push_back(check_case_folder(golden, act, args));
    reports.back().actual_dir = act;
    print_report(reports.back(), std::cout, a.verbose ? ReportDetail::every_check : ReportDetail::summary);
    all = worst(all, reports.back().outcome);
  }
  print_tolerance_table(reports, std::cout);
  size_t passed = 0;
  for (const auto& r : reports) passed += r.outcome == Outcome::PASSED;
  std::string bad;
  for (const auto& r : reports)
    if (bad.empty() && !r.bad_input.empty()) bad = r.bad_input;
  std::cout << "\n" << passed << " of " << reports.size() << " case(s) PASSED; overall " << outcome_name(all)
            << (bad.empty() ? "" : " (a file was refused: exit 2, as for any bad input)") << "\n";
  print_check_failures(reports, folders, a, std::cout);
  if (a.want_json) {
    ReportMeta meta;
    meta.schema = "moeverify-check/1";
    const std::string err = write_file(a.json, {reports_json(reports, dir, meta)});
    if (!err.empty()) bad_input("--json: " + err + "; valid: a writable file path such as report.json");
  }
  // What was judged before a malformed file is reported above; the run then
  // ends as bad input.
  if (!bad.empty()) bad_input(bad);
  return exit_status(all);
}

}  // namespace moev
