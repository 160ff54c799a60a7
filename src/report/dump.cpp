#include "dump.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "error.h"
#include "report.h"
#include "version.h"

namespace moev {
namespace {

std::string errno_text(int e) { return std::strerror(e); }

/// The kernel pseudo file system `path` lies on ("" for a real one). Writes
/// to such files are accepted by open() and then fail or vanish
/// (/proc/version takes the open and fails the write).
std::string pseudo_fs(const std::string& path) {
  struct statfs sf {};
  if (statfs(path.c_str(), &sf) != 0) return "";
  struct Known {
    long magic;
    const char* name;
  };
  static const Known known[] = {{PROC_SUPER_MAGIC, "proc"},     {SYSFS_MAGIC, "sysfs"},
                                {CGROUP_SUPER_MAGIC, "cgroup"}, {CGROUP2_SUPER_MAGIC, "cgroup2"},
                                {DEBUGFS_MAGIC, "debugfs"},     {SECURITYFS_MAGIC, "securityfs"},
                                {TRACEFS_MAGIC, "tracefs"},     {BPF_FS_MAGIC, "bpf"}};
  for (const auto& k : known)
    if (static_cast<long>(sf.f_type) == k.magic) return k.name;
  return "";
}

const char* file_kind(mode_t m) {
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISDIR(m)) return "a folder";
  if (S_ISREG(m)) return "a file";
  return "not a regular file";
}

/// The folder holding `path`; trailing slashes are not a level ("out/" is in ".").
std::string parent_of(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const std::string p = std::filesystem::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

/// The parent folder of a path to be created exists, is a folder and is not
/// on a pseudo file system.
void check_parent(const std::string& flag, const std::string& path, const std::string& valid) {
  const std::string parent = parent_of(path), shown = printable(path, 200);
  struct stat st {};
  if (stat(parent.c_str(), &st) != 0)
    bad_input(flag + " " + shown + ": the folder " + printable(parent, 200) + " does not exist (" +
              errno_text(errno) + "); " + valid);
  if (!S_ISDIR(st.st_mode)) bad_input(flag + " " + shown + ": " + printable(parent, 200) + " is not a folder; " + valid);
  const std::string fs = pseudo_fs(parent);
  if (!fs.empty())
    bad_input(flag + " " + shown + ": lies on the kernel's " + fs + " file system, which keeps nothing written; " + valid);
}

std::string hash8(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char ch : s) {
    h ^= static_cast<unsigned char>(ch);
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x", unsigned(h ^ (h >> 32)));
  return buf;
}

}  // namespace

std::string dump_folder_name(const std::string& case_name) {
  constexpr size_t kMaxChars = 100;
  std::string s;
  bool leading = true;
  for (const char ch : case_name) {
    const bool keep = std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' || ch == '_';
    s += keep && !(leading && ch == '.') ? ch : '_';
    leading = false;
  }
  if (s.size() > kMaxChars) s.resize(kMaxChars);
  if (s != case_name || s.empty()) s += "-" + hash8(case_name);
  return s;
}

void Dumper::open(const std::string& root, const std::string& case_name) {
  // Folders handed out in this process: a second case of the same name (from
  // another file) gets "-2", "-3", ... rather than overwriting the first.
  static std::mutex mu;
  static std::set<std::string> used;
  const std::lock_guard<std::mutex> lock(mu);
  const std::string base = root + "/" + dump_folder_name(case_name);
  dir = base;
  for (int n = 2; !used.insert(dir).second; ++n) dir = base + "-" + std::to_string(n);
  note_left_in_place(dir, prepare_case_folder(dir, "--dump", FolderKind::dump), "--dump");
  manifest_.clear();
}

void Dumper::put(const std::string& name, const Tensor& t) {
  if (dir.empty()) return;
  std::string file;
  for (const char ch : name)  // tensor names come from the registry: dots, '@' for a rank
    file += std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '-' || ch == '_' ? ch : '_';
  file += ".npy";
  write_npy(dir + "/" + file, t);
  manifest_.push_back({file, elem_name(t.type), t.shape});
}

void Dumper::finish(const Case& c) {
  if (dir.empty()) return;
  nlohmann::ordered_json m;
  m["format"] = kDumpFormat;  // what a later --dump into this folder may replace
  m["tool"] = std::string("moeverify ") + MOEVERIFY_VERSION;
  m["case"] = c.name;
  m["note"] = "bf16 and fp16 tensors are stored as uint16 bit patterns";
  m["tensors"] = nlohmann::ordered_json::array();
  for (const Entry& e : manifest_)
    m["tensors"].push_back({{"file", e.file}, {"dtype", e.dtype}, {"shape", e.shape}});
  // Invalid UTF-8 in a case name is replaced (U+FFFD), never a throw.
  const std::string text = m.dump(1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  const std::string err = write_file(dir + "/manifest.json", {text}, /*no_follow=*/true);
  if (!err.empty()) runtime_error("--dump: " + err);
}

void prepare_dump_root(const std::string& dir, const std::string& flag) {
  const std::string valid = "valid: a writable folder (created when missing, in an existing folder)";
  if (dir.empty()) bad_input(flag + ": the path is empty; " + valid);
  const std::string shown = printable(dir, 200);
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) bad_input(flag + " " + shown + ": exists and is " + file_kind(st.st_mode) + "; " + valid);
  } else {
    if (errno != ENOENT) bad_input(flag + " " + shown + ": " + errno_text(errno) + "; " + valid);
    check_parent(flag, dir, valid);
    if (mkdir(dir.c_str(), 0755) != 0)
      bad_input(flag + " " + shown + ": cannot create the folder (" + errno_text(errno) + "); " + valid);
  }
  const std::string fs = pseudo_fs(dir);
  if (!fs.empty())
    bad_input(flag + " " + shown + ": lies on the kernel's " + fs + " file system, which keeps nothing written; " + valid);
  const std::string probe = dir + "/.moeverify-probe-" + std::to_string(getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) bad_input(flag + " " + shown + ": cannot create files in it (" + errno_text(errno) + "); " + valid);
  ::close(fd);
  ::unlink(probe.c_str());
}

