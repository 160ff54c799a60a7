// The golden folder's pieces shared inside src/cli/ by export and check
// (docs/contract.md §15; the format is in export_check.h):
// golden_manifest.cpp writes and reads manifest.json, npy_read.cpp reads
// the implementation's files, export_check.cpp runs the stage-by-stage check.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "case.h"
#include "export_check.h"

namespace moev {
namespace golden {

/// The NumPy name of a tensor's real type ("bfloat16", "int32", ...).
const char* real_dtype(ElemType t);
/// The .npy descriptor a tensor is stored with ("<f4"; "<u2" for bf16/fp16 bits).
const char* npy_descr(ElemType t);
/// A tensor's shape and row order in the symbols of docs/contract.md, for
/// the manifest's "layout" ("" for a name it does not know).
std::string layout_of(const std::string& name);

/// A golden folder's manifest.json, checked: its case (within the memory
/// limit) and its tensor entries.
struct Manifest {
  Case c;
  nlohmann::json tensors;
};
/// Reads FOLDER/manifest.json; bad input naming what would be valid when it
/// is not a manifest of this format.
Manifest read_manifest(const std::string& folder);
/// The "file" of every entry with role "expected".
std::set<std::string> expected_files(const nlohmann::json& tensors);

bool is_dir(const std::string& p);
bool is_file(const std::string& p);

/// The implementation's files in `actual_dir`, each a regular file named as
/// an expected entry of the manifest: anything else is refused (exit 2) with
/// the nearest valid name, or with `allow_unknown` listed in `ignored`.
std::set<std::string> actual_files(const std::string& actual_dir, const std::set<std::string>& expected,
                                   bool allow_unknown, std::vector<std::string>& ignored);

}  // namespace golden
}  // namespace moev
