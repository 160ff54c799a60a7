// export and check (see export_check.h): the reference pipeline fed an
// implementation's own stage outputs, golden files, and the .npy reader.
#include "export_check.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "datagen.h"
#include "dump.h"
#include "error.h"
#include "memory_estimate.h"
#include "stages.h"

namespace moev {
namespace {

const char* real_dtype(ElemType t) {
  switch (t) {
    case ElemType::f32: return "float32";
    case ElemType::bf16: return "bfloat16";
    case ElemType::f16: return "float16";
    case ElemType::i32: return "int32";
    case ElemType::i64: return "int64";
  }
  return "?";
}

const char* npy_descr(ElemType t) {
  switch (t) {
    case ElemType::f32: return "<f4";
    case ElemType::bf16:
    case ElemType::f16: return "<u2";
    case ElemType::i32: return "<i4";
    case ElemType::i64: return "<i8";
  }
  return "?";
}

/// What a user needs to know to produce a tensor: its rows and their order.
std::string layout_of(const std::string& name) {
  static const std::map<std::string, std::string> m = {
      {"x", "(T, D) token rows"},
      {"wg", "(E, D) router weight; logits = x wg^T"},
      {"bias", "(E) fp32 selection bias"},
      {"w1", "(E, F, D) per expert; h1 = X w1^T"},
      {"w3", "(E, F, D) per expert; h3 = X w3^T"},
      {"w2", "(E, D, F) per expert; Y = H w2^T"},
      {"shared_w1", "(1, F, D)"},
      {"shared_w3", "(1, F, D)"},
      {"shared_w2", "(1, D, F)"},
      {"logits", "(T, E) fp32"},
      {"scores", "(T, E) softmax/sigmoid of logits, fp32"},
      {"ids", "(T, K) selected experts of each token; compared as a set per token (CONTRACT §15)"},
      {"topk_scores", "(T, K) score of ids[t, k], normalised and scaled"},
      {"counts", "(E) tokens per expert"},
      {"routed_input", "(T*K, D) expert-major, ascending token inside an expert (CONTRACT §2)"},
      {"token_sorted", "(T*K) token of each dispatch row"},
      {"score_sorted", "(T*K) score of each dispatch row"},
      {"row_of", "(T, K) dispatch row of assignment (t, k)"},
      {"input_splits", "(R) rows sent to each rank"},
      {"output_splits", "(R) rows received from each rank"},
      {"recv_counts", "(R, E_l) rows received from rank p for local expert j"},
      {"recv", "(M, D) received rows: source rank, then local expert, then the source's order (CONTRACT §3)"},
      {"overload", "(1) tokens received / balanced share"},
      {"permuted", "(M, D) expert-major: local expert, then source rank (CONTRACT §3)"},
      {"expert_counts_real", "(E_l) real rows per local expert"},
      {"expert_input", "(P, D) expert groups padded to a multiple of align with zero rows (CONTRACT §4)"},
      {"expert_counts", "(E_l) padded rows per local expert"},
      {"expert_output", "(P, D) expert outputs, same rows as expert_input"},
      {"expert_h13", "(P, 2F) [h1 | h3] per row"},
      {"expert_hidden", "(P, F) silu(h1) * h3 per row"},
      {"unpadded", "(M, D) expert outputs without the padding rows"},
      {"recv_out", "(M, D) expert outputs back in received (rank-major) order"},
      {"routed_output", "(T*K, D) expert outputs in dispatch row order"},
      {"shared_out", "(T, D) shared expert output"},
      {"shared_h13", "(T, 2F)"},
      {"shared_hidden", "(T, F)"},
      {"out", "(T, D) combined output"},
  };
  auto it = m.find(name);
  return it == m.end() ? "" : it->second;
}

std::string file_for(const std::string& name, int rank, int ranks) {
  return ranks > 1 ? name + ".rank" + std::to_string(rank) + ".npy" : name + ".npy";
}

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

/// CONTRACT §15 routing of an implementation: `scores` against the
/// reference; `ids` per token as a set, judged by the reference selection on
/// the implementation's own scores (the reference's when it wrote none):
/// every expert whose choice beats the K-th value must be in the set, and
/// every member must reach it, so any member of an exact tie is accepted.
/// Judged on the reference's scores, a member within the scores tolerance of
/// the K-th value is a near-tie: reported, not failed. topk_scores against
/// the reference's scores at the implementation's ids (in its order), counts
/// against the histogram of its ids.
void check_routing_external(const Case& c, const Board& ref, const Board& merged,
                            const std::vector<std::map<std::string, Tensor>>& given, CaseReport& rep) {
  const ref::RouterSpec spec = ref_router_spec(c);
  const int R = int(merged.ranks.size());
  const int64_t K = c.top_k, E = c.num_experts;
  for (int q = 0; q < R; ++q) {
    const auto& g = given[size_t(q)];
    const RankBoard& mb = merged.ranks[size_t(q)];
    const int64_t T = ref.at("scores", q).shape[0];
    const Tolerance stol = tolerance_for(c, CompareClass::scores);
    auto add = [&](const std::string& name, CompareClass cls, Coords co, const Tensor& f, const Tensor& r,
                   const std::string& against, const std::string& note) {
      const OutputSpec o(name, cls, co, nullptr);
      Check ch = check_output(c, "routing", "actual", o, &f, &r, mb, q, R, against);
      if (!note.empty()) ch.note += (ch.note.empty() ? "" : "; ") + note;
      rep.checks.push_back(ch);
    };
    const bool own_scores = g.count("scores") > 0;
    if (own_scores) add("scores", CompareClass::scores, Coords::token_expert, g.at("scores"), ref.at("scores", q), "reference", "");
    const ref::Vec ref_scores = to_floats(ref.at("scores", q));
    const ref::Vec judged = own_scores ? to_floats(g.at("scores")) : ref_scores;
    const ref::Ids ids_used = ref_ids(mb.at("ids"));
    if (g.count("ids")) {
      ref::Vec choice, ref_choice;
      ref::Ids sel, ref_sel;
      ref::select_experts(spec, judged, to_floats(mb.at("bias")), T, choice, sel);
      ref::select_experts(spec, ref_scores, to_floats(mb.at("bias")), T, ref_choice, ref_sel);
      ref::Ids expect(ids_used.size());
      int64_t ties = 0, near = 0, differs_from_ref = 0;
      for (int64_t t = 0; t < T; ++t) {
        const int32_t* a = &ids_used[size_t(t * K)];
        const int32_t* s = &sel[size_t(t * K)];
        const float* ch = &choice[size_t(t * E)];
        const std::set<int32_t> aset(a, a + K), sset(s, s + K), rset(&ref_sel[size_t(t * K)], &ref_sel[size_t(t * K)] + K);
        bool in_range = int64_t(aset.size()) == K;
        for (int32_t e : aset) in_range = in_range && e >= 0 && e < E;
        const bool force_lb = spec.selection == ref::Selection::force_load_balance;
        bool ok = aset == sset, is_near = false;
        if (!ok && in_range && !force_lb) {
          const double vk = ch[s[K - 1]];
          const double slack = own_scores ? 0.0 : stol.atol + stol.rtol * std::fabs(vk);
          bool members = true, beaters = true;
          for (int32_t e : aset) members = members && ch[e] >= vk - slack;
          for (int64_t e = 0; e < E; ++e)
            if (ch[e] > vk + slack && !aset.count(int32_t(e))) beaters = false;
          if (members && beaters) {
            bool exact = true;
            for (int32_t e : aset) exact = exact && ch[e] >= vk;
            for (int64_t e = 0; e < E; ++e)
              if (ch[e] > vk && !aset.count(int32_t(e))) exact = false;
            ok = true;
            is_near = !exact;
            (exact ? ties : near) += 1;
          }
        }
        if (ok && !is_near && aset != rset) ++differs_from_ref;
        for (int64_t k = 0; k < K; ++k) expect[size_t(t * K + k)] = ok ? a[k] : s[k];
      }
      std::ostringstream note;
      note << "ids compared as a set per token on the " << (own_scores ? "implementation's" : "reference's")
           << " scores (CONTRACT §15)";
      if (ties) note << "; " << ties << " token(s) pick another member of an exact tie (accepted)";
      if (near) note << "; " << near << " near-tie token(s): a member within the scores tolerance of the K-th value (reported, not failed)";
      if (own_scores && differs_from_ref)
        note << "; " << differs_from_ref << " near-tie token(s): the selection differs from the reference's own where the scores agree within tolerance (reported, not failed)";
      add("ids", CompareClass::exact, Coords::token_k, g.at("ids"), ids_tensor(expect, ElemType::i32, {T, K}),
          "ref, as sets", note.str());
    }
    if (g.count("topk_scores"))
      add("topk_scores", CompareClass::scores, Coords::token_k, g.at("topk_scores"),
          from_floats(ref::topk_scores_for(spec, ref_scores, ids_used, T), ElemType::f32, {T, K}), "ref at its ids", "");
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

nlohmann::ordered_json case_to_json(const Case& c) {
  nlohmann::ordered_json j;
  j["name"] = c.name;
  // batch > 1 has no per-rank token list (every EP rank holds batch * seq_len)
  if ((c.ep == 1 || c.batch > 1) && c.tokens_per_rank.empty() && c.tokens_uniform_lo < 0) {
    j["shape.tokens"] = c.tokens;
  } else {
    std::vector<int64_t> t;
    for (int r = 0; r < c.ep; ++r) t.push_back(c.tokens_on(r));
    j["shape.tokens"] = c.tokens;
    j["shape.tokens_per_rank"] = t;
  }
  j["shape.hidden"] = c.hidden;
  j["shape.ffn"] = c.ffn;
  j["shape.experts"] = c.num_experts;
  j["shape.top_k"] = c.top_k;
  j["dtype"] = enum_name(dtype_table(), c.dtype);
  j["seed"] = c.seed;
  j["data"] = enum_name(data_mode_table(), c.data);
  j["router.score"] = enum_name(score_table(), c.router.score);
  j["router.bias"] = enum_name(switch_table(), c.router.bias);
  j["router.groups"] = c.router.groups;
  j["router.limited_groups"] = c.router.limited_groups;
  j["router.force_load_balance"] = enum_name(switch_table(), c.router.force_load_balance);
  j["router.route_norm"] = enum_name(switch_table(), c.router.route_norm);
  j["router.route_scale"] = double(c.router.route_scale);  // a float is exact as a double
  j["router.hot_expert"] = c.router.hot_expert;
  j["router.gate_dtype"] = enum_name(gate_dtype_table(), c.router.gate_dtype);
  j["score_multiply"] = enum_name(score_multiply_table(), c.score_multiply);
  j["experts.rounding"] = enum_name(experts_rounding_table(), c.experts.rounding);
  j["experts.compute_dtype"] = enum_name(compute_dtype_table(), c.experts.compute_dtype);
  j["experts.kind"] = enum_name(expert_kind_table(), c.experts.kind);
  j["experts.impl"] = enum_name(experts_impl_table(), c.experts.impl);
  j["shared_experts.kind"] = enum_name(shared_kind_table(), c.shared.kind);
  j["shared_experts.order"] = enum_name(shared_order_table(), c.shared.order);
  j["score_before_experts"] = enum_name(switch_table(), c.score_before_experts);
  j["combine.accumulate"] = enum_name(accumulate_table(), c.combine.accumulate);
  j["combine.placement"] = enum_name(placement_table(), c.combine.placement);
  j["combine.buffer"] = enum_name(out_buffer_table(), c.combine.buffer);
  j["combine.alias_offset"] = c.combine.alias_offset;
  j["ep"] = c.ep;
  j["align"] = c.align;
  j["empty_groups"] = enum_name(empty_groups_table(), c.empty_groups);
  j["permute"] = enum_name(permute_table(), c.permute);
  j["equal_split.policy"] = enum_name(equal_split_table(), c.equal_split.policy);
  j["equal_split.threshold"] = c.equal_split.threshold;
  j["sp"] = c.sp;
  j["shape.batch"] = c.batch;
  j["shape.seq_len"] = c.tokens / c.batch;
  j["sp_padding"] = enum_name(sp_padding_table(), c.sp_padding);
  j["backward"] = enum_name(switch_table(), c.backward);
  j["backend"] = enum_name(backend_table(), c.backend);
  j["layers"] = c.layers;  // the golden tensors are entry 1's
  j["capacity.factor"] = c.capacity.factor;
  j["capacity.policy"] = enum_name(capacity_policy_table(), c.capacity.policy);
  j["capacity.pad_to_capacity"] = enum_name(switch_table(), c.capacity.pad_to_capacity);
  for (const auto& [cls, o] : c.tolerance_override) {
    const std::string base = std::string("tolerance.") + enum_name(compare_class_table(), cls);
    if (o.rtol) j[base + ".rtol"] = *o.rtol;
    if (o.atol) j[base + ".atol"] = *o.atol;
  }
  return j;
}

Case case_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) bad_input(where + ": \"case\" is not an object; valid: the resolved case as `moeverify export` writes it");
  // JSON is YAML: the case loader validates it like any case file entry.
  const std::string text = "cases:\n  - " + j.dump(-1, ' ', true) + "\n";
  std::vector<Case> cs = load_cases_text(text, where, {});
  if (cs.size() != 1) bad_input(where + ": \"case\" must describe exactly one case (no sweep)");
  return cs[0];
}

Tensor read_npy(const std::string& path, ElemType want, const std::vector<int64_t>& want_shape, bool* shape_differs) {
  const std::string shown = printable(path, 200);
  auto broken = [&](const std::string& what) -> void {
    bad_input(shown + ": " + what + "; valid: a NumPy .npy file (np.save) of dtype " + real_dtype(want) +
              (want == ElemType::bf16 || want == ElemType::f16 ? " stored as uint16 bit patterns" : "") + ", shape " +
              Tensor{want, want_shape, nullptr, 0}.shape_str());
  };
  std::ifstream f(path, std::ios::binary);
  if (!f) broken("cannot be opened");
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) broken("not a .npy file (no \\x93NUMPY magic)");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t hlen = 0, hstart = 0;
  if (major == 1) {
    hlen = size_t(static_cast<unsigned char>(bytes[8])) | size_t(static_cast<unsigned char>(bytes[9])) << 8;
    hstart = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) broken("truncated header");
    for (int i = 0; i < 4; ++i) hlen |= size_t(static_cast<unsigned char>(bytes[size_t(8 + i)])) << (8 * i);
    hstart = 12;
  } else {
    broken("unknown .npy version " + std::to_string(major));
  }
  if (bytes.size() < hstart + hlen) broken("truncated header");
  const std::string h = bytes.substr(hstart, hlen);
  auto field = [&](const std::string& key) -> std::string {
    const size_t k = h.find("'" + key + "'");
    if (k == std::string::npos) broken("header has no '" + key + "'");
    size_t v = h.find(':', k);
    if (v == std::string::npos) broken("malformed header");
    ++v;
    while (v < h.size() && h[v] == ' ') ++v;
    size_t e = v;
    if (h[v] == '\'') e = h.find('\'', v + 1) + 1;
    else if (h[v] == '(') e = h.find(')', v) + 1;
    else
      while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
    if (e == std::string::npos || e == 0) broken("malformed header");
    return h.substr(v, e - v);
  };
  std::string descr = field("descr");
  if (descr.size() >= 2) descr = descr.substr(1, descr.size() - 2);
  const std::string fortran = field("fortran_order"), shape_text = field("shape");
  if (fortran != "False") broken("Fortran order; write C-contiguous arrays (np.ascontiguousarray)");
  std::vector<int64_t> shape;
  {
    std::string s = shape_text.substr(1, shape_text.size() - 2);
    std::stringstream ss(s);
    std::string part;
    while (std::getline(ss, part, ',')) {
      const size_t b = part.find_first_not_of(' ');
      if (b == std::string::npos) continue;
      char* end = nullptr;
      const long long v = std::strtoll(part.c_str() + b, &end, 10);
      if (v < 0 || (*end != '\0' && *end != ' ' && *end != 'L')) broken("malformed shape " + printable(shape_text));
      shape.push_back(v);
    }
  }
  const std::string want_descr = npy_descr(want);
  std::string got = descr;
  if (got.size() == 3 && got[0] == '|') got[0] = '<';
  if (got != want_descr)
    broken("dtype '" + printable(descr) + "' where " + real_dtype(want) + " ('" + want_descr + "') is expected");
  if (shape != want_shape) {
    if (!shape_differs) broken("shape " + Tensor{want, shape, nullptr, 0}.shape_str() + " is wrong");
    *shape_differs = true;
  }
  Tensor t = Tensor::alloc(want, shape, 0);
  if (bytes.size() - hstart - hlen != t.bytes())
    broken("holds " + std::to_string(bytes.size() - hstart - hlen) + " data bytes where the shape needs " +
           std::to_string(t.bytes()));
  std::memcpy(t.data(), bytes.data() + hstart + hlen, t.bytes());
  return t;
}

