// Reports: a fixed-shape human table, JSON, and .npy tensors (STYLE 6).
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>

#include "error.h"
#include "runner.h"

namespace moev {
namespace {

std::string num(double v) {
  if (std::isinf(v)) return "inf";
  if (std::isnan(v)) return "nan";
  std::ostringstream o;
  o << std::setprecision(3) << v;
  return o.str();
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) { o += ' '; continue; }
    o += ch;
  }
  return o + "\"";
}

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream o;
  o << std::setprecision(9) << v;
  return o.str();
}

std::string tol_str(const Check& ch) {
  if (ch.cls == CompareClass::exact) return "bitwise";
  return "r" + num(ch.tol.rtol) + " a" + num(ch.tol.atol);
}

}  // namespace

void print_report(const CaseReport& r, std::ostream& os) {
  os << "\n== case " << r.c.name << "  (" << r.c.source << ")\n   " << r.c.summary() << "\n";
  os << "   paths:";
  std::string slot;
  for (const auto& d : r.decisions) {
    const bool first = d.slot != slot;
    slot = d.slot;
    os << "\n     " << std::left << std::setw(15) << (first ? d.slot : "") << " " << d.variant
       << (d.ran ? (d.primary ? "*" : "") : "  [not taken: " + d.reason + "]");
    for (const auto& n : d.notes) os << "\n" << std::string(23, ' ') << "- " << n;
  }
  os << "\n   (* = primary: feeds the next stage)\n";
  os << "   " << std::left << std::setw(15) << "stage" << std::setw(22) << "variant" << std::setw(17) << "tensor"
     << std::setw(19) << "against" << std::setw(17) << "tolerance" << std::setw(14) << "outcome" << std::right
     << std::setw(15) << "mismatch/total" << std::setw(10) << "max_abs" << std::setw(10) << "max_rel"
     << std::setw(9) << "max_ulp" << "\n";
  for (const Check& ch : r.checks) {
    os << "   " << std::left << std::setw(15) << ch.slot << std::setw(22) << ch.variant << std::setw(17) << ch.tensor
       << std::setw(19) << ch.against << std::setw(17) << tol_str(ch) << std::setw(14) << outcome_name(ch.outcome)
       << std::right << std::setw(15)
       << (std::to_string(ch.diff.mismatches) + "/" + std::to_string(ch.diff.total)) << std::setw(10)
       << num(ch.diff.max_abs) << std::setw(10) << num(ch.diff.max_rel) << std::setw(9) << num(ch.diff.max_ulp)
       << "\n";
    if (!ch.note.empty()) os << "      note: " << ch.note << "\n";
    auto show = [&](const std::vector<Mismatch>& ms, const char* label) {
      for (const auto& m : ms)
        os << "      " << label << " mismatch " << m.coords << ": fast " << num(m.fast) << " vs " << num(m.ref)
           << "\n";
    };
    show(ch.diff.first, "first");
    show(ch.diff.last, "last ");
  }
  for (const auto& n : r.notes) os << "   note: " << n << "\n";
  os << "   => " << outcome_name(r.outcome) << "  (" << std::fixed << std::setprecision(3) << r.seconds << " s)\n";
  os.unsetf(std::ios::fixed);
}

void print_tolerance_table(const std::vector<CaseReport>& reports, std::ostream& os) {
  std::set<DType> dts;
  for (const auto& r : reports) dts.insert(r.c.dtype);
  os << "\ntolerance table (pass: |fast - ref| <= atol + rtol * |ref|; exact classes are bitwise):\n";
  for (const auto& [name, cls] : compare_class_table()) {
    if (cls == CompareClass::exact) continue;
    os << "   " << std::left << std::setw(12) << name;
    for (DType d : dts) {
      const Tolerance t = default_tolerance(cls, d);
      os << "  " << dtype_name(d) << ": rtol " << num(t.rtol) << " atol " << num(t.atol);
    }
    os << "\n";
  }
}

