// `moeverify export` and `moeverify check` (DESIGN.md "export and check",
// CONTRACT §15): golden files for an implementation moeverify did not write,
// and a stage-by-stage verdict on that implementation's outputs.
//
// Golden folder of one case (format "moeverify-golden/1"):
//   manifest.json  {"format", "case": the resolved configuration as dotted
//                   case keys, "ranks": R, "tensors": [{"name", "stage",
//                   "role": "input" | "expected", "rank", "file", "dtype",
//                   "shape", "layout"}]}
//   NAME.npy       (R = 1) or NAME.rankR.npy (R > 1); bf16/fp16 stored as
//                  uint16 bit patterns, "dtype" names the real type.
//   actual/        where `check` looks for the implementation's outputs by
//                  default: the same file names, any subset.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "case.h"
#include "runner.h"

namespace moev {

/// The golden format written by export and read by check.
inline constexpr const char* kGoldenFormat = "moeverify-golden/1";

/// The resolved configuration of a case as {dotted key: value}; loading it
/// back with case_from_json gives the same case (tokens resolved per rank).
nlohmann::ordered_json case_to_json(const Case& c);
/// The case of a manifest's "case" object, validated as a case file entry;
/// `where` names the manifest in messages. Throws Error(bad_input).
Case case_from_json(const nlohmann::json& j, const std::string& where);

/// Reads a NumPy .npy file (little-endian f4, u2, i4 or i8, C order). The
/// result's type is `want` (u2 data is taken as the bf16/fp16 bits `want`
/// names); a broken file, another dtype or another shape than `want_shape`
/// throws Error(bad_input) naming the file and what would be valid, except
/// that with `shape_differs` another shape sets it and the file's own shape
/// is kept.
Tensor read_npy(const std::string& path, ElemType want, const std::vector<int64_t>& want_shape,
                bool* shape_differs = nullptr);

/// Supplies an implementation's output for (tensor name, rank), validated
/// against the reference's tensor of the same stage (dtype and shape; see
/// read_npy for `shape_differs`), or nullptr when the implementation did not
/// write it.
using ActualFn =
    std::function<const Tensor*(const std::string& name, int rank, const Tensor& expected, bool* shape_differs)>;

/// One tensor of the golden set.
struct GoldenTensor {
  std::string name, stage, role;
  int rank = 0;
  Tensor t;
  std::string layout;
};

/// The reference pipeline of `run` without fast stages: for every slot in
/// slot_order(), the primary variant's reference runs on the current board,
/// the implementation's outputs of that slot (from `actual`, when given) are
/// compared with it under the output's class (routing: ids as sets, exact
/// ties accepted, near-ties reported; CONTRACT §15), and the board advances
/// with the implementation's outputs where it wrote them and the reference's
/// elsewhere (stage isolation for foreign code). With `golden`, every input
/// and every stage output of the board is appended as it is produced.
CaseReport run_external(const Case& c, const ActualFn* actual, std::vector<GoldenTensor>* golden);

/// `moeverify export FILE DIR [--case NAME]`: one golden folder per case.
int cmd_export(const std::string& file, const std::string& dir, const std::string& only, bool select,
               const std::vector<std::string>& sets);
/// `moeverify check DIR [--actual DIR2] [--json F]`: DIR is one golden folder
/// or a folder of them; exit status as for `run`.
int cmd_check(const std::string& dir, const std::string& actual_dir, bool has_actual, const std::string& json,
              bool want_json);

}  // namespace moev