CaseReport run_external(const Case& c, const ActualFn* actual, std::vector<GoldenTensor>* golden) {
  const auto t0 = std::chrono::steady_clock::now();
  CaseReport rep;
  rep.c = c;
  const int R = c.ep;
  Board board;
  board.ranks.resize(size_t(R));
  for (int r = 0; r < R; ++r) {
    board.ranks[size_t(r)] = make_inputs(c, r, c.tokens_on(r));
    if (golden)
      for (const auto& [n, t] : board.ranks[size_t(r)]) golden->push_back({n, "inputs", "input", r, t, layout_of(n)});
  }
  int64_t checked = 0;
  std::vector<std::string> not_checked;
  for (const std::string& slot : slot_order()) {
    const Stage* s = stage_for(c, slot);
    if (!s) continue;
    rep.decisions.push_back({slot, actual ? "actual" : "reference", true, true, "", {}});
    Board refout;
    refout.ranks.resize(size_t(R));
    RefCtx rc{c, board, refout};
    bool failed_before = false;
    for (const auto& ch : rep.checks) failed_before = failed_before || ch.outcome == Outcome::INCORRECT;
    try {
      s->ref(rc);
    } catch (const std::exception& e) {
      // Outputs of a wrong earlier stage can contradict each other (counts
      // that do not match the rows): the reference cannot be fed them. That
      // is part of the earlier failure; otherwise it is an ERROR.
      Check ch;
      ch.slot = slot;
      ch.variant = actual ? "actual" : "reference";
      ch.tensor = "-";
      ch.outcome = failed_before ? Outcome::INCORRECT : Outcome::ERROR;
      ch.note = std::string("the reference cannot run on the previous stages' outputs: ") + e.what() +
                (failed_before ? " (an earlier stage is already INCORRECT)" : "");
      rep.checks.push_back(ch);
      rep.notes.push_back("the check stopped at stage " + slot);
      break;
    }
    Board merged = board;
    for (int r = 0; r < R; ++r)
      for (auto& [n, t] : refout.ranks[size_t(r)]) merged.ranks[size_t(r)][n] = t;
    // Expected outputs: the reference's, or for an activation checked on its
    // own inputs (expert_hidden), the reference's activation of the board's h13.
    std::vector<std::map<std::string, Tensor>> expected(static_cast<size_t>(R)), scales(static_cast<size_t>(R));
    for (const OutputSpec& o : s->outputs)
      for (int r = 0; r < R; ++r) {
        const RankBoard& rr = refout.ranks[size_t(r)];
        if (o.from_fast) {
          if (!merged.has(o.name.substr(0, o.name.size() - std::string("hidden").size()) + "h13", r)) continue;
          Tensor scale;
          expected[size_t(r)][o.name] = o.from_fast(c, merged.ranks[size_t(r)], scale);
          scales[size_t(r)][o.name] = scale;
        } else if (rr.count(o.name)) {
          expected[size_t(r)][o.name] = rr.at(o.name);
        }
      }
    if (golden)
      for (const OutputSpec& o : s->outputs)
        for (int r = 0; r < R; ++r)
          if (expected[size_t(r)].count(o.name))
            golden->push_back({o.name, slot, "expected", r, expected[size_t(r)].at(o.name), layout_of(o.name)});
    if (!actual) {
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : expected[size_t(r)]) merged.ranks[size_t(r)][n] = t;
      board = merged;
      continue;
    }
    // The implementation's outputs of this slot, over the reference's.
    std::vector<std::map<std::string, Tensor>> given(static_cast<size_t>(R));
    std::set<std::string> missing;
    for (const OutputSpec& o : s->outputs)
      for (int r = 0; r < R; ++r) {
        auto e = expected[size_t(r)].find(o.name);
        if (e == expected[size_t(r)].end()) continue;
        bool shape_differs = false;
        const Tensor* a = (*actual)(o.name, r, e->second, failed_before ? &shape_differs : nullptr);
        if (!a) {
          missing.insert(o.name);
          continue;
        }
        if (shape_differs) {
          // An earlier stage was already wrong: a shape that follows from its
          // wrong outputs (counts, splits) is reported here, not exit 2.
          Check ch;
          ch.slot = slot;
          ch.variant = "actual";
          ch.tensor = R > 1 ? o.name + "@" + std::to_string(r) : o.name;
          ch.outcome = Outcome::INCORRECT;
          ch.note = "shape " + a->shape_str() + " where the reference, fed the previous stages' outputs, gives " +
                    e->second.shape_str() + " (an earlier stage is already INCORRECT)";
          rep.checks.push_back(ch);
          continue;
        }
        given[size_t(r)][o.name] = *a;
        merged.ranks[size_t(r)][o.name] = *a;
      }
    int64_t here = 0;
    for (const auto& g : given) here += int64_t(g.size());
    checked += here;
    if (here == 0) {
      not_checked.push_back(slot);
      rep.decisions.back().variant = "reference (no actual files)";
    } else if (!missing.empty()) {
      std::string m;
      for (const auto& n : missing) m += (m.empty() ? "" : ", ") + n;
      rep.notes.push_back("stage " + slot + ": not checked (no file): " + m);
    }
    const size_t first_check = rep.checks.size();
    if (slot == "routing") {
      if (here) check_routing_external(c, refout, merged, given, rep);
    } else {
      for (const OutputSpec& o : s->outputs)
        for (int r = 0; r < R; ++r) {
          auto gi = given[size_t(r)].find(o.name);
          if (gi == given[size_t(r)].end()) continue;
          const Tensor* scale = scales[size_t(r)].count(o.name) ? &scales[size_t(r)].at(o.name) : nullptr;
          rep.checks.push_back(check_output(c, slot, "actual", o, &gi->second, &expected[size_t(r)].at(o.name),
                                            merged.ranks[size_t(r)], r, R,
                                            o.from_fast ? o.from_fast_label : std::string("reference"), scale));
        }
    }
    // Stage isolation: the next stage's reference is fed these outputs, except
    // wrong index metadata (ids, counts, splits, row maps): the reference
    // indexes rows with it, so an implementation's wrong counts would make it
    // read past its buffers. Those are replaced by the reference's, and said.
    for (size_t i = first_check; i < rep.checks.size(); ++i) {
      const Check& ch = rep.checks[i];
      if (ch.outcome == Outcome::PASSED) continue;
      const size_t at = ch.tensor.find('@');
      const std::string name = ch.tensor.substr(0, at);
      const int r = at == std::string::npos ? 0 : std::atoi(ch.tensor.c_str() + at + 1);
      if (r < 0 || r >= R) continue;
      auto g = given[size_t(r)].find(name);
      auto e = expected[size_t(r)].find(name);
      if (g == given[size_t(r)].end() || e == expected[size_t(r)].end()) continue;
      if (g->second.type != ElemType::i32 && g->second.type != ElemType::i64) continue;
      merged.ranks[size_t(r)][name] = e->second;
      rep.notes.push_back("stage " + slot + ": the implementation's " + ch.tensor +
                          " is wrong; later stages are fed the reference's (index metadata)");
    }
    board = merged;
  }
  if (actual) {
    if (!not_checked.empty()) {
      std::string m;
      for (const auto& n : not_checked) m += (m.empty() ? "" : ", ") + n;
      rep.notes.push_back("stages not checked (no actual output files; the reference's outputs fed the next stage): " + m);
    }
    if (checked == 0) {
      Check ch;
      ch.slot = "-";
      ch.variant = "actual";
      ch.tensor = "-";
      ch.outcome = Outcome::NOT_VERIFIED;
      ch.note = "no actual output file matches a stage output of the manifest: nothing was checked";
      rep.checks.push_back(ch);
    }
  }
  for (const auto& ch : rep.checks) rep.outcome = worst(rep.outcome, ch.outcome);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

