// Bad input and bounded output (issue 11 §5): --max-memory sizes, the memory
// estimate, dump folder names, escaped messages, checked writes, capped
// report notes. The command-line side is tests/bad_input_corpus.sh.
#include <catch2/catch.hpp>

#include <cctype>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "case.h"
#include "datagen.h"
#include "dump.h"
#include "error.h"
#include "memory_estimate.h"
#include "runner.h"

using namespace moev;

TEST_CASE("max-memory sizes are powers of 1024 with an optional unit", "[cpu][bad_input]") {
  CHECK(parse_memory_size("4096", "--max-memory") == 4096u);
  CHECK(parse_memory_size("2k", "--max-memory") == 2048u);
  CHECK(parse_memory_size("512M", "--max-memory") == 512ull << 20);
  CHECK(parse_memory_size("8G", "--max-memory") == 8ull << 30);
  CHECK(parse_memory_size("8GB", "--max-memory") == 8ull << 30);
  CHECK(parse_memory_size("1.5GiB", "--max-memory") == 3ull << 29);
  CHECK(parse_memory_size("1.5gib", "--max-memory") == 3ull << 29);
  CHECK(parse_memory_size("2T", "--max-memory") == 2ull << 40);
  for (const char* bad : {"", "lots", "0", "0.1", "-5G", "1.2.3G", "12X", "G", ".", "1e3", " 5G", "5 G", "nan", "inf",
                          "99999999999T"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_memory_size(bad, "--max-memory"), Error);
    try {
      parse_memory_size(bad, "--max-memory");
    } catch (const Error& e) {
      CHECK(e.kind == ErrorKind::bad_input);
      CHECK(std::string(e.what()).rfind("--max-memory: ", 0) == 0);
    }
  }
  CHECK(format_bytes(512.0 * (1 << 20)) == "512.0 MiB");
  CHECK(format_bytes(1.5 * (1 << 30)) == "1.5 GiB");
  CHECK(default_memory_limit() > (uint64_t(64) << 20));
}

TEST_CASE("the memory estimate grows with the shape and refuses what does not fit", "[cpu][bad_input]") {
  Case c;
  const double small = estimate_case_bytes(c, 2);
  CHECK(small > 0);
  Case big = c;
  big.tokens = 1 << 24;
  big.hidden = 1 << 16;
  CHECK(estimate_case_bytes(big, 2) > std::ldexp(1.0, 42));  // x alone is 4 TiB
  CHECK_NOTHROW(check_case_memory(c, 2, uint64_t(1) << 30, "test"));
  try {
    check_case_memory(big, 2, uint64_t(1) << 30, "test limit");
    FAIL("a 4 TiB case was not refused");
  } catch (const Error& e) {
    CHECK(e.kind == ErrorKind::bad_input);
    const std::string m = e.what();
    CHECK(m.find("estimated peak memory") != std::string::npos);
    CHECK(m.find("exceeds the limit 1.0 GiB (test limit)") != std::string::npos);
  }
  // Padding: E * A rows; weights: one copy shared by every rank's board, so
  // counted once however many EP ranks there are.
  Case pad = c;
  pad.align = 4096;
  pad.num_experts = 4096;
  CHECK(estimate_case_bytes(pad, 2) > small + 4096.0 * 4096 * 32 * 4);
  Case w = c;
  w.experts.kind = ExpertKind::swiglu;
  w.num_experts = 256;
  CHECK(estimate_case_bytes(w, 2) > small + 256.0 * 3 * 64 * 32 * 2);  // one bf16 copy at least
  Case w256 = w;
  w256.ep = 256;
  CHECK(estimate_case_bytes(w256, 2) < estimate_case_bytes(w, 2) + 256.0 * 3 * 256 * 64 * 32 * 4);
}

TEST_CASE("a fresh output buffer costs nothing for combine.alias_offset", "[cpu][bad_input]") {
  Case c;
  c.tokens = 4;
  c.hidden = 8;
  c.combine.alias_offset = int64_t(1) << 40;  // a fresh buffer never reads past x
  const auto in = make_inputs(c, 0, c.tokens);
  CHECK(in.at("x").storage->size() == size_t(4 * 8 * 4));
  CHECK(estimate_case_bytes(c, 2) < std::ldexp(1.0, 30));
  c.combine.buffer = OutBuffer::alias_x_offset;
  c.combine.alias_offset = 5;
  CHECK(make_inputs(c, 0, c.tokens).at("x").storage->size() == size_t((4 * 8 + 5) * 4));
}

