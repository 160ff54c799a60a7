// The golden round trip of export/check (issue 19 §2) on every case of every
// shipped case file, in memory (tests/export_check.sh does the same through
// files for the copy): the expected tensors handed back as the
// implementation's outputs PASS with every expected tensor checked; then one
// element changed in each expected tensor in turn (rank rotating over the
// ranks, the middle element) is INCORRECT, and the first check that is not
// PASSED is at that tensor's stage.
#include <catch2/catch.hpp>

#include <cctype>
#include <filesystem>
#include <sstream>
#include <map>

#include "error.h"
#include "export_check.h"
#include "test_util.h"

using namespace moev;

namespace {

std::vector<std::string> case_files() {
  std::vector<std::string> v;
  for (const char* sub : {"/cases", "/cases/regressions"})
    for (const auto& e : std::filesystem::directory_iterator(std::string(MOEV_SOURCE_DIR) + sub))
      if (e.path().extension() == ".yaml") v.push_back(e.path().string());
  std::sort(v.begin(), v.end());
  return v;
}

/// One element of `t` changed so that every comparison class sees it: ids
/// become an id out of range, other integers +1, floats move by |v| + 1
/// (the stored bf16/fp16 rounding of that).
Tensor mutated(const Tensor& t, const std::string& name, const Case& c) {
  Tensor m = t.clone();
  const int64_t i = m.numel() / 2;
  switch (m.type) {
    case ElemType::i32: m.as<int32_t>()[i] = name == "ids" ? int32_t(c.num_experts) : m.as<int32_t>()[i] + 1; break;
    case ElemType::i64: m.as<int64_t>()[i] += 1; break;
    case ElemType::e4m3: {  // the next e4m3 code (never a NaN pattern)
      uint8_t& b = m.as<uint8_t>()[i];
      b = (b & 0x7f) >= 0x7e ? uint8_t(b - 1) : uint8_t(b + 1);
      break;
    }
    default: {
      // Outside the GEMM bounds of wide SwiGLU experts too (D = 256 FP8
      // cases pass a change of 1), and finite in fp16.
      std::vector<float> v = to_floats(m);
      v[size_t(i)] = v[size_t(i)] + 100.f * (std::fabs(v[size_t(i)]) + 1.f);
      if (!std::isfinite(v[size_t(i)]) || std::fabs(v[size_t(i)]) > 6e4f) v[size_t(i)] = 1.f;
      m = from_floats(v, m.type, m.shape);
    }
  }
  return m;
}

/// Whether the leading "(A, B, ...)" of a layout string names `shape`: the
/// same number of dimensions, and each dimension named by a case constant
/// (D, F, 2F, E, K, R, E_l, R*E_l, S or a number) equal to it. Row symbols
/// that depend on the data (T, N, M, P, alias_offset) are not evaluated.
std::string layout_mismatch(const std::string& layout, const std::vector<int64_t>& shape, const Case& c) {
  if (layout.empty() || layout[0] != '(') return "no shape in the layout";
  const std::string inner = layout.substr(1, layout.find(')') - 1);
  std::vector<std::string> dims;
  std::stringstream ss(inner);
  for (std::string d; std::getline(ss, d, ',');) dims.push_back(d.substr(d.find_first_not_of(' ')));
  if (dims.size() != shape.size()) return "dimensions differ";
  const int64_t El = c.num_experts / c.ep;
  const std::map<std::string, int64_t> known = {{"D", c.hidden}, {"F", c.ffn}, {"2F", 2 * c.ffn},
                                                {"E", c.num_experts}, {"K", c.top_k}, {"R", c.ep},
                                                {"E_l", El}, {"R*E_l", c.ep * El}, {"S", c.sp},
                                                {"D/B", c.hidden / c.dispatch.block}};
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t want = -1;
    if (auto it = known.find(dims[i]); it != known.end()) want = it->second;
    else if (std::isdigit(static_cast<unsigned char>(dims[i][0]))) want = std::stoll(dims[i]);
    if (want >= 0 && want != shape[i]) return "dimension " + std::to_string(i) + " (" + dims[i] + ") is " + std::to_string(shape[i]);
  }
  return "";
}

}  // namespace

TEST_CASE("golden round trip: every shipped case passes its own expected tensors and catches each changed one", "[cpu][golden]") {
  int64_t cases = 0, mutations = 0;
  for (const std::string& file : case_files()) {
    for (const Case& c : load_cases(file, {})) {
      INFO(file << " case " << c.name);
      std::vector<GoldenTensor> golden;
      // streamed weights (cases/streamed.yaml) are exported whole: small here
      REQUIRE(run_external(c, nullptr, &golden).outcome == Outcome::PASSED);
      std::map<std::string, const GoldenTensor*> by_file;
      for (const GoldenTensor& g : golden) {
        const std::string f = golden_file(g.stage, g.name, g.rank);
        REQUIRE(by_file.emplace(f, &g).second);  // one file per (stage, tensor, rank)
        INFO(f << ": layout " << g.layout << ", shape " << g.t.shape_str());
        CHECK(layout_mismatch(g.layout, g.t.shape, c) == "");
      }
      std::string changed;
      Tensor bad;
      const ActualFn fn = [&](const std::string& f, const Tensor&) {
        ActualTensor a;
        auto it = by_file.find(f);
        if (it == by_file.end() || it->second->role != "expected") return a;
        a.kind = ActualTensor::Kind::present;
        a.t = f == changed ? bad : it->second->t;
        return a;
      };
      const CaseReport ok = run_external(c, &fn, nullptr);
      CHECK(failing(ok).empty());
      REQUIRE(ok.outcome == Outcome::PASSED);
      REQUIRE(!ok.notes.empty());
      CHECK(ok.notes.back().find("stages not written") == std::string::npos);
      CHECK(ok.notes.back().find("partly") == std::string::npos);
      ++cases;
      // Each expected (stage, tensor) once, on one of its ranks (rotating).
      std::map<std::pair<std::string, std::string>, std::vector<const GoldenTensor*>> tensors;
      for (const GoldenTensor& g : golden)
        if (g.role == "expected" && g.t.numel() > 0) tensors[{g.stage, g.name}].push_back(&g);
      for (const auto& [key, ranks] : tensors) {
        const GoldenTensor& g = *ranks[size_t(cases) % ranks.size()];
        changed = golden_file(g.stage, g.name, g.rank);
        bad = mutated(g.t, g.name, c);
        INFO("changed " << changed);
        REQUIRE(checksum(bad) != checksum(g.t));
        const CaseReport r = run_external(c, &fn, nullptr);
        const std::vector<std::string> f = failing(r);
        REQUIRE(!f.empty());
        CHECK(r.outcome == Outcome::INCORRECT);
        CHECK(f.front().rfind(g.stage + "/", 0) == 0);
        ++mutations;
      }
      changed.clear();
    }
  }
  WARN("golden round trip: " << cases << " cases, " << mutations << " changed tensors");
  CHECK(cases > 150);
}