int cmd_export(const std::string& file, const std::string& dir, const std::string& only, bool select,
               const std::vector<std::string>& sets) {
  if (select && only.empty()) bad_input("--case: the name is empty; valid: a case name as `moeverify validate FILE` lists it");
  const std::vector<Case> cases = load_cases(file, sets);
  std::vector<Case> chosen;
  for (const Case& c : cases)
    if (!select || c.name == only) chosen.push_back(c);
  if (chosen.empty())
    bad_input("--case " + printable(only) + ": no case of that name in " + printable(file, 200) +
              "; valid: a name as `moeverify validate FILE` lists it");
  // The estimate of `run` bounds the reference chain's memory from above.
  for (const Case& c : chosen)
    check_case_memory(c, 1, default_memory_limit(), "the default, 80% of physical memory");
  prepare_dump_root(dir, "export DIR");
  for (const Case& c : chosen) {
    std::vector<GoldenTensor> golden;
    const CaseReport rep = run_external(c, nullptr, &golden);
    if (rep.outcome != Outcome::PASSED)
      runtime_error("export: the reference failed on case " + c.name + ": " +
                    (rep.checks.empty() ? std::string("?") : rep.checks.back().note));
    const std::string folder = dir + "/" + dump_folder_name(c.name);
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) runtime_error("export: cannot create " + printable(folder, 200) + ": " + ec.message());
    nlohmann::ordered_json m;
    m["format"] = kGoldenFormat;
    m["case"] = case_to_json(c);
    m["ranks"] = c.ep;
    m["note"] = "bf16 and fp16 tensors are stored as uint16 bit patterns; write an implementation's outputs under "
                "actual/ with the same file names, dtypes and shapes, then run `moeverify check` on this folder";
    m["tensors"] = nlohmann::ordered_json::array();
    for (const GoldenTensor& g : golden) {
      const std::string f = file_for(g.name, g.rank, c.ep);
      write_npy(folder + "/" + f, g.t);
      m["tensors"].push_back({{"name", g.name},
                              {"stage", g.stage},
                              {"role", g.role},
                              {"rank", g.rank},
                              {"file", f},
                              {"dtype", real_dtype(g.t.type)},
                              {"shape", g.t.shape},
                              {"layout", g.layout}});
    }
    const std::string text = m.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
    const std::string err = write_file(folder + "/manifest.json", {text});
    if (!err.empty()) runtime_error("export: " + err);
    std::cout << "exported " << c.name << ": " << golden.size() << " tensors, " << c.ep << " rank(s) -> " << folder
              << "\n";
  }
  return 0;
}

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

