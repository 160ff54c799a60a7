// Output files of a run: --dump (every stage's inputs and outputs as .npy in
// one folder per case, with a manifest.json) and the checks and writes for
// --json. Every output path is checked before any case runs, and every write
// is checked through its close, so a full disk or a pseudo file is reported,
// never a success with nothing written.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "case.h"
#include "tensor.h"

namespace moev {

/// Writes the tensors of one case under its own folder of the dump root.
/// With an empty `dir` (dumping off) put and finish do nothing.
struct Dumper {
  std::string dir;  // the case's folder; empty: no dump

  /// Creates the case's folder under `root` (prepare_dump_root made sure
  /// `root` is a writable folder): dump_folder_name(case_name), made unique
  /// within the process (two files may both hold a case of that name).
  void open(const std::string& root, const std::string& case_name);
  /// Writes `t` as <name>.npy and records it in the manifest.
  void put(const std::string& name, const Tensor& t);
  /// Writes manifest.json: {"case", "note", "tensors": [{"file", "dtype", "shape"}]}.
  void finish(const Case& c);

 private:
  struct Entry {
    std::string file, dtype;
    std::vector<int64_t> shape;
  };
  std::vector<Entry> manifest_;
};

/// A case's folder name: bytes outside [A-Za-z0-9._-] become '_', leading
/// dots too (never '.', '..' or a hidden folder), at most 100 characters;
/// when that changed the name, "-" and 8 hex digits of a hash of the original
/// follow, so "x y" and "x_y" get distinct folders.
std::string dump_folder_name(const std::string& case_name);

/// --dump preflight: `dir` is an existing folder, or one that can be made in
/// an existing folder; files can be created in it; it is not on a kernel
/// pseudo file system. Creates it. Throws Error(bad_input) naming `flag`
/// (--dump, or `export DIR`).
void prepare_dump_root(const std::string& dir, const std::string& flag = "--dump");

/// --json-style preflight of an output file: a non-empty path, not a
/// symbolic link, to an existing regular file (or FIFO) that opens for writing, or a new file that can be
/// created in an existing folder, not on a kernel pseudo file system (where
/// writes vanish), and not one of the files the command reads: the same
/// file as one of `reads` (case files, a profile), nor a manifest.json or
/// .npy inside a folder among them (a golden folder). Creates nothing it
/// does not remove. Throws Error(bad_input) naming `flag`.
void check_output_file(const std::string& flag, const std::string& path, const std::vector<std::string>& reads = {});

/// Writes `parts` in order to `path` (created or truncated) and closes it.
/// Returns "" on success, else what failed with strerror: every write and the
/// close are checked (a full device fails at write or close time). With
/// `no_follow` a symbolic link at `path` is refused, never written through.
std::string write_file(const std::string& path, const std::vector<std::string_view>& parts, bool no_follow = false);

/// The "format" of a --dump folder's manifest.json.
inline constexpr const char* kDumpFormat = "moeverify-dump/1";

/// Which of moeverify's case folders prepare_case_folder makes: a golden
/// folder (`export`) or a --dump folder (`run --dump`).
enum class FolderKind { golden, dump };

/// Makes `dir` a case folder that this run may fill: created when missing;
/// when it exists it must be a real folder (not a link) that is empty or
/// holds a manifest.json moeverify wrote for the same kind of folder
/// ("format" moeverify-golden/* or moeverify-dump/*, and "tool" naming
/// moeverify). Then that manifest and the files it lists are removed and
/// every other entry is left in place: their names are returned. A folder
/// with anyone else's manifest.json, with the other kind's, or with files
/// and no manifest, is bad input (exit 2) and nothing in it is touched.
std::vector<std::string> prepare_case_folder(const std::string& dir, const std::string& flag, FolderKind kind);
/// One line on stderr naming what prepare_case_folder left in place (nothing when none).
void note_left_in_place(const std::string& dir, const std::vector<std::string>& left, const std::string& flag);

}  // namespace moev