std::string reports_json(const std::vector<CaseReport>& reports, const std::string& file) {
  std::ostringstream o;
  Outcome all = Outcome::PASSED;
  for (const auto& r : reports) all = worst(all, r.outcome);
  o << "{\n  \"file\": " << json_str(file) << ",\n  \"outcome\": " << json_str(outcome_name(all))
    << ",\n  \"cases\": [";
  for (size_t i = 0; i < reports.size(); ++i) {
    const CaseReport& r = reports[i];
    o << (i ? "," : "") << "\n    {\"name\": " << json_str(r.c.name) << ", \"source\": " << json_str(r.c.source)
      << ", \"config\": " << json_str(r.c.summary()) << ", \"seed\": " << r.c.seed
      << ", \"outcome\": " << json_str(outcome_name(r.outcome)) << ", \"seconds\": " << json_num(r.seconds)
      << ",\n     \"paths\": [";
    for (size_t j = 0; j < r.decisions.size(); ++j) {
      const auto& d = r.decisions[j];
      o << (j ? ", " : "") << "\n       {\"slot\": " << json_str(d.slot) << ", \"variant\": " << json_str(d.variant)
        << ", \"taken\": " << (d.ran ? "true" : "false") << ", \"primary\": " << (d.primary ? "true" : "false")
        << ", \"reason\": " << json_str(d.reason) << ", \"notes\": [";
      for (size_t k = 0; k < d.notes.size(); ++k) o << (k ? ", " : "") << json_str(d.notes[k]);
      o << "]}";
    }
    o << "],\n     \"checks\": [";
    for (size_t j = 0; j < r.checks.size(); ++j) {
      const Check& ch = r.checks[j];
      o << (j ? "," : "") << "\n       {\"stage\": " << json_str(ch.slot) << ", \"variant\": " << json_str(ch.variant)
        << ", \"tensor\": " << json_str(ch.tensor) << ", \"against\": " << json_str(ch.against)
        << ", \"class\": " << json_str(enum_name(compare_class_table(), ch.cls)) << ", \"rtol\": " << json_num(ch.tol.rtol)
        << ", \"atol\": " << json_num(ch.tol.atol) << ", \"outcome\": " << json_str(outcome_name(ch.outcome))
        << ", \"total\": " << ch.diff.total << ", \"mismatches\": " << ch.diff.mismatches
        << ", \"max_abs\": " << json_num(ch.diff.max_abs) << ", \"max_rel\": " << json_num(ch.diff.max_rel)
        << ", \"max_ulp\": " << json_num(ch.diff.max_ulp) << ", \"note\": " << json_str(ch.note) << ", \"first\": [";
      for (size_t k = 0; k < ch.diff.first.size(); ++k)
        o << (k ? ", " : "") << "{\"at\": " << json_str(ch.diff.first[k].coords) << ", \"fast\": "
          << json_num(ch.diff.first[k].fast) << ", \"ref\": " << json_num(ch.diff.first[k].ref) << "}";
      o << "]}";
    }
    o << "],\n     \"notes\": [";
    for (size_t k = 0; k < r.notes.size(); ++k) o << (k ? ", " : "") << json_str(r.notes[k]);
    o << "]}";
  }
  o << "\n  ]\n}\n";
  return o.str();
}

void write_npy(const std::string& path, const Tensor& t) {
  const char* descr = "<f4";
  switch (t.type) {
    case ElemType::f32: descr = "<f4"; break;
    case ElemType::bf16:
    case ElemType::f16: descr = "<u2"; break;
    case ElemType::i32: descr = "<i4"; break;
    case ElemType::i64: descr = "<i8"; break;
  }
  std::string shape = "(";
  for (size_t i = 0; i < t.shape.size(); ++i) shape += std::to_string(t.shape[i]) + (t.shape.size() == 1 ? "," : i + 1 < t.shape.size() ? ", " : "");
  shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + header.size() + 1;
  header += std::string((64 - total % 64) % 64, ' ') + "\n";
  std::ofstream f(path, std::ios::binary);
  if (!f) runtime_error("cannot write " + path);
  const uint16_t hlen = uint16_t(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  f.put(char(hlen & 0xff));
  f.put(char(hlen >> 8));
  f.write(header.data(), std::streamsize(header.size()));
  f.write(static_cast<const char*>(t.data()), std::streamsize(t.bytes()));
}

}  // namespace moev