/// One golden folder checked against the implementation's files in
/// `actual_dir`; a missing folder is a case with nothing checked
/// (NOT_VERIFIED). cmd_check refuses a missing --actual folder up front.
CaseReport check_folder(const std::string& folder, const std::string& actual_dir) {
  const std::string mpath = folder + "/manifest.json";
  const std::string valid = "valid: a folder written by `moeverify export`";
  nlohmann::json m;
  try {
    std::ifstream f(mpath);
    if (!f) bad_input(printable(mpath, 200) + ": cannot be opened; " + valid);
    m = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    bad_input(printable(mpath, 200) + ": not valid JSON (" + printable(e.what(), 200) + "); " + valid);
  }
  if (!m.is_object() || !m.contains("format") || m["format"] != kGoldenFormat)
    bad_input(printable(mpath, 200) + ": \"format\" is not \"" + kGoldenFormat + "\"; " + valid);
  if (!m.contains("case") || !m.contains("ranks") || !m["ranks"].is_number_integer() || !m.contains("tensors") ||
      !m["tensors"].is_array())
    bad_input(printable(mpath, 200) + ": needs \"case\", \"ranks\" and \"tensors\"; " + valid);
  Case c = case_from_json(m["case"], mpath);
  c.source = mpath;
  check_case_memory(c, 1, default_memory_limit(), "the default, 80% of physical memory");
  if (m["ranks"].get<int64_t>() != c.ep)
    bad_input(printable(mpath, 200) + ": \"ranks\" is " + m["ranks"].dump() + " but the case has ep " +
              std::to_string(c.ep) + "; " + valid);
  if (!is_dir(actual_dir)) {
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
  std::map<std::string, Tensor> loaded;
  const ActualFn fn = [&](const std::string& name, int rank, const Tensor& expected, bool* shape_differs) -> const Tensor* {
    const std::string f = file_for(name, rank, c.ep);
    const std::string p = actual_dir + "/" + f;
    if (!is_file(p)) return nullptr;
    auto it = loaded.find(f);
    if (it == loaded.end()) it = loaded.emplace(f, read_npy(p, expected.type, expected.shape, shape_differs)).first;
    return &it->second;
  };
  return run_external(c, &fn, nullptr);
}

}  // namespace

