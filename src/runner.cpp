#include "runner.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <thread>

#include "datagen.h"
#include "error.h"

namespace moev {
namespace {

/// Runs fn(rank) for every rank: threads when there are several.
template <class F>
void run_ranks(int R, F&& fn) {
  if (R == 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> err(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r)
    th.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        err[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : th) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

Check make_check(const Case& c, const Stage& s, const OutputSpec& o, const Tensor* f, const Tensor* r,
                 const RankBoard& fb, int rank, int ranks, const std::string& against) {
  Check ch;
  ch.slot = s.slot;
  ch.variant = s.variant;
  ch.tensor = ranks > 1 ? o.name + "@" + std::to_string(rank) : o.name;
  ch.cls = o.cls;
  ch.tol = tolerance_for(c, o.cls);
  ch.against = against;
  if (!f || !r) {
    ch.outcome = Outcome::ERROR;
    ch.note = std::string(!f ? "fast" : "reference") + " produced no '" + o.name + "'";
    return ch;
  }
  ch.diff = diff_tensors(*f, *r, o.cls, ch.tol, coords_for(o.coords, *f, fb, rank, ranks));
  if (!ch.diff.structural.empty()) {
    ch.outcome = Outcome::INCORRECT;
    ch.note = ch.diff.structural;
  } else if (ch.diff.mismatches) {
    ch.outcome = Outcome::INCORRECT;
  } else if (o.promised && o.promised(c) && ch.diff.both_all_zero) {
    ch.outcome = Outcome::NOT_VERIFIED;
    ch.note = "both tensors are all zero where the case promises data";
  }
  return ch;
}

std::string dump_name(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-' && ch != '_') ch = '_';
  return s;
}

struct Dumper {
  std::string dir;
  std::vector<std::string> manifest;
  void put(const std::string& name, const Tensor& t) {
    if (dir.empty()) return;
    const std::string file = dump_name(name) + ".npy";
    write_npy(dir + "/" + file, t);
    std::ostringstream o;
    o << "{\"file\": \"" << file << "\", \"dtype\": \"" << elem_name(t.type) << "\", \"shape\": [";
    for (size_t i = 0; i < t.shape.size(); ++i) o << (i ? ", " : "") << t.shape[i];
    o << "]}";
    manifest.push_back(o.str());
  }
  void finish(const Case& c) {
    if (dir.empty()) return;
    std::ofstream m(dir + "/manifest.json");
    m << "{\"case\": \"" << c.name << "\", \"note\": \"bf16 and fp16 tensors are stored as uint16 bit patterns\", "
      << "\"tensors\": [\n  ";
    for (size_t i = 0; i < manifest.size(); ++i) m << (i ? ",\n  " : "") << manifest[i];
    m << "\n]}\n";
  }
};

}  // namespace

CaseReport run_case(const Case& c, const RunOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  CaseReport rep;
  rep.c = c;
  const int R = 1;
  Board fast;
  fast.ranks.resize(size_t(R));
  for (int r = 0; r < R; ++r) fast.ranks[size_t(r)] = make_inputs(c, r, c.tokens);
  Board chain;  // the reference chain, from clones of the inputs
  chain.ranks.resize(size_t(R));
  for (int r = 0; r < R; ++r)
    for (auto& [n, t] : fast.ranks[size_t(r)]) chain.ranks[size_t(r)][n] = t.clone();

  Dumper dump;
  if (!opt.dump_dir.empty()) {
    dump.dir = opt.dump_dir + "/" + dump_name(c.name);
    std::filesystem::create_directories(dump.dir);
    for (int r = 0; r < R; ++r)
      for (auto& [n, t] : fast.ranks[size_t(r)]) dump.put("input." + n + (R > 1 ? "@" + std::to_string(r) : ""), t);
  }

  for (const std::string& slot : slot_order()) {
    const Stage* primary = nullptr;
    std::vector<const Stage*> runs;
    for (const Stage& s : registry()) {
      if (s.slot != slot) continue;
      const Decision d = s.applies(c);
      VariantDecision vd{s.slot, s.variant, d.applies, d.applies && s.primary(c), d.applies ? "" : d.reason, {}};
      rep.decisions.push_back(vd);
      if (!d.applies) continue;
      runs.push_back(&s);
      if (vd.primary && !primary) primary = &s;
    }
    if (runs.empty()) continue;
    if (!primary) primary = runs.front();
    std::string adopt_reason;
    Board primary_out;
    std::vector<std::pair<const Stage*, Board>> variant_outs;
    for (const Stage* s : runs) {
      VariantDecision* vd = nullptr;
      for (auto& d : rep.decisions)
        if (d.slot == s->slot && d.variant == s->variant) vd = &d;
      vd->primary = s == primary;
      const std::vector<std::string> inputs = s->inputs(c);
      std::vector<std::vector<uint64_t>> sums(static_cast<size_t>(R));
      for (int r = 0; r < R; ++r)
        for (const auto& n : inputs) sums[size_t(r)].push_back(checksum(fast.at(n, r)));
      Board out;
      out.ranks.resize(size_t(R));
      std::vector<std::vector<std::string>> notes(static_cast<size_t>(R));
      try {
        run_ranks(R, [&](int r) {
          ExecCtx ex{opt.threads, opt.faults};
          FastCtx ctx{c, r, R, ex, nullptr, fast.ranks[size_t(r)], out.ranks[size_t(r)], notes[size_t(r)]};
          s->fast(ctx);
        });
      } catch (const std::exception& e) {
        Check ch;
        ch.slot = s->slot;
        ch.variant = s->variant;
        ch.tensor = "-";
        ch.outcome = Outcome::ERROR;
        ch.note = std::string("fast stage threw: ") + e.what();
        rep.checks.push_back(ch);
        continue;
      }
      for (int r = 0; r < R; ++r)
        for (const auto& n : notes[size_t(r)]) vd->notes.push_back((R > 1 ? "rank " + std::to_string(r) + ": " : "") + n);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < inputs.size(); ++i)
          if (checksum(fast.at(inputs[i], r)) != sums[size_t(r)][i]) {
            Check ch;
            ch.slot = s->slot;
            ch.variant = s->variant;
            ch.tensor = inputs[i];
            ch.against = "its value before the call";
            ch.outcome = Outcome::INCORRECT;
            ch.note = "input '" + inputs[i] + "' was modified by the fast stage" +
                      (R > 1 ? " on rank " + std::to_string(r) : "");
            rep.checks.push_back(ch);
          }
      Board refout;
      refout.ranks.resize(size_t(R));
      RefCtx rctx{c, fast, refout};
      s->ref(rctx);
      Board merged = fast;  // this variant's outputs over its inputs
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : out.ranks[size_t(r)]) merged.ranks[size_t(r)][n] = t;
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : out.ranks[size_t(r)])
          dump.put(s->slot + "." + s->variant + "." + n + (R > 1 ? "@" + std::to_string(r) : "") + ".fast", t);
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : refout.ranks[size_t(r)])
          dump.put(s->slot + "." + s->variant + "." + n + (R > 1 ? "@" + std::to_string(r) : "") + ".ref", t);
      if (s->check) {
        std::vector<Check> checks;
        CheckCtx cc{c, merged, refout, checks, ""};
        s->check(cc);
        for (auto& ch : checks) ch.variant = s->variant;
        rep.checks.insert(rep.checks.end(), checks.begin(), checks.end());
        if (s == primary) adopt_reason = cc.adopt_fast_reason;
      } else {
        for (const OutputSpec& o : s->outputs)
          for (int r = 0; r < R; ++r) {
            const RankBoard& fo = out.ranks[size_t(r)];
            const RankBoard& ro = refout.ranks[size_t(r)];
            auto fi = fo.find(o.name);
            auto ri = ro.find(o.name);
            rep.checks.push_back(make_check(c, *s, o, fi == fo.end() ? nullptr : &fi->second,
                                            ri == ro.end() ? nullptr : &ri->second, merged.ranks[size_t(r)], r, R,
                                            "reference"));
          }
      }
      if (s == primary) primary_out = out;
      variant_outs.push_back({s, out});
    }
    // Cross-variant agreement: every other variant against the primary, in
    // the output's own class (bitwise for exact outputs).
    for (const auto& [s, out] : variant_outs) {
      if (s == primary || primary_out.ranks.empty()) continue;
      for (const OutputSpec& o : s->outputs)
        for (int r = 0; r < R; ++r) {
          const RankBoard& fo = out.ranks[size_t(r)];
          const RankBoard& po = primary_out.ranks[size_t(r)];
          auto fi = fo.find(o.name);
          auto pi = po.find(o.name);
          if (fi == fo.end() || pi == po.end()) continue;
          rep.checks.push_back(make_check(c, *s, o, &fi->second, &pi->second, fast.ranks[size_t(r)], r, R,
                                          primary->variant));
        }
    }
    if (primary_out.ranks.empty()) continue;  // the primary failed; later slots have no inputs
    for (int r = 0; r < R; ++r)
      for (auto& [n, t] : primary_out.ranks[size_t(r)]) fast.ranks[size_t(r)][n] = t;
    // The reference chain advances with the primary's reference function.
    if (!adopt_reason.empty()) {
      rep.notes.push_back(adopt_reason);
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : primary_out.ranks[size_t(r)]) chain.ranks[size_t(r)][n] = t.clone();
    } else {
      Board next;
      next.ranks.resize(size_t(R));
      RefCtx rc{c, chain, next};
      primary->ref(rc);
      for (int r = 0; r < R; ++r)
        for (auto& [n, t] : next.ranks[size_t(r)]) chain.ranks[size_t(r)][n] = t;
    }
  }
  // End to end: the fast pipeline's output against the reference chain's.
  const Stage e2e{"end_to_end", "pipeline", "", nullptr, nullptr, nullptr, {}, nullptr, nullptr, nullptr};
  const OutputSpec oe{"out", CompareClass::end_to_end, Coords::token_col, promise_combined};
  for (int r = 0; r < R; ++r) {
    const bool hf = fast.has("out", r), hc = chain.has("out", r);
    rep.checks.push_back(make_check(c, e2e, oe, hf ? &fast.at("out", r) : nullptr, hc ? &chain.at("out", r) : nullptr,
                                    fast.ranks[size_t(r)], r, R, "reference chain"));
  }
  dump.finish(c);
  if (opt.keep == RunOptions::Keep::fast_board) rep.fast = fast;
  for (const auto& ch : rep.checks) rep.outcome = worst(rep.outcome, ch.outcome);
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace moev
