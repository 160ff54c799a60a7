// `moeverify export` and `moeverify check` (docs/contract.md §15): golden
// files for an implementation moeverify did not write, and a stage-by-stage
// verdict on that implementation's outputs.
//
// Golden folder of one case (format "moeverify-golden/2"):
//   manifest.json  {"format", "tool", "case": the resolved configuration as
//                   dotted case keys, "ranks": R, "layers": L, "note",
//                   "tensors": [{"name", "stage", "role": "input" |
//                   "expected", "rank", "file", "dtype", "shape", "layout"}]}
//   one file per manifest entry, never shared by two entries:
//     input.NAME.rankR.npy          the inputs of layer entry 1
//     STAGE.NAME.rankR.npy          what stage STAGE outputs
//     layerL.input.NAME.rankR.npy   entry L >= 2 (its own router weights)
//     layerL.STAGE.NAME.rankR.npy
//   The rank suffix is always there (rank0 when R = 1). bf16 and fp16 are
//   stored as uint16 bit patterns; "dtype" names the real type.
//   actual/        where `check` looks for the implementation's outputs by
//                  default: any subset of the expected entries' file names.
//                  Any other name there is refused (exit 2) unless
//                  --allow-unknown; integer tensors may be int32 or int64.
// A folder of format 1 (file names without stage, shared between stages) is
// refused with the command that re-exports it.
#pragma once

#include <functional>

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "case.h"
#include "case_filter.h"
#include "case_json.h"
#include "runner.h"

namespace moev {

struct Profile;  // profile.h

/// The golden format written by export and read by check.
inline constexpr const char* kGoldenFormat = "moeverify-golden/2";


/// Reads a NumPy .npy file (little-endian f4, u2, i4 or i8, C order). The
/// result's type is `want` (u2 data is taken as the bf16/fp16 bits `want`
/// names; an i4 file where i8 is wanted, or the reverse, is converted, each
/// value range-checked). The header is validated against the file's size
/// before any data is read. A broken file, another dtype, another number of
/// dimensions or other columns (every dimension after the first) throws
/// Error(bad_input) naming the file and what would be valid. Another row
/// count (first dimension) throws too, unless `rows_differ` is given: then
/// the file's shape is stored there and an empty Tensor returned, no data read.
/// With `first_rows` >= 0 (at most want_shape[0]) only that many leading rows
/// are read (a padded buffer's layout rows; the rest is never read).
Tensor read_npy(const std::string& path, ElemType want, const std::vector<int64_t>& want_shape,
                std::vector<int64_t>* rows_differ = nullptr, int64_t first_rows = -1);

/// The manifest file name of tensor `name` of `stage` on `rank` (see above;
/// stage "inputs" or "layerL/inputs" for inputs).
std::string golden_file(const std::string& stage, const std::string& name, int rank);

/// What an implementation wrote for one expected tensor.
struct ActualTensor {
  enum class Kind { absent, present, rows_differ } kind = Kind::absent;
  Tensor t;                    // present: the data, in the expected dtype
  std::vector<int64_t> shape;  // rows_differ: the file's shape (its data is not read)
  std::string note;            // present: what was done to it (trailing pad rows ignored)
};
/// Supplies the implementation's tensor for a golden file name, validated
/// against the reference's tensor of the same stage (see read_npy).
using ActualFn = std::function<ActualTensor(const std::string& file, const Tensor& expected)>;

/// One tensor of the golden set.
struct GoldenTensor {
  std::string name, stage, role;
  int rank = 0;
  Tensor t;
  std::string layout;
};

struct ExternalOptions {
  /// Hold the routing to the lowest-index rule among exact ties (for
  /// implementations that promise it), instead of accepting any member.
  bool strict_ties = false;
  /// `check --require`: stages whose outputs must be written (on every
  /// rank); a missing one is INCORRECT ("all": every slot of slot_order()).
  std::vector<std::string> require;
  /// The stages --require names (beside "all" or not): one that this case
  /// does not have is NOT_VERIFIED, never a silent pass; at EP 1 one that
  /// moves rows between ranks is required though "all" leaves it out.
  std::set<std::string> require_named;
  bool require_all = false;  // --require all (or all,STAGE,...)
  /// check: whether the implementation's tensor `yours` for a golden file
  /// name equals, bit for bit, the expected one exported in the folder (the
  /// reference's own chain); null where there is no folder.
  std::function<bool(const std::string& file, const Tensor& yours)> equals_exported;
};

/// The reference pipeline of `run` without fast stages, for every layer
/// entry: for every slot in slot_order(), the primary variant's reference
/// runs on the current board, the implementation's outputs of that slot (from
/// `actual`, when given) are compared with it under the output's class
/// (routing: ids judged as a selection, exact ties accepted, near-ties
/// reported; rows part of the verdict), and the board advances with the
/// implementation's outputs where it wrote them and the reference's
/// elsewhere (stage isolation for foreign code). With `golden`, every input
/// and every stage output is appended as it is produced.
CaseReport run_external(const Case& c, const ActualFn* actual, std::vector<GoldenTensor>* golden,
                        const ExternalOptions& opt = {});

/// `moeverify export FILE DIR [--case NAME]`: one golden folder per case.
/// With a profile (profile.h) its fixed keys are set on every case, and a
/// case outside it is left out, named with the key that puts it outside.
int cmd_export(const std::string& file, const std::string& dir, const CaseFilter& cases,
               const std::vector<std::string>& sets, const Profile* profile = nullptr);

/// One case exported into `folder` (made when missing; an existing one must
/// be a case folder this run may fill): its manifest and every golden
/// tensor. Returns the number of tensors.
size_t export_case_folder(const Case& c, const std::string& folder);

/// --require all|STAGE,STAGE into `o`: the stage names checked against the
/// registry (a name that is no stage is bad input).
void parse_require(const std::string& text, ExternalOptions& o);

struct CheckArgs {
  std::vector<std::string> dirs;  // each one golden folder or a folder of them
  std::string actual_dir, json;
  bool has_actual = false, want_json = false;
  bool verbose = false;        // every check's row, as `run --verbose`
  bool allow_unknown = false;  // files under actual/ that no manifest entry names are ignored, and listed
  std::string require;         // --require: "all" or STAGE,STAGE (parsed into external)
  ExternalOptions external;
};
/// `moeverify check DIR... [--actual DIR2] [--json F]`: each DIR is one golden
/// folder or a folder of them (--actual with one DIR only); exit status as for `run`.
int cmd_check(const CheckArgs& a);

/// One golden folder judged on the implementation's files in `actual_dir`
/// (what `check` does per folder); a missing `actual_dir` is a case with
/// nothing checked (NOT_VERIFIED).
CaseReport check_case_folder(const std::string& folder, const std::string& actual_dir, const CheckArgs& a);

}  // namespace moev