TEST_CASE("dump folder names are safe and distinct", "[cpu][bad_input]") {
  const std::vector<std::string> names = {"..", ".", ".hidden", "x y", "x_y", "a/b", "a\\b", "q\"uote", "x\ny",
                                          std::string(300, 'n'), std::string(300, 'n') + "2", "plain-name_1.0"};
  std::set<std::string> seen;
  for (const auto& n : names) {
    const std::string f = dump_folder_name(n);
    INFO(printable(n) << " -> " << f);
    CHECK(f != ".");
    CHECK(f != "..");
    CHECK(f[0] != '.');
    CHECK(f.find('/') == std::string::npos);
    CHECK(f.size() <= 109);
    for (const char ch : f) CHECK((std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' || ch == '_'));
    CHECK(seen.insert(f).second);
  }
  CHECK(dump_folder_name("plain-name_1.0") == "plain-name_1.0");  // a safe name is kept as is
  CHECK(dump_folder_name("x_y") == "x_y");
}

TEST_CASE("echoed values are escaped and capped", "[cpu][bad_input]") {
  CHECK(printable(std::string("a\0b", 3)) == "a\\x00b");
  CHECK(printable("a\nb\x1b[0m") == "a\\x0ab\\x1b[0m");
  CHECK(printable("\xff") == "\\xff");
  // Printable UTF-8 is kept as written (docs/contract.md §1 in a message);
  // a lone lead byte, a C1 control (U+0085) and an overlong form are escaped.
  CHECK(printable("contract.md \xc2\xa7" "1 \xc3\xa9") == "contract.md \xc2\xa7" "1 \xc3\xa9");
  CHECK(printable("a\xc2") == "a\\xc2");
  CHECK(printable("\xc2\x85") == "\\xc2\\x85");
  CHECK(printable("\xe0\x80\xaf") == "\\xe0\\x80\\xaf");
  CHECK(printable(std::string(1 << 20, 'x')) == std::string(80, 'x') + "...");
  CHECK(printable("short") == "short");
}

TEST_CASE("writes are checked through the close", "[cpu][bad_input]") {
  CHECK(write_file("/dev/full", {"some bytes"}).find("No space left on device") != std::string::npos);
  CHECK(write_file("/proc/version", {"x"}) != "");
  CHECK(write_file("/nonexistent-moev/x", {"x"}).find("cannot open") != std::string::npos);
  CHECK_THROWS_AS(check_output_file("--json", "/dev/full"), Error);
  CHECK_THROWS_AS(check_output_file("--json", "/proc/version"), Error);
  CHECK_THROWS_AS(check_output_file("--json", ""), Error);
}

TEST_CASE("report notes are capped in the table and in the JSON, and NaN is null", "[cpu][bad_input]") {
  CaseReport r;
  r.c.name = "q\"uote\\ and \x01 control";
  Check ch;
  ch.slot = "combine";
  ch.variant = "out_of_place";
  ch.tensor = "out";
  ch.note = std::string(100000, 'n');
  ch.diff.max_abs = std::nan("");
  ch.diff.max_rel = std::numeric_limits<double>::infinity();
  r.checks.push_back(ch);
  for (int i = 0; i < 500; ++i) r.notes.push_back("note " + std::to_string(i));
  r.decisions.push_back({"combine", "out_of_place", true, true, "", {std::string(5000, 'd')}});
  std::ostringstream table;
  print_report(r, table, ReportDetail::every_check);
  const std::string t = table.str();
  CHECK(t.size() < 20000);
  CHECK(t.find("... (98000 more chars)") != std::string::npos);
  CHECK(t.find("... (3000 more chars)") != std::string::npos);
  CHECK(t.find("... (400 more notes)") != std::string::npos);
  std::istringstream lines(t);
  for (std::string line; std::getline(lines, line);) CHECK(line.size() < 2200);

  const std::string js = reports_json({r}, "file \"with\" quotes.yaml");
  CHECK(js.size() < 20000);
  const auto doc = nlohmann::json::parse(js);
  CHECK(doc["file"] == "file \"with\" quotes.yaml");
  const auto& jc = doc["cases"][0];
  CHECK(jc["name"] == r.c.name);
  CHECK(jc["checks"][0]["max_abs"].is_null());
  CHECK(jc["checks"][0]["max_rel"].is_null());
  CHECK(jc["checks"][0]["note"].get<std::string>().size() < 2100);
  CHECK(jc["notes"].size() == 101);
  CHECK(jc["paths"][0]["notes"][0].get<std::string>().find("... (3000 more chars)") != std::string::npos);
}

TEST_CASE("the summary folds what ranks say alike and keeps the notes of passed checks", "[cpu][bad_input]") {
  CaseReport r;
  r.c.name = "fold";
  for (int q = 0; q < 4; ++q) {
    Check ch;
    ch.slot = "dispatch";
    ch.variant = "actual";
    ch.tensor = "score_sorted@" + std::to_string(q);
    ch.note = "judged within the scores tolerance";
    r.checks.push_back(ch);
    ch.tensor = "recv@" + std::to_string(q);
    ch.note = std::string(kScaledBoundNote) + " (docs/contract.md), largest error/bound 0." + std::to_string(q);
    r.checks.push_back(ch);  // the bound part alone: left out of the summary
    ch.tensor = "out@" + std::to_string(q);
    ch.note = "signed zeros; " + std::string(kScaledBoundNote) + " 0." + std::to_string(q) + "; 2 element(s) not compared";
    r.checks.push_back(ch);  // before and after the bound part: both kept
  }
  r.notes = {"stage ep_dispatch: the implementation's recv@0 is wrong", "stage ep_dispatch: the implementation's recv@2 is wrong",
             "stage ep_dispatch: the implementation's recv@1 is wrong", "a path /tmp/x@123456789012345678901",
             "two ranks a@1 b@2", "stage capacity rank 0: ties kept", "stage capacity rank 1: ties kept",
             "stage routing rank 2: alone"};
  std::ostringstream out;
  print_report(r, out, ReportDetail::summary);  // PASSED: the few-line summary
  const std::string t = out.str();
  CHECK(t.find("passed, with a note: dispatch score_sorted@0-3: judged within the scores tolerance\n") != std::string::npos);
  CHECK(t.find("largest error/bound 0.1") == std::string::npos);
  CHECK(t.find("passed, with a note: dispatch out@0-3: signed zeros; 2 element(s) not compared\n") != std::string::npos);
  CHECK(t.find("note: stage ep_dispatch: the implementation's recv@0-2 is wrong\n") != std::string::npos);
  CHECK(t.find("note: a path /tmp/x@123456789012345678901\n") != std::string::npos);  // no overflow, kept
  CHECK(t.find("note: two ranks a@1 b@2\n") != std::string::npos);  // two ranks named: as written
  CHECK(t.find("note: stage capacity ranks 0-1: ties kept\n") != std::string::npos);
  CHECK(t.find("note: stage routing rank 2: alone\n") != std::string::npos);
  std::ostringstream every;
  print_report(r, every, ReportDetail::every_check);
  CHECK(every.str().find("recv@1 is wrong") != std::string::npos);  // --verbose: each note as it is
}

TEST_CASE("the case language reads what the file says (a review's finds)", "[cpu][bad_input]") {
  SECTION("--set of a swept key replaces the sweep: one case, named without the stale value") {
    const std::string text = "cases:\n  - {name: a, shape: {tokens: 8}, sweep: {dtype: [fp32, fp16], seed: [1, 2]}}\n";
    const std::vector<Case> cs = load_cases_text(text, "t.yaml", {"dtype=bf16"});
    REQUIRE(cs.size() == 2);
    CHECK(cs[0].name == "a[seed=1]");
    CHECK(cs[1].name == "a[seed=2]");
    for (const Case& c : cs) CHECK(c.dtype == DType::bf16);
  }
  SECTION("a case's own way of giving the tokens replaces the defaults'") {
    const std::string text =
        "defaults: {shape: {tokens: 64}}\ncases:\n  - {name: a, shape: {batch: 2, seq_len: 8}}\n"
        "  - {name: b, ep: 2, shape: {tokens_per_rank: [3, 5]}}\n  - {name: c}\n";
    const std::vector<Case> cs = load_cases_text(text, "t.yaml", {});
    REQUIRE(cs.size() == 3);
    CHECK(cs[0].tokens == 16);
    CHECK((cs[1].tokens_on(0) == 3 && cs[1].tokens_on(1) == 5));
    CHECK(cs[2].tokens == 64);
    // --set of the per-rank tokens replaces a case's count
    const std::vector<Case> t = load_cases_text("cases:\n  - {name: a, ep: 2, shape: {tokens: 9}}\n", "t.yaml",
                                                {"shape.tokens_per_rank=[1, 2]"});
    CHECK((t.at(0).tokens_on(0) == 1 && t.at(0).tokens_on(1) == 2));
  }
  SECTION("integers in decimal, leading zeros included (YAML 1.2), never octal") {
    CHECK(load_cases_text("cases:\n  - {name: a, seed: 010}\n", "t.yaml", {}).at(0).seed == 10);
    CHECK(load_cases_text("cases:\n  - {name: a, seed: 08}\n", "t.yaml", {}).at(0).seed == 8);
  }
  SECTION("combine.alias_offset is held to the smallest rank's tokens, per-rank counts included") {
    const std::string text =
        "cases:\n  - {name: a, ep: 2, shape: {hidden: 32, tokens_per_rank: [100, 100]}, shared_experts: {kind: identity, "
        "order: init_with_shared}, combine: {buffer: alias_x_offset, alias_offset: 1000}}\n";
    CHECK(load_cases_text(text, "t.yaml", {}).size() == 1);
  }
  SECTION("two long sweep values that differ past the name's cut name two cases") {
    std::string a = "[", b;
    for (int i = 0; i < 64; ++i) a += std::to_string(1000 + i) + (i < 63 ? ", " : "");
    b = a + ", 7]";
    a += ", 8]";
    const std::string text = "cases:\n  - name: a\n    ep: 65\n    shape: {experts: 65}\n    sweep: {shape.tokens_per_rank: [" +
                             a + ", " + b + "]}\n";
    const std::vector<Case> cs = load_cases_text(text, "t.yaml", {});
    REQUIRE(cs.size() == 2);
    CHECK(cs[0].name != cs[1].name);
    CHECK(cs[0].name.size() < 260);
  }
}
