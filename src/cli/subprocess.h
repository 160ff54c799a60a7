// Running a user's implementation from `fuzz --impl` (docs/guide.md "Fuzz your
// own implementation"): a shell command once per case folder, or a worker
// process started once that answers one line per case folder.
//
// Both run CMD through /bin/sh -c in a process group of its own, so that a
// timeout ends the command and everything it started. Their stdout and
// stderr are read while they run (a full pipe never blocks them); the last
// kTailBytes of each are kept for the report.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <string>

namespace moev {

constexpr size_t kTailBytes = 4096;

/// How one run of a command ended.
struct ProcEnd {
  enum class How { exited, signalled, timed_out, not_started, stopped } how = How::not_started;
  int code = 0;    // exited: the exit status; signalled: the signal
  double seconds = 0;
  std::string out_tail, err_tail;  // the last kTailBytes of stdout and stderr
  /// "exit status 3", "killed by signal 11 (Segmentation fault)", "timed out after 60 s", ...
  /// timeout_flag: the option that set timeout_s, named beside a timeout.
  std::string describe(double timeout_s, const char* timeout_flag) const;
};

/// Set (from a signal handler too) when the commands under way must end
/// now, not when they finish (a second Ctrl-C): run_command and
/// Worker::request then end the command's process group within 50 ms, as
/// How::stopped. Its process group is its own, so the terminal's Ctrl-C
/// never reaches it.
extern std::atomic<bool> g_stop_commands;

/// Runs `cmd` through /bin/sh -c with stdin from /dev/null; kills its process
/// group after `timeout_s` seconds, or at g_stop_commands.
ProcEnd run_command(const std::string& cmd, double timeout_s);

/// A worker: `cmd` started once, sent one case folder per line on stdin,
/// answering one line on stdout per folder ("done", "skip REASON" or
/// "error REASON"). Not copyable; the destructor ends the process group.
class Worker {
 public:
  explicit Worker(std::string cmd) : cmd_(std::move(cmd)) {}
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() { stop(); }

  /// Sends `folder` (started first when not running) and waits for the
  /// answer line: true with `answer` set when one came. Otherwise (a crash,
  /// a timeout, stdout closed) the worker is stopped, the next request starts
  /// a new one, and `end` says how it ended, with the stderr it wrote since
  /// this request.
  bool request(const std::string& folder, double timeout_s, std::string& answer, ProcEnd& end);
  /// What the worker wrote on stdout beyond one answer line per folder,
  /// seen by the last request (before it sent its folder, or after the
  /// answer line); "" when nothing. Where it is not empty the worker was
  /// stopped, and the next request starts a new one.
  const std::string& unrequested() const { return unrequested_; }
  /// Whether the last request started the worker: its answer is the first
  /// line the new process wrote (where a start-up banner would be).
  bool started_by_last_request() const { return started_now_; }
  /// Closes stdin, waits up to `grace_s` for the worker to exit, then kills
  /// its process group.
  void stop(double grace_s = 2.0);

 private:
  bool start(ProcEnd& end);
  std::string cmd_;
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1, err_ = -1;
  std::string pending_;  // stdout bytes after the last answer line
  std::string unrequested_;
  bool started_now_ = false;
};

/// How a printed command line (a repro line) names this program: the path
/// it was started by where that has a '/' (`./build/moeverify`, as the user
/// typed it), else `moeverify` (found on the PATH). main sets it once.
void set_self_command(const char* argv0);
const std::string& self_command();

/// `s` quoted for /bin/sh: '...' with every ' written as '\''.
std::string shell_quote(const std::string& s);
/// A shell word for a printed command line: as it is when plain, else shell_quote'd.
std::string shell_word(const std::string& w);

}  // namespace moev
