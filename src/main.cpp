// moeverify: reference-vs-fast verification of MoE token paths.
// Exit status: 0 all PASSED, 1 INCORRECT, 2 bad input, 3 ERROR,
// 4 NOT_VERIFIED, 5 NOT_SUPPORTED (the worst outcome of the run decides).
#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <thread>

#include "case.h"
#include "comm.h"
#include "cuda_probe.h"
#include "error.h"
#include "registry.h"
#include "runner.h"
#include "version.h"

using namespace moev;

namespace {

int cmd_run(const std::vector<std::string>& files, const std::vector<std::string>& sets, int threads,
            const std::string& json, const std::string& dump, const std::vector<std::string>& faults,
            const std::string& only, double timeout_s) {
  RunOptions opt;
  opt.threads = threads;
  opt.collective_timeout_ms = int(timeout_s * 1000);
  set_mpi_collective_timeout(std::chrono::milliseconds(opt.collective_timeout_ms));  // MPI collectives too
  opt.dump_dir = dump;
  if (launched_under_mpi() && mpi_world().rank() != 0) opt.dump_dir.clear();  // rank 0 writes the dump
  for (const auto& f : faults) {
    try {
      opt.faults.bits |= uint32_t(parse_fault(f));
    } catch (const std::invalid_argument& e) {
      bad_input(std::string("--fault: ") + e.what());
    }
  }
  std::vector<std::pair<std::string, std::vector<Case>>> all;
  for (const auto& f : files) all.push_back({f, load_cases(f, sets)});  // validate everything before running
  // Under mpirun every process runs every case (one rank each); rank 0 prints.
  const bool mpi = launched_under_mpi();
  const int world = mpi ? mpi_world().size() : 0;
  std::ostream null_stream(nullptr);
  std::ostream& out = !mpi || mpi_world().rank() == 0 ? std::cout : null_stream;
  std::vector<std::string> skipped;
  for (auto& [file, cases] : all) {
    std::vector<Case> keep;
    for (auto& c : cases) {
      if (mpi && c.ep != world) skipped.push_back(c.name + " (ep " + std::to_string(c.ep) + ")");
      else keep.push_back(c);
    }
    cases = keep;
  }
  std::vector<CaseReport> reports;
  Outcome worst_all = Outcome::PASSED;
  out << "moeverify " << MOEVERIFY_VERSION << "  threads=" << threads;
  if (mpi) out << "  mpi ranks=" << world;
  if (opt.faults.bits) {
    out << "  PLANTED FAULTS:";
    for (const auto& f : faults) out << " " << f;
  }
  out << "\n";
  if (!skipped.empty()) {
    out << "skipped under mpirun -np " << world << " (ep must equal the process count):";
    for (const auto& n : skipped) out << " " << n;
    out << "\n";
  }
  size_t total = 0, done = 0;
  for (const auto& [file, cases] : all)
    for (const auto& c : cases) total += only.empty() || c.name == only;
  if (mpi) mpi_agree_on_case_count(int64_t(total));  // before any rank can stop alone
  if (total == 0)
    bad_input(only.empty() ? "no case with ep " + std::to_string(world) + " to run under mpirun -np " + std::to_string(world)
                           : "--case " + only + ": no case of that name in the given files");
  for (const auto& [file, cases] : all) {
    for (const auto& c : cases) {
      if (!only.empty() && c.name != only) continue;
      ++done;
      if (&out == &std::cout) std::cerr << "[" << done << "/" << total << "] " << c.name << "\n";
      reports.push_back(run_case(c, opt));
      print_report(reports.back(), out);
      worst_all = worst(worst_all, reports.back().outcome);
    }
  }
  print_tolerance_table(reports, out);
  size_t passed = 0;
  for (const auto& r : reports) passed += r.outcome == Outcome::PASSED;
  out << "\n" << passed << " of " << reports.size() << " case(s) PASSED; overall " << outcome_name(worst_all)
            << "\n";
  if (!json.empty() && &out == &std::cout) {
    std::ofstream o(json);
    if (!o) runtime_error("cannot write --json file " + json);
    o << reports_json(reports, files.size() == 1 ? files[0] : "(several)");
  }
  return exit_status(worst_all);
}

int cmd_validate(const std::vector<std::string>& files, const std::vector<std::string>& sets, bool keys) {
  if (keys) {
    for (const auto& [k, h] : case_keys()) std::cout << "  " << k << ": " << h << "\n";
    if (files.empty()) return 0;
  }
  for (const auto& f : files) {
    const auto cases = load_cases(f, sets);
    std::cout << f << ": " << cases.size() << " case(s) valid\n";
    for (const auto& c : cases) std::cout << "  " << c.name << ": " << c.summary() << "\n";
  }
  return 0;
}

int cmd_list() {
  std::cout << "registered stage variants (slot order; every applicable variant runs, the primary feeds the next slot):\n";
  for (const auto& slot : slot_order()) {
    std::cout << "\n" << slot << "\n";
    for (const auto& s : registry())
      if (s.slot == slot) std::cout << "  " << s.variant << ": " << s.summary << "\n";
  }
  const CudaStatus cs = cuda_status();
  std::cout << "\nCUDA executor: " << (cs.built ? "built" : "not built") << ", " << cs.devices
            << " usable device(s): " << cs.message << "\n";
  std::cout << "\nplanted faults (--fault NAME):\n";
  for (const auto& f : fault_table()) std::cout << "  " << f.name << ": " << f.what << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moeverify: verify fast MoE token paths against an independent CPU reference"};
  app.set_version_flag("--version", std::string("moeverify ") + MOEVERIFY_VERSION);
  app.require_subcommand(1);

  std::vector<std::string> files, sets, faults;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  std::string json, dump, only;
  auto* run = app.add_subcommand("run", "run every case of the files: reference vs fast, stage by stage");
  run->add_option("files", files, "case files (YAML)")->required();
  run->add_option("--set", sets, "override a case key for every case, e.g. --set shape.tokens=128");
  run->add_option("--threads", threads, "host executor threads")->check(CLI::Range(1, 256));
  run->add_option("--json", json, "also write the report as JSON to this file");
  run->add_option("--dump", dump, "write every stage's inputs and outputs as .npy under this folder");
  run->add_option("--fault", faults, "turn on a planted fault (see `moeverify list`); the run must then fail");
  run->add_option("--case", only, "run only the case of this name");
  double timeout_s = 30;
  run->add_option("--collective-timeout", timeout_s, "seconds before an unjoined in-process collective fails")
      ->check(CLI::Range(0.05, 3600.0));

  bool keys = false;
  std::vector<std::string> vfiles, vsets;
  auto* val = app.add_subcommand("validate", "check case files without running them");
  val->add_option("files", vfiles, "case files (YAML)");
  val->add_option("--set", vsets, "override a case key, as for run");
  val->add_flag("--keys", keys, "list every case key with its valid values");

  app.add_subcommand("list", "list registered paths, their stages, and the planted faults");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (run->parsed()) {
      const int rc = cmd_run(files, sets, threads, json, dump, faults, only, timeout_s);
      mpi_finalize_if_started();
      return rc;
    }
    if (val->parsed()) {
      if (vfiles.empty() && !keys) bad_input("validate: give case files, or --keys");
      return cmd_validate(vfiles, vsets, keys);
    }
    return cmd_list();
  } catch (const Error& e) {
    std::cerr << "moeverify: " << e.what() << "\n";
    return e.kind == ErrorKind::bad_input ? 2 : 3;
  } catch (const std::exception& e) {
    std::cerr << "moeverify: internal error: " << e.what() << "\n";
    return 3;
  }
}
