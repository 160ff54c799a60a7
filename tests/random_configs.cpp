// Draws random valid configurations over every case key (src/random_case.cpp),
// loads each through the case loader and runs it: every one must PASS. A false
// alarm on a valid configuration is as much a defect as a missed bug.
//   random_configs COUNT [SEED]   exit 0 when no case is INCORRECT or ERROR
//   random_configs print SEED INDEX...   the YAML of those draws
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <unistd.h>

#include "case.h"
#include "error.h"
#include "random_case.h"
#include "runner.h"

using namespace moev;

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "print") {
    for (int i = 3; i < argc; ++i)
      std::cout << "  - " << random_case_yaml(std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[i], nullptr, 10)) << "\n";
    return 0;
  }
  const uint64_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1000;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 20261122;
  const std::string path = "random_configs_" + std::to_string(::getpid()) + ".yaml";
  std::map<Outcome, int> tally;
  int failed = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const std::string yaml = random_case_yaml(seed, i);
    std::ofstream(path) << "cases:\n  - " << yaml << "\n";
    Outcome o = Outcome::ERROR;
    std::string why;
    try {
      const std::vector<Case> cs = load_cases(path, {});
      RunOptions opt;
      opt.threads = 1 + int(i % 3);
      const CaseReport r = run_case(cs.at(0), opt);
      o = r.outcome;
      for (const auto& ch : r.checks)
        if (ch.outcome != Outcome::PASSED && why.size() < 2000)
          why += "\n    " + ch.slot + "/" + ch.variant + "/" + ch.tensor + " " + outcome_name(ch.outcome) + " " +
                 ch.note + (ch.diff.first.empty() ? "" : " first " + ch.diff.first[0].coords + ": fast " +
                                                             std::to_string(ch.diff.first[0].fast) + " vs " +
                                                             std::to_string(ch.diff.first[0].ref));
    } catch (const std::exception& e) {
      why = std::string("\n    threw: ") + e.what();
    }
    ++tally[o];
    // NOT_VERIFIED (data that cannot show a bug, with the reason) is reported
    // but is no false alarm; INCORRECT and ERROR on a valid configuration are.
    if (o != Outcome::PASSED) {
      failed += o == Outcome::INCORRECT || o == Outcome::ERROR;
      std::cout << "FAIL " << outcome_name(o) << " (seed " << seed << ", index " << i << "): " << yaml << why << "\n";
    }
  }
  std::remove(path.c_str());
  std::cout << "random configurations: " << count << " drawn (seed " << seed << ");";
  for (const auto& [o, n] : tally) std::cout << " " << outcome_name(o) << " " << n;
  std::cout << "\n";
  return failed ? 1 : 0;
}
