// Reports: a fixed-shape human table, JSON, and .npy tensors.
// What a check says is bounded: a note longer than kMaxNoteChars and a list
// of more than kMaxNotes notes are cut, with the count of what was left out,
// in the table and in the JSON alike (a bug once grew one line past 64 MiB).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <map>
#include <regex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "case_json.h"
#include "dump.h"
#include "version.h"
#include "error.h"
#include "report.h"

namespace moev {

std::string int_ranges(const std::set<int>& v) {
  std::string s;
  for (auto it = v.begin(); it != v.end();) {
    const int lo = *it;
    int hi = lo;
    for (++it; it != v.end() && *it == hi + 1; ++it) hi = *it;
    s += (s.empty() ? "" : ",") + std::to_string(lo) + (hi > lo ? "-" + std::to_string(hi) : "");
  }
  return s;
}

namespace {

constexpr size_t kMaxNoteChars = 2000;
constexpr size_t kMaxNotes = 100;

std::string capped(const std::string& s) {
  if (s.size() <= kMaxNoteChars) return s;
  return s.substr(0, kMaxNoteChars) + "... (" + std::to_string(s.size() - kMaxNoteChars) + " more chars)";
}

std::vector<std::string> capped(const std::vector<std::string>& v) {
  std::vector<std::string> o;
  for (size_t i = 0; i < v.size() && i < kMaxNotes; ++i) o.push_back(capped(v[i]));
  if (v.size() > kMaxNotes) o.push_back("... (" + std::to_string(v.size() - kMaxNotes) + " more notes)");
  return o;
}

std::string num(double v) {
  if (std::isinf(v)) return "inf";
  if (std::isnan(v)) return "nan";
  std::ostringstream o;
  o << std::setprecision(3) << v;
  return o.str();
}

using Json = nlohmann::ordered_json;

/// NaN and infinities have no JSON number: they are written as null.
Json json_num(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

std::string tol_str(const Check& ch) {
  if (ch.cls == CompareClass::exact) return "bitwise";
  return "r" + num(ch.tol.rtol) + " a" + num(ch.tol.atol);
}

}  // namespace

namespace {

/// Seconds as the text report prints them: three decimals and " s", the one
/// form tests/report_determinism.sh strips.
std::string secs(double v) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(3) << v << " s";
  return o.str();
}

/// A table cell `w` wide, left-aligned; a longer text keeps one space after
/// it, so that it never runs into the next column.
std::string left(const std::string& text, size_t w) {
  return text.size() < w ? text + std::string(w - text.size(), ' ') : text + " ";
}
/// The same, right-aligned, with one space before a longer text.
std::string right(const std::string& text, size_t w) {
  return text.size() < w ? std::string(w - text.size(), ' ') + text : " " + text;
}

/// Whether `ch` failed on its row count (check: nothing was compared element
/// by element).
bool rows_differ(const Check& ch) {
  return ch.rows.expected >= 0 && ch.rows.actual >= 0 && ch.rows.actual != ch.rows.expected;
}

/// A check's mismatch/total cell: where the row counts differ, the rows,
/// yours and the reference's.
std::string mismatch_cell(const Check& ch) {
  if (rows_differ(ch))
    return "rows " + std::to_string(ch.rows.actual) + " vs " + std::to_string(ch.rows.expected);
  return std::to_string(ch.diff.mismatches) + "/" + std::to_string(ch.diff.total);
}

/// The per-check table: a header, then each check with its note and its
/// first and last mismatches.
void print_checks(const std::vector<const Check*>& checks, std::ostream& os) {
  os << "   " << left("stage", 20) << left("variant", 24) << left("tensor", 17) << left("against", 19)
     << left("tolerance", 17) << left("outcome", 14) << right("mismatch/total", 15) << right("max_abs", 10)
     << right("max_rel", 10) << right("max_ulp", 9) << "\n";
  for (const Check* chp : checks) {
    const Check& ch = *chp;
    os << "   " << left(ch.slot, 20) << left(ch.variant, 24) << left(ch.tensor, 17) << left(ch.against, 19)
       << left(tol_str(ch), 17) << left(outcome_name(ch.outcome), 14) << right(mismatch_cell(ch), 15)
       << right(num(ch.diff.max_abs), 10) << right(num(ch.diff.max_rel), 10) << right(num(ch.diff.max_ulp), 9)
       << "\n";
    if (!ch.note.empty()) os << "      note: " << capped(ch.note) << "\n";
    auto show = [&](const std::vector<Mismatch>& ms, const char* label) {
      for (const auto& m : ms) {
        // Exact and rounding classes (the latter: a few act ulps apart at
        // most) show every digit, the bit patterns and the ulp distance;
        // tolerance classes the values to 3 digits. `check` judges the
        // user's values: "yours", not "fast".
        os << "      " << label << " mismatch " << capped(m.coords) << (ch.variant == "actual" ? ": yours " : ": fast ");
        if (ch.cls == CompareClass::exact || ch.cls == CompareClass::rounding) {
          os << value_text(m.fast, ch.diff.type) << " vs " << value_text(m.ref, ch.diff.type);
          const int64_t u = ulp_distance(m.fast, m.ref, ch.diff.type);
          if (u > 0) os << ", " << u << " ulp apart";
        } else {
          os << num(m.fast) << " vs " << num(m.ref);
        }
        os << "\n";
      }
    };
    show(ch.diff.first, "first");
    show(ch.diff.last, "last ");
  }
}

/// One row of the summary: a (slot, variant) with its decision, if any, and
/// its checks aggregated over ranks and tensors.
struct VariantRow {
  std::string slot, variant;
  const VariantDecision* decision = nullptr;
  std::vector<const Check*> checks;
};

/// Rows in decision order, then (slot, variant) pairs that only checks name
/// (end_to_end, ep_invariance, `moeverify check`) in the order of their first check.
std::vector<VariantRow> variant_rows(const CaseReport& r) {
  std::vector<VariantRow> rows;
  auto find = [&](const std::string& slot, const std::string& variant) -> VariantRow* {
    for (auto& row : rows)
      if (row.slot == slot && row.variant == variant) return &row;
    return nullptr;
  };
  for (const auto& d : r.decisions)
    if (!find(d.slot, d.variant)) rows.push_back({d.slot, d.variant, &d, {}});
  for (const Check& ch : r.checks) {
    VariantRow* row = find(ch.slot, ch.variant);
    if (!row) {
      rows.push_back({ch.slot, ch.variant, nullptr, {}});
      row = &rows.back();
    }
    row->checks.push_back(&ch);
  }
  return rows;
}

/// Variant notes of the summary: each distinct note once, at most this many.
constexpr size_t kSummaryNotes = 2;

/// The overload factor line (docs/contract.md §12), where the case has one to tell.
void print_overload(const CaseReport& r, std::ostream& os, bool every) {
  if (!r.overload.valid || (r.c.layers == 1 && r.c.ep == 1)) return;
  os << "   overload factor (docs/contract.md §12, " << r.overload.entries.size() << " entr"
     << (r.overload.entries.size() == 1 ? "y" : "ies") << (r.c.backward == Switch::on ? " + backward" : "")
     << "): avg " << num(r.overload.avg) << "  max " << num(r.overload.max) << "  max_cum " << num(r.overload.max_cum);
  if (every) {
    os << "  per entry:";
    for (double v : r.overload.entries) os << " " << num(v);
  }
  os << "\n";
}

/// Distinct notes of passed checks that the summary shows.
constexpr size_t kSummaryCheckNotes = 4;

/// Notes that differ only in one rank ("recv@0 is wrong", "recv@1 is
/// wrong"; "stage x rank 0: ...", "stage x rank 1: ...") as one ("recv@0-1
/// is wrong", "stage x ranks 0-1: ..."), in the order of their first; a note
/// naming no rank, or more than one, stays as it is.
std::vector<std::string> fold_ranks(const std::vector<std::string>& notes) {
  // "name@R" or "rank R", R of at most 6 digits (MPI jobs are far smaller):
  // a longer number in a note (a path) is text, and std::stoi could not hold it
  static const std::regex ranked(R"((([A-Za-z0-9_])@|\brank )([0-9]{1,6})\b)");
  std::vector<std::pair<std::string, std::set<int>>> folded;  // note with "\x01" for the rank -> ranks
  for (const auto& n : notes) {
    std::smatch m;
    const bool one = std::regex_search(n, m, ranked) && !std::regex_search(m.suffix().first, n.end(), ranked);
    const std::string key = one ? m.prefix().str() + m[1].str() + "\x01" + m.suffix().str() : n;
    auto f = std::find_if(folded.begin(), folded.end(), [&](const auto& e) { return e.first == key; });
    if (f == folded.end()) f = folded.insert(folded.end(), {key, {}});
    if (one) f->second.insert(std::stoi(m[3].str()));
  }
  std::vector<std::string> out;
  for (auto& [key, ranks] : folded) {
    std::string n = key;
    const size_t at = n.find('\x01');
    if (at != std::string::npos) {
      n.replace(at, 1, int_ranges(ranks));
      if (ranks.size() > 1 && at >= 5 && n.compare(at - 5, 5, "rank ") == 0) n.insert(at - 1, "s");  // "ranks 0-3"
    }
    out.push_back(n);
  }
  return out;
}

/// The first `limit` of `lines` (each capped), each after `lead`, then
/// `more_lead` "... (N more MORE)" for the rest.
void print_first(const std::vector<std::string>& lines, size_t limit, const std::string& lead,
                 const std::string& more_lead, const char* more, std::ostream& os) {
  const size_t shown = std::min(lines.size(), limit);
  for (size_t i = 0; i < shown; ++i) os << lead << capped(lines[i]) << "\n";
  if (shown < lines.size()) os << more_lead << "... (" << lines.size() - shown << " more " << more << ")\n";
}

/// A passed check's note as the summary shows it: without the clause that
/// states its bound (the summary line gives the case's largest share), ""
/// where nothing particular is left (the routing note that only says how ids
/// are judged).
std::string summary_note(std::string note) {
  size_t at = note.find(kScaledBoundNote);
  if (at == std::string::npos) at = note.find(kRoundingBoundNote);
  if (at == std::string::npos) at = note.find(kAnyOrderBoundNote);
  if (at != std::string::npos) {
    const size_t end = note.find("; ", at);  // what follows the clause stays
    const bool after_sep = at >= 2 && note.compare(at - 2, 2, "; ") == 0;
    if (end == std::string::npos) note.erase(after_sep ? at - 2 : at);
    else note.erase(at, end + 2 - at);
  }
  const bool how_judged_only = note.rfind(kSelectionNote, 0) == 0 && note.find(';') == std::string::npos;
  return how_judged_only ? "" : note;
}

/// The notes of PASSED checks, which the summary's rows do not show (an
/// exact tie accepted, a tolerance chosen and why): each distinct note once,
/// after the stage and tensors it was said of, ranks folded ("recv@0-3").
void print_passed_check_notes(const CaseReport& r, std::ostream& os) {
  struct Said { std::string note; std::vector<std::pair<std::string, std::set<int>>> tensors; };  // "slot tensor" -> ranks
  std::vector<Said> said;
  for (const Check& ch : r.checks) {
    if (ch.outcome != Outcome::PASSED) continue;
    const std::string note = summary_note(ch.note);
    if (note.empty()) continue;
    const auto [name, rank] = split_tensor_rank(ch.tensor);
    const std::string where = ch.slot + " " + name;
    auto s = std::find_if(said.begin(), said.end(), [&](const Said& e) { return e.note == note; });
    if (s == said.end()) s = said.insert(said.end(), Said{note, {}});
    auto t = std::find_if(s->tensors.begin(), s->tensors.end(), [&](const auto& e) { return e.first == where; });
    if (t == s->tensors.end()) t = s->tensors.insert(s->tensors.end(), {where, {}});
    if (rank >= 0) t->second.insert(rank);
  }
  std::vector<std::string> lines;
  for (const Said& s : said) {
    std::string on;
    for (const auto& [where, ranks] : s.tensors)
      on += (on.empty() ? "" : ", ") + where + (ranks.empty() ? "" : "@" + int_ranges(ranks));
    lines.push_back(on + ": " + s.note);
  }
  print_first(lines, kSummaryCheckNotes, "   passed, with a note: ", "   ", "notes of passed checks with --verbose", os);
}

/// A case whose every check passed, in a few lines: what was compared, the
/// largest share of a tolerance bound used, the notes of its checks and of
/// the case. --verbose gives the full table.
void print_passed(const CaseReport& r, std::ostream& os) {
  std::set<std::string> slots;
  int64_t variants = 0, elements = 0;
  double bound = 0;
  for (const VariantRow& row : variant_rows(r)) {
    if (row.checks.empty()) continue;
    slots.insert(row.slot);
    ++variants;
    for (const Check* ch : row.checks) {
      elements += ch->diff.total;
      if (ch->cls != CompareClass::exact) bound = std::max(bound, ch->diff.max_bound_ratio);
    }
  }
  os << "   " << slots.size() << " stages, ";
  if (variants > int64_t(slots.size())) os << variants << " variants, ";
  os << r.checks.size() << " checks over " << elements << " elements; largest error/bound " << num(bound)
     << " (--verbose: every stage, variant and check)\n";
  print_passed_check_notes(r, os);
  for (const auto& n : capped(fold_ranks(r.notes))) os << "   note: " << n << "\n";
  print_overload(r, os, false);
  os << "   => " << outcome_name(r.outcome) << "  (" << std::fixed << std::setprecision(3) << r.seconds << " s)\n";
  os.unsetf(std::ios::fixed);
}

}  // namespace

namespace {

/// One row of the summary table: the slot (on its first row), the variant
/// (* when primary), then why it was not taken, or its worst outcome, checks,
/// mismatches, max_abs, bound used and seconds (device seconds on a device
/// backend).
void print_variant_row(const VariantRow& row, bool first, bool on_device, std::ostream& os) {
  const VariantDecision* d = row.decision;
  const std::string name = row.variant + (d && d->ran && d->primary ? "*" : "");
  os << "   " << left(first ? row.slot : "", 20) << left(name, 24);
  if (d && !d->ran) {
    os << "not taken: " << capped(d->reason) << "\n";
  } else {
    Outcome o = Outcome::PASSED;
    int64_t mismatches = 0, total = 0;
    double max_abs = 0, bound = 0;
    bool any_tolerance = false;
    int64_t rows_off = 0;  // checks whose row count differs: no element compared
    for (const Check* ch : row.checks) {
      o = worst(o, ch->outcome);
      mismatches += ch->diff.mismatches;
      total += ch->diff.total;
      rows_off += rows_differ(*ch);
      if (!(ch->diff.max_abs <= max_abs)) max_abs = ch->diff.max_abs;  // NaN wins: it is shown
      if (ch->cls != CompareClass::exact) {
        any_tolerance = true;
        bound = std::max(bound, ch->diff.max_bound_ratio);
      }
    }
    os << left(row.checks.empty() ? "(no checks)" : outcome_name(o), 14) << right(std::to_string(row.checks.size()), 7)
       << right(std::to_string(mismatches) + "/" + std::to_string(total) +
                    (rows_off ? ", " + std::to_string(rows_off) + " off by rows" : ""), 22)
       << right(num(max_abs), 10)
       << right(any_tolerance ? num(bound) : "-", 11);
    if (d) os << right(secs(d->fast_seconds), 11) << right(secs(d->fast_seconds + d->ref_seconds + d->compare_seconds), 11);
    if (d && on_device && d->device_seconds >= 0) os << right(secs(d->device_seconds), 11);
    os << "\n";
  }
}

/// The notes of a variant under its row: each once and at most
/// kSummaryNotes in the summary, every one with --verbose.
void print_variant_notes(const VariantDecision& v, bool every, std::ostream& os) {
  std::vector<std::string> notes;
  for (const auto& n : v.notes)
    if (every || std::find(notes.begin(), notes.end(), n) == notes.end()) notes.push_back(n);
  const std::string lead = std::string(20, ' ') + "- ";
  print_first(notes, every ? kMaxNotes : kSummaryNotes, lead, lead, every ? "notes" : "notes with --verbose", os);
}

}  // namespace

// The summary table has one line per (slot, variant): a variant not taken
// shows its reason; a taken one its worst outcome, the largest max_abs and
// the largest fraction of a tolerance bound used over its checks (all ranks,
// all tensors), mismatches over compared elements, and its fast and total
// (fast + reference + compare) seconds summed over ranks.
void print_report(const CaseReport& r, std::ostream& os, ReportDetail detail) {
  const bool every = detail == ReportDetail::every_check;
  os << "\n== case " << r.c.name << "  (" << r.c.source << ")\n   " << r.c.summary() << "\n";
  if (!r.actual_dir.empty()) os << "   yours: " << r.actual_dir << "\n";
  if (r.checks.size() == 1 && r.checks[0].slot == "backend") {  // run_case refused the backend: one line
    os << "   => " << outcome_name(r.outcome) << ": " << capped(r.checks[0].note) << "\n";
    return;
  }
  if (!every && r.outcome == Outcome::PASSED) {
    print_passed(r, os);
    return;
  }
  // On a device backend a last column: the device's own time in the
  // variant's kernels and GEMMs (CUDA events on a GPU), inside `fast`.
  const bool on_device = r.c.backend != Backend::host;
  os << "   " << left("stage", 20) << left("variant", 24) << left("outcome", 14) << right("checks", 7)
     << right("mismatch/total", 22) << right("max_abs", 10) << right("bound_used", 11) << right("fast", 11)
     << right("total", 11) << (on_device ? right("device", 11) : "") << "\n";
  // In the summary, a slot none of whose variants applies (and that has no
  // checks) is not a row of its own: such slots are listed after the table,
  // grouped by their reasons, so that the table shows what ran.
  const std::vector<VariantRow> rows = variant_rows(r);
  std::map<std::string, bool> slot_idle;  // slot -> every variant not taken, no checks
  std::map<std::string, std::vector<std::string>> slot_reasons;
  for (const VariantRow& row : rows) {
    const bool idle = row.decision && !row.decision->ran && row.checks.empty();
    auto it = slot_idle.emplace(row.slot, true).first;
    it->second = it->second && idle;
    auto& rs = slot_reasons[row.slot];
    if (idle && std::find(rs.begin(), rs.end(), row.decision->reason) == rs.end()) rs.push_back(row.decision->reason);
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> idle_groups;  // reasons -> slots, in slot order
  std::string slot, unchecked;
  for (const VariantRow& row : rows) {
    if (!every && slot_idle[row.slot]) {
      if (row.slot == slot) continue;
      slot = row.slot;
      std::string why;
      for (const auto& reason : slot_reasons[row.slot]) why += (why.empty() ? "" : " / ") + reason;
      auto g = std::find_if(idle_groups.begin(), idle_groups.end(), [&](const auto& e) { return e.first == why; });
      if (g == idle_groups.end()) idle_groups.push_back({why, {row.slot}});
      else g->second.push_back(row.slot);
      continue;
    }
    if (!every && row.decision && row.decision->ran && row.checks.empty() && row.decision->notes.empty()) {
      unchecked += (unchecked.empty() ? "" : ", ") + row.slot + (row.variant == "actual" ? "" : "/" + row.variant);
      continue;  // ran with nothing to compare (check: a stage not written): one line after the table
    }
    const bool first = row.slot != slot;
    slot = row.slot;
    print_variant_row(row, first, on_device, os);
    if (row.decision) print_variant_notes(*row.decision, every, os);
  }
  // (check's coverage note names its unwritten stages: not said twice)
  if (!unchecked.empty() && !r.coverage.valid) os << "   no checks (--verbose: their rows): " << unchecked << "\n";
  if (!idle_groups.empty()) {
    os << "   stages not taken (--verbose lists each variant):\n";
    for (const auto& [why, slots] : idle_groups) {
      std::string names;
      for (const auto& n : slots) names += (names.empty() ? "" : ", ") + n;
      os << "     " << capped(why) << ": " << names << "\n";
    }
  }
  os << "   (* = primary: feeds the next stage; max_abs, bound_used (error / bound): largest over ranks and "
        "tensors; seconds summed over ranks)\n";
  std::vector<const Check*> shown;
  for (const Check& ch : r.checks)
    if (every || ch.outcome != Outcome::PASSED) shown.push_back(&ch);
  if (!shown.empty()) {
    os << (every ? "   every check:\n" : "   checks not PASSED:\n");
    print_checks(shown, os);
  }
  if (!every) print_passed_check_notes(r, os);
  for (const auto& n : capped(every ? r.notes : fold_ranks(r.notes))) os << "   note: " << n << "\n";
  print_overload(r, os, every);
  os << "   => " << outcome_name(r.outcome) << "  (" << std::fixed << std::setprecision(3) << r.seconds << " s)\n";
  os.unsetf(std::ios::fixed);
}

void print_tolerance_table(const std::vector<CaseReport>& reports, std::ostream& os) {
  // The dtypes of the cases that compared something; none: no table.
  std::set<DType> dts;
  for (const auto& r : reports)
    if (std::any_of(r.checks.begin(), r.checks.end(), [](const Check& ch) {
          return ch.outcome == Outcome::PASSED || ch.outcome == Outcome::INCORRECT;
        }))
      dts.insert(r.c.dtype);
  if (dts.empty()) return;
  os << "\ntolerance table (pass: |fast - ref| <= atol + rtol * |ref|; logits: atol + rtol * max(|ref|, sum of |terms|); "
        "gemm and end_to_end: the same with rtol = c * u_act (docs/contract.md, comparison classes); rounding: within "
        "the per-element half-width the reference computes; exact classes are bitwise):\n";
  for (const auto& [name, cls] : compare_class_table()) {
    if (cls == CompareClass::exact) continue;
    os << "   " << std::left << std::setw(12) << name;
    for (DType d : dts) {
      const Tolerance t = default_tolerance(cls, d);
      os << "  " << dtype_name(d) << ": rtol " << num(t.rtol) << " atol " << num(t.atol);
      if (cls == CompareClass::gemm || cls == CompareClass::end_to_end) os << " c " << num(gemm_bound_constant(d));
    }
    os << "\n";
  }
}

std::string reports_json(const std::vector<CaseReport>& reports, const std::string& file, const ReportMeta& meta) {
  Outcome all = Outcome::PASSED;
  for (const auto& r : reports) all = worst(all, r.outcome);
  Json doc;
  doc["schema"] = meta.schema;
  doc["tool"] = {{"name", "moeverify"}, {"version", MOEVERIFY_VERSION}, {"commit", MOEVERIFY_COMMIT}};
  doc["file"] = file;
  doc["outcome"] = outcome_name(all);
  Json counts = {{"cases", reports.size()}};
  for (Outcome o : {Outcome::PASSED, Outcome::NOT_SUPPORTED, Outcome::NOT_VERIFIED, Outcome::INCORRECT, Outcome::ERROR})
    counts[outcome_name(o)] = std::count_if(reports.begin(), reports.end(), [&](const CaseReport& r) { return r.outcome == o; });
  doc["counts"] = counts;
  doc["faults"] = meta.faults;
  doc["faults_uncaught"] = meta.faults_uncaught;
  doc["cases"] = Json::array();
  for (const CaseReport& r : reports) {
    Json jc;
    jc["name"] = r.c.name;
    jc["source"] = r.c.source;
    jc["summary"] = r.c.summary();
    jc["config"] = case_to_json(r.c);
    jc["backend"] = enum_name(backend_table(), r.c.backend);
    jc["seed"] = r.c.seed;
    jc["outcome"] = outcome_name(r.outcome);
    jc["seconds"] = json_num(r.seconds);
    jc["paths"] = Json::array();
    for (const auto& d : r.decisions)
      jc["paths"].push_back({{"slot", d.slot},
                             {"variant", d.variant},
                             {"taken", d.ran},
                             {"primary", d.primary},
                             {"reason", capped(d.reason)},
                             {"notes", capped(d.notes)},
                             {"fast_seconds", json_num(d.fast_seconds)},
                             {"ref_seconds", json_num(d.ref_seconds)},
                             {"compare_seconds", json_num(d.compare_seconds)},
                             {"device_seconds", d.device_seconds >= 0 ? json_num(d.device_seconds) : Json()}});
    jc["checks"] = Json::array();
    for (const Check& ch : r.checks) {
      Json first = Json::array();
      for (const auto& m : ch.diff.first)
        first.push_back({{"index", m.index},
                         {"at", capped(m.coords)},
                         {ch.variant == "actual" ? "yours" : "fast", json_num(m.fast)},  // check: the user's values
                         {"ref", json_num(m.ref)}});
      // "tensor@rank" in the text table; here the name and the rank apart.
      const size_t at = ch.tensor.find('@');
      const Json rank = at == std::string::npos ? Json(nullptr) : Json(std::atoi(ch.tensor.c_str() + at + 1));
      jc["checks"].push_back({{"stage", ch.slot},
                              {"variant", ch.variant},
                              {"tensor", ch.tensor.substr(0, at)},
                              {"rank", rank},
                              {"against", ch.against},
                              {"class", enum_name(compare_class_table(), ch.cls)},
                              {"rtol", json_num(ch.tol.rtol)},
                              {"atol", json_num(ch.tol.atol)},
                              {"outcome", outcome_name(ch.outcome)},
                              {"total", ch.diff.total},
                              {"mismatches", ch.diff.mismatches},
                              {"max_abs", json_num(ch.diff.max_abs)},
                              {"max_rel", json_num(ch.diff.max_rel)},
                              {"max_ulp", json_num(ch.diff.max_ulp)},
                              {"note", capped(ch.note)},
                              {"first", first}});
      if (!ch.consequence_of.empty()) jc["checks"].back()["consequence_of"] = ch.consequence_of;
      if (ch.rows.expected >= 0)
        jc["checks"].back()["rows"] = {{"expected", ch.rows.expected},
                                       {"actual", ch.rows.actual},
                                       {"segments_of", ch.rows.segments_of},
                                       {"expected_segments", ch.rows.expected_segments},
                                       {"actual_segments", ch.rows.actual_segments}};
    }
    jc["notes"] = capped(r.notes);
    if (r.coverage.valid)  // check only: what the implementation wrote
      jc["coverage"] = {{"expected", r.coverage.expected},
                        {"checked", r.coverage.checked},
                        {"partly_written", r.coverage.partly},
                        {"not_written", r.coverage.not_written}};
    if (r.overload.valid) {  // docs/contract.md §12: overload_factor.avg, .max, .max_cum
      Json entries = Json::array();
      for (double v : r.overload.entries) entries.push_back(json_num(v));
      jc["overload_factor"] = {{"avg", json_num(r.overload.avg)},
                               {"max", json_num(r.overload.max)},
                               {"max_cum", json_num(r.overload.max_cum)},
                               {"entries", entries}};
    }
    doc["cases"].push_back(std::move(jc));
  }
  // Invalid UTF-8 (a case name is user text) is replaced by U+FFFD, never a throw.
  return doc.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

void write_npy(const std::string& path, const Tensor& t) {
  const char* descr = "<f4";
  switch (t.type) {
    case ElemType::f32: descr = "<f4"; break;
    case ElemType::bf16:
    case ElemType::f16: descr = "<u2"; break;
    case ElemType::i32: descr = "<i4"; break;
    case ElemType::i64: descr = "<i8"; break;
    case ElemType::e4m3: descr = "|u1"; break;  // e4m3fn bytes (docs/contract.md §16)
  }
  std::string shape = "(";
  for (size_t i = 0; i < t.shape.size(); ++i) shape += std::to_string(t.shape[i]) + (t.shape.size() == 1 ? "," : i + 1 < t.shape.size() ? ", " : "");
  shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + header.size() + 1;
  header += std::string((64 - total % 64) % 64, ' ') + "\n";
  const uint16_t hlen = uint16_t(header.size());
  const char preamble[10] = {'\x93', 'N', 'U', 'M', 'P', 'Y', '\x01', '\x00', char(hlen & 0xff), char(hlen >> 8)};
  const std::string err = write_file(path, {std::string_view(preamble, sizeof preamble), header,
                                            std::string_view(static_cast<const char*>(t.data()), t.bytes())},
                                     /*no_follow=*/true);
  if (!err.empty()) runtime_error("--dump: " + err);
}

void print_failure_list(const std::vector<CaseReport>& reports, const FailureTail& tail, std::ostream& out) {
  bool header = false;
  for (size_t i = 0; i < reports.size(); ++i) {
    const CaseReport& r = reports[i];
    if (r.outcome == Outcome::PASSED) continue;
    if (!header) out << "failures:\n";
    header = true;
    const Check* first = nullptr;
    for (const Check& ch : r.checks)
      if (!first && ch.outcome != Outcome::PASSED) first = &ch;
    out << "   " << r.c.name << ": " << outcome_name(r.outcome);
    tail(i, r, first, out);
    out << "\n";
  }
}

}  // namespace moev
