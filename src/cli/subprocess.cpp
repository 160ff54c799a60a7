#include "subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

namespace moev {

std::atomic<bool> g_stop_commands{false};
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void keep_tail(std::string& tail, const char* p, size_t n) {
  tail.append(p, n);
  if (tail.size() > kTailBytes) tail.erase(0, tail.size() - kTailBytes);
}

/// fork + exec of /bin/sh -c cmd in a new process group. The pipes are
/// made close-on-exec, so that a command started by another thread never
/// inherits them; dup2 clears the flag on the child's 0, 1 and 2. The child
/// calls only async-signal-safe functions before exec.
pid_t spawn(const std::string& cmd, bool stdin_pipe, int& in, int& out, int& err) {
  int pin[2] = {-1, -1}, pout[2], perr[2];
  if (stdin_pipe && pipe2(pin, O_CLOEXEC) != 0) return -1;
  if (pipe2(pout, O_CLOEXEC) != 0) return -1;
  if (pipe2(perr, O_CLOEXEC) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    const int fin = stdin_pipe ? pin[0] : open("/dev/null", O_RDONLY);
    if (fin < 0 || dup2(fin, 0) < 0 || dup2(pout[1], 1) < 0 || dup2(perr[1], 2) < 0) _exit(127);
    // Undo the fuzz's SIG_IGN of SIGPIPE: an ignored disposition survives exec.
    signal(SIGPIPE, SIG_DFL);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  if (stdin_pipe) ::close(pin[0]);
  ::close(pout[1]);
  ::close(perr[1]);
  if (pid < 0) {
    if (stdin_pipe) ::close(pin[1]);
    ::close(pout[0]);
    ::close(perr[0]);
    return -1;
  }
  setpgid(pid, pid);  // also here: whichever of parent and child runs first
  in = stdin_pipe ? pin[1] : -1;
  out = pout[0];
  err = perr[0];
  // Reads never block: poll says which pipe has data, drain takes what is there.
  for (int fd : {out, err}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return pid;
}

/// Reads what is ready on `fd` (closing it at end of file) into `sink`.
void drain(int& fd, std::string& sink, bool tail_only) {
  char buf[8192];
  const ssize_t n = ::read(fd, buf, sizeof buf);
  if (n > 0) {
    if (tail_only) keep_tail(sink, buf, size_t(n));
    else sink.append(buf, size_t(n));
  } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
    close_fd(fd);
  }
}

/// Waits up to `ms` for data on the open ones of `a` and `b`.
void wait_readable(int a, int b, int ms) {
  pollfd p[2];
  int n = 0;
  for (int fd : {a, b})
    if (fd >= 0) p[n++] = {fd, POLLIN, 0};
  if (n == 0) {
    usleep(useconds_t(ms) * 1000);
    return;
  }
  poll(p, nfds_t(n), ms);
}

void set_end(ProcEnd& e, int status) {
  if (WIFSIGNALED(status)) {
    e.how = ProcEnd::How::signalled;
    e.code = WTERMSIG(status);
  } else {
    e.how = ProcEnd::How::exited;
    e.code = WEXITSTATUS(status);
  }
}

void kill_group(pid_t pid) {
  kill(-pid, SIGKILL);
  kill(pid, SIGKILL);
}

}  // namespace

std::string ProcEnd::describe(double timeout_s, const char* timeout_flag) const {
  std::ostringstream o;
  switch (how) {
    case How::exited: o << "exit status " << code; break;
    case How::signalled: o << "killed by signal " << code << " (" << strsignal(code) << ")"; break;
    case How::timed_out: o << "timed out after " << timeout_s << " s (" << timeout_flag << ")"; break;
    case How::not_started: o << "could not be started"; break;
    case How::stopped: o << "stopped by an interrupt"; break;
  }
  return o.str();
}

namespace {
std::string g_self = "moeverify";
}  // namespace

void set_self_command(const char* argv0) {
  if (argv0 && std::strchr(argv0, '/')) g_self = shell_word(argv0);
}

const std::string& self_command() { return g_self; }

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

std::string shell_word(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:") == std::string::npos)
    return w;
  return shell_quote(w);
}

ProcEnd run_command(const std::string& cmd, double timeout_s) {
  ProcEnd e;
  const auto t0 = Clock::now();
  int in = -1, out = -1, err = -1;
  const pid_t pid = spawn(cmd, false, in, out, err);
  if (pid < 0) {
    e.err_tail = std::string("fork/pipe failed: ") + std::strerror(errno);
    return e;
  }
  int status = 0;
  bool exited = false;
  while (true) {
    wait_readable(out, err, 50);
    if (out >= 0) drain(out, e.out_tail, true);
    if (err >= 0) drain(err, e.err_tail, true);
    if (!exited && waitpid(pid, &status, WNOHANG) == pid) exited = true;
    // Done when the command has exited and its output is read (a process it
    // left in the background may hold the pipes: it is ended below).
    if (exited && (out < 0 && err < 0)) break;
    if (exited && since(t0) > timeout_s) break;
    if (!exited && (since(t0) > timeout_s || g_stop_commands)) {
      kill_group(pid);
      waitpid(pid, &status, 0);
      e.how = g_stop_commands ? ProcEnd::How::stopped : ProcEnd::How::timed_out;
      break;
    }
    if (exited) {  // give its output a moment, then stop waiting for a background holder
      wait_readable(out, err, 100);
      if (out >= 0) drain(out, e.out_tail, true);
      if (err >= 0) drain(err, e.err_tail, true);
      break;
    }
  }
  if (e.how != ProcEnd::How::timed_out && e.how != ProcEnd::How::stopped) set_end(e, status);
  kill_group(pid);  // anything the command left running in its group
  close_fd(out);
  close_fd(err);
  e.seconds = since(t0);
  return e;
}

bool Worker::start(ProcEnd& end) {
  pending_.clear();
  pid_ = spawn(cmd_, true, in_, out_, err_);
  if (pid_ < 0) {
    end.how = ProcEnd::How::not_started;
    end.err_tail = std::string("fork/pipe failed: ") + std::strerror(errno);
    return false;
  }
  return true;
}

bool Worker::request(const std::string& folder, double timeout_s, std::string& answer, ProcEnd& e) {
  e = ProcEnd{};
  const auto t0 = Clock::now();
  unrequested_.clear();
  // Output since the last answer line (a second answer, noise) came
  // unasked: taken as the answer for this folder it would have this folder
  // judged before it is written. It is kept for the caller, and the worker
  // started afresh.
  if (pid_ >= 0 && out_ >= 0) drain(out_, pending_, false);
  if (!pending_.empty()) {
    unrequested_ = pending_;
    stop(0);
  }
  started_now_ = pid_ < 0;
  if (pid_ < 0 && !start(e)) return false;
  const std::string line = folder + "\n";
  const bool sent = ::write(in_, line.data(), line.size()) == ssize_t(line.size());
  int status = 0;
  while (true) {
    const size_t nl = pending_.find('\n');
    if (nl != std::string::npos) {
      answer = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (!pending_.empty()) {  // more than one line for one folder
        unrequested_ = pending_;
        stop(0);
      }
      e.seconds = since(t0);
      return true;
    }
    if (!sent || out_ < 0 || waitpid(pid_, &status, WNOHANG) == pid_) {
      // It died (or closed stdout) without an answer: collect its stderr.
      wait_readable(err_, -1, 100);
      if (err_ >= 0) drain(err_, e.err_tail, true);
      if (waitpid(pid_, &status, WNOHANG) == pid_ || (kill_group(pid_), waitpid(pid_, &status, 0) == pid_))
        set_end(e, status);
      pid_ = -1;
      stop(0);
      e.seconds = since(t0);
      return false;
    }
    if (since(t0) > timeout_s || g_stop_commands) {
      e.how = g_stop_commands ? ProcEnd::How::stopped : ProcEnd::How::timed_out;
      kill_group(pid_);
      waitpid(pid_, &status, 0);
      if (err_ >= 0) drain(err_, e.err_tail, true);
      pid_ = -1;
      stop(0);
      e.seconds = since(t0);
      return false;
    }
    wait_readable(out_, err_, 50);
    if (out_ >= 0) drain(out_, pending_, false);
    if (err_ >= 0) drain(err_, e.err_tail, true);
  }
}

void Worker::stop(double grace_s) {
  close_fd(in_);
  if (pid_ > 0) {
    const auto t0 = Clock::now();
    int status = 0;
    bool gone = false;
    while (!gone && since(t0) < grace_s) {
      gone = waitpid(pid_, &status, WNOHANG) == pid_;
      if (!gone) usleep(10000);
    }
    kill_group(pid_);
    if (!gone) waitpid(pid_, &status, 0);
  }
  pid_ = -1;
  close_fd(out_);
  close_fd(err_);
  pending_.clear();
}

}  // namespace moev
