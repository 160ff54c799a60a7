// The golden folder's manifest (docs/contract.md §15; the format is in
// export_check.h): the tensors' file names, types and layouts, `moeverify
// export` writing manifest.json beside the .npy files, and `check` reading
// it back.
#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include "case_json.h"
#include "dump.h"
#include "error.h"
#include "golden.h"
#include "memory_estimate.h"
#include "profile.h"
#include "version.h"

namespace moev {
namespace golden {

const char* real_dtype(ElemType t) {
  switch (t) {
    case ElemType::f32: return "float32";
    case ElemType::bf16: return "bfloat16";
    case ElemType::f16: return "float16";
    case ElemType::i32: return "int32";
    case ElemType::i64: return "int64";
    case ElemType::e4m3: return "float8_e4m3fn";  // stored as its bytes, uint8 (docs/contract.md §16)
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
    case ElemType::e4m3: return "|u1";
  }
  return "?";
}

/// What a user needs to know to produce a tensor: its shape and the order
/// of its rows. The leading parenthesis is the shape, in the symbols of
/// docs/contract.md; row counts that depend on the data are named: T tokens
/// of the rank at that stage, N = T*K assignments (fewer, C per expert,
/// after capacity), M rows received, P rows after alignment padding.
/// tests/test_golden_roundtrip.cpp holds every exported shape to it.
std::string layout_of(const std::string& name) {
  static const std::map<std::string, std::string> m = {
      {"x", "(T, D) token rows"},
      {"x_tail", "(alias_offset) the elements that follow x in its buffer: the in-place combine's output starts "
                 "alias_offset elements into x and runs past its end (docs/contract.md §9)"},
      {"wg", "(E, D) router weight; logits = x wg^T"},
      {"bias", "(E) fp32 selection bias"},
      {"w1", "(E, F, D) per expert; h1 = X w1^T"},
      {"w3", "(E, F, D) per expert; h3 = X w3^T"},
      {"w2", "(E, D, F) per expert; Y = H w2^T"},
      {"shared_w1", "(1, F, D)"},
      {"shared_w3", "(1, F, D)"},
      {"shared_w2", "(1, D, F)"},
      {"grad_out", "(T, D) upstream gradient of out"},
      {"logits", "(T, E) fp32"},
      {"scores", "(T, E) softmax/sigmoid of logits, fp32"},
      {"ids", "(T, K) selected experts of each token, any order; judged as a selection (docs/contract.md §15)"},
      {"topk_scores", "(T, K) score of ids[t, k], normalised and scaled"},
      {"counts", "(E) rows per expert (after capacity: kept rows)"},
      {"routed_input", "(N, D) expert-major, ascending token inside an expert (docs/contract.md §2); N = T*K, or the kept rows after capacity"},
      {"token_sorted", "(N) token of each dispatch row"},
      {"score_sorted", "(N) score of each dispatch row"},
      {"row_of", "(T, K) dispatch row of assignment (t, k); -1 where capacity dropped it"},
      {"input_splits", "(R) rows sent to each rank"},
      {"output_splits", "(R) rows received from each rank"},
      {"recv_counts", "(R*E_l) flat, entry p*E_l + j: rows received from rank p for local expert j"},
      {"recv", "(M, D) received rows: source rank, then local expert, then the source's order (docs/contract.md §3)"},
      {"overload", "(2) [largest rows received by a rank, rows received by the group]"},
      {"permuted", "(M, D) expert-major: local expert, then source rank (docs/contract.md §3)"},
      {"expert_counts_real", "(E_l) real rows per local expert"},
      {"expert_input", "(P, D) expert groups padded to a multiple of align with zero rows (docs/contract.md §4)"},
      {"expert_counts", "(E_l) padded rows per local expert"},
      {"expert_output", "(P, D) expert outputs of the padded groups; under empty_groups: pad an empty group keeps no rows"},
      {"expert_h13", "(P, 2F) [h1 | h3] per row"},
      {"expert_hidden", "(P, F) H = silu(h1) * h3 per row, judged on the implementation's own h13"},
      {"unpadded", "(M, D) expert outputs without the padding rows"},
      {"recv_out", "(M, D) expert outputs back in received (rank-major) order"},
      {"routed_output", "(N, D) expert outputs in dispatch row order"},
      {"shared_out", "(T, D) shared expert output"},
      {"shared_h13", "(T, 2F) [h1 | h3] of the shared expert"},
      {"shared_hidden", "(T, F) H of the shared expert, judged on the implementation's own shared_h13"},
      {"out", "(T, D) combined output"},
      {"sp_rows", "(S) token rows each SP rank holds, padding included"},
      {"sp_tokens", "(1) tokens of the rank before SP sharding"},
      {"sp_out", "(T, D) the rank's combined rows after the SP gather, padding dropped"},
      {"sp_out_global", "(T, D) every SP rank's rows gathered in token order"},
      // FP8 dispatch (docs/contract.md §16): e4m3fn bytes stored as uint8, fp32 block scales, B = dispatch.block
      {"x_q", "(T, D) e4m3fn bytes of x, quantised per token in blocks of B channels (docs/contract.md §16)"},
      {"x_scale", "(T, D/B) fp32 scale s of each token's block; x ~ float(q) * s"},
      {"routed_input_q", "(N, D) e4m3fn bytes of routed_input's rows, same order (docs/contract.md §2, §16); after capacity the kept rows, filler rows zero bytes (§11)"},
      {"routed_input_scale", "(N, D/B) fp32 block scales of routed_input_q's rows; 0 on capacity filler rows"},
      {"recv_q", "(M, D) e4m3fn rows received: source rank, local expert, source order (docs/contract.md §3, §16)"},
      {"recv_scale", "(M, D/B) fp32 block scales of recv_q's rows"},
      {"permuted_q", "(M, D) e4m3fn rows expert-major: local expert, then source rank (docs/contract.md §3, §16)"},
      {"permuted_scale", "(M, D/B) fp32 block scales of permuted_q's rows"},
      {"expert_input_q", "(P, D) e4m3fn rows in padded expert groups, zero bytes on padding rows (docs/contract.md §4, §16)"},
      {"expert_input_scale", "(P, D/B) fp32 block scales of expert_input_q's rows, 0 on padding rows"},
      {"grad_routed_output", "(N, D) gradient of routed_output"},
      {"grad_topk_scores", "(T, K) gradient of topk_scores"},
      {"grad_x_shared", "(T, D) gradient of x through the shared expert"},
      {"grad_recv_out", "(M, D) gradient of recv_out (the reverse all-to-all with splits swapped)"},
      {"grad_unpadded", "(M, D) gradient of unpadded"},
      {"grad_recv", "(M, D) gradient of recv"},
      {"grad_expert_output", "(P, D) gradient of expert_output, zero on padding rows"},
      {"grad_expert_input", "(P, D) gradient of expert_input"},
      {"grad_permuted", "(M, D) gradient of permuted"},
      {"grad_routed_input", "(N, D) gradient of routed_input"},
      {"grad_x", "(T, D) gradient of x"},
      {"grad_w1", "(E_l, F, D) gradient of the rank's local experts' w1"},
      {"grad_w3", "(E_l, F, D) gradient of the rank's local experts' w3"},
      {"grad_w2", "(E_l, D, F) gradient of the rank's local experts' w2"},
      {"grad_shared_w1", "(F, D) fp32 gradient of shared_w1 from this rank's tokens"},
      {"grad_shared_w3", "(F, D) fp32 gradient of shared_w3 from this rank's tokens"},
      {"grad_shared_w2", "(D, F) fp32 gradient of shared_w2 from this rank's tokens"},
      // the router backward (docs/contract.md §13, router)
      {"grad_scores", "(T, E) fp32 gradient of scores: the top-K scores' gradient through route_scale and route_norm, 0 at unchosen experts"},
      {"grad_logits", "(T, E) fp32 gradient of logits through softmax or sigmoid"},
      {"grad_wg", "(E, D) gradient of wg from this rank's tokens: the fp32 sum rounded once to act"},
      {"grad_x_router", "(T, D) the router's share of x's gradient, grad_logits times wg (not in grad_x)"},
  };
  auto it = m.find(name);
  return it == m.end() ? "" : it->second;
}

Manifest read_manifest(const std::string& folder) {
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
  if (m.is_object() && m.contains("format") && m["format"] == "moeverify-golden/1")
    bad_input(printable(mpath, 200) + ": written by an older moeverify (format moeverify-golden/1, whose file names "
              "are shared between stages); export the case again: this version reads " + kGoldenFormat +
              " (one file per stage and tensor, STAGE.NAME.rankR.npy)");
  if (m.is_object() && m.contains("format") && m["format"] == kDumpFormat)
    bad_input(printable(mpath, 200) + ": a folder `run --dump` wrote (the fast path's and the reference's outputs "
              "of a run), not an export; " + valid + " (moeverify export CASE_FILE DIR)");
  if (!m.is_object() || !m.contains("format") || m["format"] != kGoldenFormat)
    bad_input(printable(mpath, 200) + ": \"format\" is not \"" + kGoldenFormat + "\"; " + valid);
  if (!m.contains("case") || !m.contains("ranks") || !m["ranks"].is_number_integer() || !m.contains("tensors") ||
      !m["tensors"].is_array())
    bad_input(printable(mpath, 200) + ": needs \"case\", \"ranks\" and \"tensors\"; " + valid);
  Case c = case_from_json(m["case"], mpath);
  c.source = mpath;
  // check holds the folder's tensors beside its reference run (measured:
  // peak 2.3 GiB for a run estimate of 1.5 GiB and 2.1 GiB of tensors)
  double tensor_bytes = 0;
  for (const auto& t : m["tensors"]) {
    if (!t.is_object() || !t.contains("shape") || !t["shape"].is_array()) continue;
    double n = 1;
    for (const auto& d : t["shape"]) n *= d.is_number() ? std::max(0.0, d.get<double>()) : 0.0;
    const std::string dt = t.contains("dtype") && t["dtype"].is_string() ? t["dtype"].get<std::string>() : "";
    size_t bytes = 4;
    for (ElemType e : {ElemType::f32, ElemType::bf16, ElemType::f16, ElemType::i32, ElemType::i64, ElemType::e4m3})
      if (dt == real_dtype(e)) bytes = elem_bytes(e);
    tensor_bytes += n * double(bytes);
  }
  check_case_memory(c, 1, command_memory_limit(), tensor_bytes);
  if (m["ranks"].get<int64_t>() != c.ep)
    bad_input(printable(mpath, 200) + ": \"ranks\" is " + m["ranks"].dump() + " but the case has ep " +
              std::to_string(c.ep) + "; " + valid);
  return {c, m["tensors"]};
}

std::set<std::string> expected_files(const nlohmann::json& tensors) {
  std::set<std::string> files;
  for (const auto& t : tensors)
    if (t.is_object() && t.value("role", "") == "expected" && t.contains("file") && t["file"].is_string())
      files.insert(t["file"].get<std::string>());
  return files;
}

}  // namespace golden

namespace {

/// FOLDER/manifest.json for one exported case, and every golden tensor as
/// FOLDER/FILE (one file per entry, never shared).
void write_manifest(const std::string& folder, const Case& c, const std::vector<GoldenTensor>& golden) {
  nlohmann::ordered_json m;
  m["format"] = kGoldenFormat;
  m["tool"] = std::string("moeverify ") + MOEVERIFY_VERSION;
  m["case"] = case_to_json(c);
  // The keys of the case that change nothing in it, with why (an adapter
  // need not refuse a value it cannot express where the value has no effect).
  nlohmann::ordered_json inert = nlohmann::ordered_json::object();
  for (const auto& [key, help] : case_keys())
    if (const std::string why = key_without_effect(key, c); !why.empty()) inert[key] = why;
  m["keys_without_effect"] = inert;
  m["ranks"] = c.ep;
  m["layers"] = c.layers;
  m["note"] = "one file per (stage, tensor, rank): STAGE.NAME.rankR.npy, inputs as input.NAME.rankR.npy, layer "
              "entry L >= 2 prefixed layerL. (its inputs only where they differ from entry 1's); bf16 and fp16 "
              "are stored as uint16 bit patterns, integers may be written as int32 or int64; write an "
              "implementation's outputs under actual/ with the expected entries' file names, then run "
              "`moeverify check` on this folder";
  m["tensors"] = nlohmann::ordered_json::array();
  std::set<std::string> files;
  for (const GoldenTensor& g : golden) {
    const std::string f = golden_file(g.stage, g.name, g.rank);
    if (!files.insert(f).second) runtime_error("export: internal: two tensors of case " + c.name + " map to " + f);
    write_npy(folder + "/" + f, g.t);
    m["tensors"].push_back({{"name", g.name},
                            {"stage", g.stage},
                            {"role", g.role},
                            {"rank", g.rank},
                            {"file", f},
                            {"dtype", golden::real_dtype(g.t.type)},
                            {"shape", g.t.shape},
                            {"layout", g.layout}});
  }
  const std::string text = m.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  const std::string err = write_file(folder + "/manifest.json", {text}, /*no_follow=*/true);
  if (!err.empty()) runtime_error("export: " + err);
}

}  // namespace

std::string golden_file(const std::string& stage, const std::string& name, int rank) {
  std::string s = stage;
  std::replace(s.begin(), s.end(), '/', '.');
  const size_t in = s.rfind("inputs");
  if (in != std::string::npos && in + 6 == s.size() && (in == 0 || s[in - 1] == '.')) s.erase(in + 5);  // "input"
  return s + "." + name + ".rank" + std::to_string(rank) + ".npy";
}

int cmd_export(const std::string& file, const std::string& dir, const CaseFilter& filter,
               const std::vector<std::string>& sets, const Profile* profile) {
  filter.check_not_empty();
  const std::vector<std::string> all_sets = profile ? profile->sets_after(sets) : sets;
  LoadNotes notes;
  std::vector<Case> cases;
  try {
    cases = load_cases(file, all_sets, &notes);
  } catch (const Error& e) {
    // The profile's fixed keys fit none of the file's cases (score_before_experts
    // beside FP8 dispatch): the file lies outside the profile, as below.
    if (!profile || e.kind != ErrorKind::bad_input || profile->fix.empty()) throw;
    load_cases(file, sets);  // an error of the file itself is reported as such
    bad_input("export --profile " + profile->name + ": every chosen case of " + printable(file, 200) +
              " lies outside the profile: its fixed keys fit none of them (" + e.what() +
              "); valid: cases the fixed keys fit (moeverify validate --profile " + profile->file + " " +
              printable(file, 200) + " lists them)");
  }
  // Notes on the cases --case selects, a left-out case's naming what left it out.
  std::vector<std::string> loaded;
  for (const Case& c : cases) loaded.push_back(c.name);
  const std::string cause = left_out_cause(profile != nullptr, !sets.empty());
  for (const auto& n : notes.left_out)
    if (filter.selects(n.first)) std::cerr << "moeverify: note: " << left_out_note(n, cause) << "\n";
  for (const auto& n : notes.no_effect)
    if (filter.selects_entry(n.first, loaded)) std::cerr << "moeverify: note: " << n.second << "\n";
  if (profile) {
    const auto selected = [&](const std::string& n) { return filter.selects(n); };
    for (const std::string& n : replaced_notes(notes, profile->name, profile->fixed_keys(), [&](const std::string& e) {
           return profile->keeps_entry(e, cases, selected);
         }))
      std::cerr << "moeverify: note: " << n << "\n";
  }
  std::vector<Case> chosen;
  std::vector<std::string> names;
  size_t left_out = 0;
  for (const Case& c : cases) {
    names.push_back(c.name);
    if (!filter.selects(c.name)) continue;
    const std::string outside = profile ? profile->violation(c) : "";
    if (outside.empty()) {
      chosen.push_back(c);
    } else {
      ++left_out;
      std::cout << "left out " << c.name << ": outside profile " << profile->name << " (" << outside << ")\n";
    }
  }
  filter.check_each_used(names, printable(file, 200));
  if (chosen.empty() && left_out > 0)
    bad_input("export --profile " + profile->name + ": every chosen case of " + printable(file, 200) +
              " lies outside the profile; valid: cases whose keys the profile allows (moeverify validate --profile " +
              profile->file + " " + printable(file, 200) + " lists them)");
  // The estimate of `run` bounds the reference chain's memory from above.
  for (const Case& c : chosen)
    check_case_memory(c, 1, command_memory_limit());
  prepare_dump_root(dir, "export DIR");
  std::string root = dir;
  while (root.size() > 1 && root.back() == '/') root.pop_back();  // DIR/ gives DIR/CASE, not DIR//CASE
  for (const Case& c : chosen) {
    const std::string folder = root + "/" + dump_folder_name(c.name);
    const size_t n = export_case_folder(c, folder);
    std::cout << "exported " << c.name << ": " << n << " tensors, " << c.ep << " rank(s) -> " << folder
              << (c.streams_weights() ? " (routed weights streamed in `run`, written whole here)" : "") << "\n";
  }
  return 0;
}

size_t export_case_folder(const Case& c, const std::string& folder) {
  std::vector<GoldenTensor> golden;
  const CaseReport rep = run_external(c, nullptr, &golden);
  if (rep.outcome != Outcome::PASSED)
    runtime_error("export: the reference failed on case " + c.name + ": " +
                  (rep.checks.empty() ? std::string("?") : rep.checks.back().note));
  note_left_in_place(folder, prepare_case_folder(folder, "export DIR", FolderKind::golden), "export");
  write_manifest(folder, c, golden);
  return golden.size();
}

}  // namespace moev