namespace {

/// Whether `path` lies inside `dir` (both made absolute, `.` and `..` and
/// links of what exists resolved).
bool inside(const std::string& path, const std::string& dir) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  if (ec) return false;
  const std::filesystem::path d = std::filesystem::weakly_canonical(dir, ec);
  if (ec) return false;
  auto pi = p.begin();
  for (auto di = d.begin(); di != d.end(); ++di, ++pi)
    if (pi == p.end() || *pi != *di) return false;
  return pi != p.end();
}

/// Refuses an output path that would overwrite what the command reads: the
/// same file as one of `reads`, or a manifest.json or .npy inside a folder
/// among them (a golden or dump folder's own files).
void refuse_overwriting_input(const std::string& flag, const std::string& path, const std::vector<std::string>& reads,
                              const std::string& valid) {
  struct stat out {};
  const bool exists = stat(path.c_str(), &out) == 0;
  const std::string name = std::filesystem::path(path).filename().string();
  const bool folder_file = name == "manifest.json" ||
                           (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0);
  for (const std::string& r : reads) {
    struct stat in {};
    if (stat(r.c_str(), &in) != 0) continue;
    const bool same = exists && S_ISREG(in.st_mode) && in.st_dev == out.st_dev && in.st_ino == out.st_ino;
    if (same || (S_ISDIR(in.st_mode) && folder_file && inside(path, r)))
      bad_input(flag + " " + printable(path, 200) + ": " +
                (same ? std::string("is ") + printable(r, 200) + ", which this command reads"
                      : "lies in " + printable(r, 200) + ", a folder this command reads, among its own files") +
                ": writing it would overwrite an input; " + valid);
  }
}

}  // namespace