int cmd_check(const std::string& dir, const std::string& actual_dir, bool has_actual, const std::string& json,
              bool want_json) {
  if (dir.empty()) bad_input("check: the folder is empty; valid: a folder written by `moeverify export`");
  if (has_actual && actual_dir.empty()) bad_input("--actual: the path is empty; valid: a folder of .npy files");
  if (want_json && json.empty()) bad_input("--json: the path is empty; valid: a file path such as report.json");
  if (has_actual && !is_dir(actual_dir))
    bad_input("--actual " + printable(actual_dir, 200) + ": no such folder; valid: the folder holding the "
              "implementation's .npy files, named as in the manifest");
  // DIR is one golden folder (it holds manifest.json) or a folder of them.
  std::vector<std::pair<std::string, std::string>> folders;  // (golden, actual)
  if (is_file(dir + "/manifest.json")) {
    folders.push_back({dir, has_actual ? actual_dir : dir + "/actual"});
  } else if (is_dir(dir)) {
    std::vector<std::string> subs;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.is_directory() && is_file(e.path().string() + "/manifest.json")) subs.push_back(e.path().filename().string());
    std::sort(subs.begin(), subs.end());
    for (const auto& s : subs)
      folders.push_back({dir + "/" + s, has_actual ? actual_dir + "/" + s : dir + "/" + s + "/actual"});
  }
  if (folders.empty())
    bad_input(printable(dir, 200) + ": holds no manifest.json (nor folders that do); valid: a folder written by "
              "`moeverify export`");
  if (want_json) check_output_file("--json", json);
  std::vector<CaseReport> reports;
  Outcome all = Outcome::PASSED;
  std::cout << "moeverify check: the reference fed the implementation's own previous-stage outputs (CONTRACT §15)\n";
  for (const auto& [golden, act] : folders) {
    reports.push_back(check_folder(golden, act));
    std::cout << "actual outputs: " << act << "\n";
    // Someone else's outputs are judged tensor by tensor: every row is shown.
    print_report(reports.back(), std::cout, ReportDetail::every_check);
    all = worst(all, reports.back().outcome);
  }
  print_tolerance_table(reports, std::cout);
  size_t passed = 0;
  for (const auto& r : reports) passed += r.outcome == Outcome::PASSED;
  std::cout << "\n" << passed << " of " << reports.size() << " case(s) PASSED; overall " << outcome_name(all) << "\n";
  if (want_json) {
    const std::string err = write_file(json, {reports_json(reports, dir)});
    if (!err.empty()) bad_input("--json: " + err + "; valid: a writable file path such as report.json");
  }
  return exit_status(all);
}

}  // namespace moev