void check_output_file(const std::string& flag, const std::string& path, const std::vector<std::string>& reads) {
  const std::string valid = "valid: a writable file path such as report.json";
  if (path.empty()) bad_input(flag + ": the path is empty; " + valid);
  refuse_overwriting_input(flag, path, reads, valid);
  const std::string shown = printable(path, 200);
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    bad_input(flag + " " + shown + ": is a symbolic link (not followed: a report never writes through one); " + valid);
  if (stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
      bad_input(flag + " " + shown + ": is " + file_kind(st.st_mode) + "; " + valid);
    const std::string fs = pseudo_fs(path);
    if (!fs.empty())
      bad_input(flag + " " + shown + ": lies on the kernel's " + fs + " file system, which keeps nothing written; " +
                valid);
    if (S_ISFIFO(st.st_mode)) return;  // opening a FIFO for writing waits for its reader
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);  // no truncation yet
    if (fd < 0) bad_input(flag + " " + shown + ": cannot be opened for writing (" + errno_text(errno) + "); " + valid);
    ::close(fd);
    return;
  }
  if (errno != ENOENT) bad_input(flag + " " + shown + ": " + errno_text(errno) + "; " + valid);
  check_parent(flag, path, valid);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) bad_input(flag + " " + shown + ": cannot be created (" + errno_text(errno) + "); " + valid);
  ::close(fd);
  ::unlink(path.c_str());
}

namespace {

/// A manifest.json moeverify wrote: its "format" and the files it lists.
struct OwnManifest {
  std::string format;
  std::set<std::string> files;
};

/// The manifest at `path` when moeverify wrote it (a JSON object whose
/// "format" is one of moeverify's and whose "tool" names moeverify);
/// nullopt for anyone else's. Only plain names count: a listed path with a
/// separator or "..", or an absolute one, is never removed.
std::optional<OwnManifest> own_manifest(const std::string& path) {
  nlohmann::json m;
  try {
    std::ifstream f(path);
    m = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  static const std::set<std::string> formats = {"moeverify-golden/2", "moeverify-golden/1", kDumpFormat};
  if (!m.is_object() || !m.contains("format") || !m["format"].is_string() || !formats.count(m["format"]) ||
      !m.contains("tool") || !m["tool"].is_string() || m["tool"].get<std::string>().rfind("moeverify", 0) != 0)
    return std::nullopt;
  OwnManifest own{m["format"].get<std::string>(), {}};
  if (m.contains("tensors") && m["tensors"].is_array())
    for (const auto& t : m["tensors"])
      if (t.is_object() && t.contains("file") && t["file"].is_string()) {
        const std::string f = t["file"];
        if (!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..") own.files.insert(f);
      }
  return own;
}

/// An implementation's outputs in `dir`/actual/ named as the earlier
/// export's tensors: computed from that export's inputs, they would be
/// judged against the new one's (a stale PASSED where the implementation
/// no longer runs, a false INCORRECT where the inputs changed). They are
/// removed, and said on stderr; anything else in actual/ stays, and an
/// actual/ left empty is removed (then true is returned).
bool remove_stale_outputs(const std::string& dir, const std::set<std::string>& listed, const std::string& flag) {
  const std::string actual = dir + "/actual";
  struct stat st {};
  if (lstat(actual.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(actual, ec)) {
    const std::string n = e.path().filename().string();
    if (listed.count(n) && !e.is_directory() && ::unlink(e.path().c_str()) == 0) ++removed;
  }
  if (removed == 0) return false;
  const bool empty = std::filesystem::is_empty(actual, ec) && ::rmdir(actual.c_str()) == 0;
  std::cerr << flag << ": removed " << removed << " output file(s) of the earlier export from " << printable(actual, 200)
            << (empty ? " (and the folder)" : "") << ": they were computed from its inputs, not this export's\n";
  return empty;
}

}  // namespace

std::vector<std::string> prepare_case_folder(const std::string& dir, const std::string& flag, FolderKind kind) {
  const std::string shown = printable(dir, 200);
  const char* own = kind == FolderKind::golden ? "an earlier `moeverify export`" : "an earlier --dump";
  const std::string valid = std::string("valid: a new or empty folder, or one that ") + own + " wrote (its manifest.json)";
  struct stat st {};
  if (lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) bad_input(flag + ": " + shown + ": " + errno_text(errno) + "; " + valid);
    if (mkdir(dir.c_str(), 0755) != 0)
      bad_input(flag + ": cannot create " + shown + " (" + errno_text(errno) + "); " + valid);
    return {};
  }
  if (S_ISLNK(st.st_mode)) bad_input(flag + ": " + shown + " is a symbolic link (not followed); " + valid);
  if (!S_ISDIR(st.st_mode)) bad_input(flag + ": " + shown + " exists and is " + file_kind(st.st_mode) + "; " + valid);
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries.push_back(e.path().filename().string());
  std::sort(entries.begin(), entries.end());
  if (entries.empty()) return {};
  struct stat ms {};
  const std::string manifest = dir + "/manifest.json";
  if (lstat(manifest.c_str(), &ms) != 0 || !S_ISREG(ms.st_mode))
    bad_input(flag + ": " + shown + " holds files that moeverify did not write (no manifest.json), e.g. " +
              printable(entries[0], 100) + "; " + valid);
  const std::optional<OwnManifest> m = own_manifest(manifest);
  if (!m)
    bad_input(flag + ": " + printable(manifest, 200) + " is not a manifest moeverify wrote (no moeverify \"format\" "
              "and \"tool\"): nothing in " + shown + " is replaced; " + valid);
  // A golden folder is never turned into a dump, nor a dump into a golden
  // folder: the one holds expected tensors (and perhaps a user's actual/),
  // the other a run's tensors, and neither is the other's to replace.
  const bool is_golden = m->format.rfind("moeverify-golden/", 0) == 0;
  if (is_golden != (kind == FolderKind::golden))
    bad_input(flag + ": " + shown + " is " +
              (is_golden ? "a golden folder written by `moeverify export`" : "a --dump folder written by `moeverify run`") +
              " (format " + m->format + "), not " + own + "'s: nothing in it is replaced; " + valid);
  // an actual/ emptied of stale outputs is gone, not left in place
  if (kind == FolderKind::golden && remove_stale_outputs(dir, m->files, flag))
    entries.erase(std::remove(entries.begin(), entries.end(), "actual"), entries.end());
  // Only what that manifest lists (and the manifest) is replaced.
  std::vector<std::string> left;
  for (const std::string& n : entries) {
    if (n != "manifest.json" && !m->files.count(n)) {
      left.push_back(n);
      continue;
    }
    const std::string p = dir + "/" + n;
    struct stat es {};
    if (lstat(p.c_str(), &es) == 0 && S_ISDIR(es.st_mode))
      bad_input(flag + ": " + printable(p, 200) + " is a folder where a file goes; " + valid);
    if (::unlink(p.c_str()) != 0) bad_input(flag + ": cannot replace " + printable(p, 200) + " (" + errno_text(errno) + ")");
  }
  return left;
}

void note_left_in_place(const std::string& dir, const std::vector<std::string>& left, const std::string& flag) {
  if (left.empty()) return;
  std::string l;
  for (const auto& n : left) l += (l.empty() ? "" : ", ") + printable(n, 100);
  std::cerr << (flag + ": left in place in " + printable(dir, 200) + " (not listed in its manifest): " + l + "\n");
}

std::string write_file(const std::string& path, const std::vector<std::string_view>& parts, bool no_follow) {
  const std::string shown = printable(path, 200);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (no_follow ? O_NOFOLLOW : 0), 0644);
  if (fd < 0) return "cannot open " + shown + " for writing (" + errno_text(errno) + ")";
  for (const std::string_view part : parts) {
    size_t done = 0;
    while (done < part.size()) {
      const ssize_t n = ::write(fd, part.data() + done, part.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : EIO;
        ::close(fd);
        return "cannot write " + shown + " (" + errno_text(e) + ")";
      }
      done += size_t(n);
    }
  }
  if (::close(fd) != 0) return "cannot write " + shown + " (" + errno_text(errno) + " at close)";
  return "";
}

}  // namespace moev
