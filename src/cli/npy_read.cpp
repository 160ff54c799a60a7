// Reading the implementation's files for `moeverify check` (docs/contract.md
// §15, format in export_check.h): which files of an actual/ folder are
// taken, and the NumPy .npy reader.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "error.h"
#include "export_check.h"
#include "golden.h"

namespace moev {
using namespace golden;

namespace {

/// The .npy descriptors accepted for a wanted type: its own, and for
/// integers the other width (frameworks hold ids and counts in int64), for
/// fp16 NumPy's own float16.
bool descr_accepted(ElemType want, const std::string& got) {
  std::string own = npy_descr(want);
  if (own[0] == '|') own[0] = '<';  // as `got` is read: a one-byte type has no byte order
  if (got == own) return true;
  if (want == ElemType::i32 || want == ElemType::i64) return got == "<i4" || got == "<i8";
  return want == ElemType::f16 && got == "<f2";
}

size_t descr_bytes(const std::string& d) { return d.size() == 3 ? size_t(d[2] - '0') : 0; }

/// One .npy file being read for a wanted type and shape. Every refusal is
/// bad input naming the file and what would be valid (broken()).
class NpyReader {
 public:
  NpyReader(const std::string& path, ElemType want, const std::vector<int64_t>& want_shape)
      : shown_(printable(path, 200)), want_(want), want_shape_(want_shape), f_(path, std::ios::binary) {}

  /// See read_npy in export_check.h.
  Tensor read(std::vector<int64_t>* rows_differ, int64_t first_rows) {
    if (!f_) broken("cannot be opened");
    f_.seekg(0, std::ios::end);
    file_size_ = uint64_t(std::max<std::streamoff>(f_.tellg(), 0));
    f_.seekg(0);
    read_header();
    std::string got = descr_;
    if (got.size() == 3 && (got[0] == '|' || got[0] == '=')) got[0] = '<';
    if (!descr_accepted(want_, got)) {
      std::string big_endian;
      if (got.size() == 3 && got[0] == '>' && descr_accepted(want_, "<" + got.substr(1)))
        big_endian = " (the right type in big-endian byte order: write it little-endian, e.g. a.astype('<" +
                     got.substr(1) + "'))";
      broken("dtype '" + printable(descr_) + "' where " + real_dtype(want_) + " ('" + npy_descr(want_) +
             "') is expected" + big_endian);
    }
    const std::string shape_shown = Tensor{want_, shape_, nullptr, 0}.shape_str();
    if (shape_.size() != want_shape_.size() ||
        !std::equal(shape_.begin() + (shape_.empty() ? 0 : 1), shape_.end(),
                    want_shape_.begin() + (want_shape_.empty() ? 0 : 1)))
      broken("shape " + shape_shown + " has other " + (shape_.size() != want_shape_.size() ? "dimensions" : "columns"));
    const uint64_t item = descr_bytes(got);
    const uint64_t need = data_bytes(item, shape_shown);
    if (shape_ != want_shape_) {
      if (!rows_differ) broken("shape " + shape_shown + " is wrong");
      *rows_differ = shape_;
      return Tensor{want_, shape_, nullptr, 0};
    }
    if (first_rows >= 0 && !shape_.empty() && first_rows < shape_[0]) {
      // the leading rows only: the shape as read, the bytes scaled to it
      const uint64_t row = shape_[0] ? need / uint64_t(shape_[0]) : 0;
      shape_[0] = first_rows;
      return read_data(item, row * uint64_t(first_rows));
    }
    return read_data(item, need);
  }

 private:
  [[noreturn]] void broken(const std::string& what) const {
    // every dtype descr_accepted() takes
    const char* dtypes = want_ == ElemType::i32 || want_ == ElemType::i64 ? "int32 or int64"
                         : want_ == ElemType::f16                         ? "float16, or its uint16 bit patterns"
                         : want_ == ElemType::bf16                        ? "bfloat16 stored as uint16 bit patterns"
                                                                          : nullptr;
    bad_input(shown_ + ": " + what + "; valid: a NumPy .npy file (np.save) of dtype " +
              (dtypes ? std::string(dtypes) : real_dtype(want_)) + ", shape " +
              Tensor{want_, want_shape_, nullptr, 0}.shape_str() +
              (want_shape_.empty() ? "" : " (the row count may differ: that is judged, not refused)"));
  }

  /// The magic, version and header; validated against the file's size
  /// before any data is read. Sets descr_, shape_, header_end_.
  void read_header() {
    char pre[12] = {};
    f_.read(pre, sizeof pre);
    const size_t got_pre = size_t(f_.gcount());
    if (got_pre < 10 || std::memcmp(pre, "\x93NUMPY", 6) != 0) broken("not a .npy file (no \\x93NUMPY magic)");
    const int major = static_cast<unsigned char>(pre[6]);
    uint64_t hlen = 0, hstart = 0;
    if (major == 1) {
      hlen = uint64_t(static_cast<unsigned char>(pre[8])) | uint64_t(static_cast<unsigned char>(pre[9])) << 8;
      hstart = 10;
    } else if (major == 2 || major == 3) {
      if (got_pre < 12) broken("truncated header");
      for (int i = 0; i < 4; ++i) hlen |= uint64_t(static_cast<unsigned char>(pre[8 + i])) << (8 * i);
      hstart = 12;
    } else {
      broken("unknown .npy version " + std::to_string(major));
    }
    if (hlen > (uint64_t(1) << 20)) broken("a header of " + std::to_string(hlen) + " bytes (NumPy writes a few hundred)");
    if (file_size_ < hstart + hlen) broken("truncated header");
    header_.assign(size_t(hlen), '\0');
    f_.seekg(std::streamoff(hstart));
    f_.read(header_.data(), std::streamsize(hlen));
    if (uint64_t(f_.gcount()) != hlen) broken("truncated header");
    header_end_ = hstart + hlen;
    descr_ = field("descr");
    if (descr_.size() >= 2) descr_ = descr_.substr(1, descr_.size() - 2);
    const std::string fortran = field("fortran_order"), shape_text = field("shape");
    if (fortran == "True") broken("Fortran order; write C-contiguous arrays (np.ascontiguousarray)");
    if (fortran != "False") broken("fortran_order " + printable(fortran, 40) + " is not a Python bool (True or False)");
    shape_ = parse_shape(shape_text);
  }

  /// The value of `key` in the header's Python dict literal, as written
  /// ('...', "..." and (...) with their delimiters). A Python literal may
  /// quote with either mark; NumPy writes single ones.
  std::string field(const std::string& key) const {
    const std::string& h = header_;
    size_t k = h.find("'" + key + "'");
    if (k == std::string::npos) k = h.find("\"" + key + "\"");
    if (k == std::string::npos) broken("header has no '" + key + "'");
    size_t v = h.find(':', k);
    if (v == std::string::npos) broken("malformed header");
    ++v;
    while (v < h.size() && h[v] == ' ') ++v;
    if (v >= h.size()) broken("malformed header");
    size_t e = v;
    const bool quoted = h[v] == '\'' || h[v] == '"';
    if (quoted) e = h.find(h[v], v + 1);
    else if (h[v] == '(') e = h.find(')', v);
    else
      while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
    if (e == std::string::npos) broken("malformed header");
    if (quoted || h[v] == '(') ++e;
    return h.substr(v, e - v);
  }

  /// A shape tuple "(a, b, )" as its non-negative extents.
  std::vector<int64_t> parse_shape(const std::string& shape_text) const {
    std::vector<int64_t> shape;
    std::stringstream ss(shape_text.substr(1, shape_text.size() - 2));
    std::string part;
    while (std::getline(ss, part, ',')) {
      const size_t b = part.find_first_not_of(' ');
      if (b == std::string::npos) continue;
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(part.c_str() + b, &end, 10);
      if (v < 0 || errno || end == part.c_str() + b || (*end != '\0' && *end != ' ' && *end != 'L'))
        broken("malformed shape " + printable(shape_text));
      shape.push_back(v);
    }
    return shape;
  }

  /// The data bytes the header declares, which must be exactly what follows
  /// it (checked without reading the data).
  uint64_t data_bytes(uint64_t item, const std::string& shape_shown) const {
    uint64_t need = item;
    for (int64_t d : shape_) {
      if (d != 0 && need > (uint64_t(1) << 62) / uint64_t(d)) broken("shape " + shape_shown + " is larger than any file");
      need *= uint64_t(d);
    }
    const uint64_t have = file_size_ - header_end_;
    if (have != need)
      broken("holds " + std::to_string(have) + " data bytes where its header's shape " + shape_shown + " needs " +
             std::to_string(need));
    return need;
  }

  /// The data as a Tensor of the wanted type: read whole, or from the other
  /// integer width value by value with a range check.
  Tensor read_data(uint64_t item, uint64_t need) {
    Tensor t = Tensor::alloc(want_, shape_, 0);
    if (item == elem_bytes(want_)) {
      f_.read(static_cast<char*>(t.data()), std::streamsize(t.bytes()));
      if (uint64_t(f_.gcount()) != t.bytes()) broken("could not be read whole");
      return t;
    }
    std::vector<uint8_t> raw(static_cast<size_t>(need));
    f_.read(reinterpret_cast<char*>(raw.data()), std::streamsize(need));
    if (uint64_t(f_.gcount()) != need) broken("could not be read whole");
    for (int64_t i = 0; i < t.numel(); ++i) {
      int64_t v = 0;
      if (item == 8) std::memcpy(&v, &raw[size_t(i) * 8], 8);
      else { int32_t w; std::memcpy(&w, &raw[size_t(i) * 4], 4); v = w; }
      if (want_ == ElemType::i32) {
        if (v < INT32_MIN || v > INT32_MAX) broken("value " + std::to_string(v) + " at index " + std::to_string(i) + " does not fit int32");
        t.as<int32_t>()[i] = int32_t(v);
      } else {
        t.as<int64_t>()[i] = v;
      }
    }
    return t;
  }

  const std::string shown_;
  const ElemType want_;
  const std::vector<int64_t>& want_shape_;
  std::ifstream f_;
  uint64_t file_size_ = 0, header_end_ = 0;
  std::string header_, descr_;
  std::vector<int64_t> shape_;
};

}  // namespace

Tensor read_npy(const std::string& path, ElemType want, const std::vector<int64_t>& want_shape,
                std::vector<int64_t>* rows_differ, int64_t first_rows) {
  return NpyReader(path, want, want_shape).read(rows_differ, first_rows);
}

namespace golden {

bool is_dir(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

/// The implementation's files in `actual_dir`, each a regular file named as
/// an expected entry of the manifest: anything else is refused (exit 2) with
/// the nearest valid name, or with `allow_unknown` listed in `ignored`.
std::set<std::string> actual_files(const std::string& actual_dir, const std::set<std::string>& expected,
                                   bool allow_unknown, std::vector<std::string>& ignored) {
  std::set<std::string> present;
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(actual_dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    const std::string p = actual_dir + "/" + n;
    struct stat fst {};
    if (!expected.count(n) && !allow_unknown && lstat(p.c_str(), &fst) == 0 && S_ISDIR(fst.st_mode))
      bad_input(printable(p, 200) + ": a folder inside actual/; check reads the .npy files directly under actual/ "
                "(a folder of case folders is checked with `check EXPORT_DIR --actual DIR`, DIR holding one folder per "
                "case); valid: the implementation's files directly in actual/, or --allow-unknown to ignore this one");
    if (!expected.count(n)) {
      if (allow_unknown) {
        ignored.push_back(n);
        continue;
      }
      const std::string near = nearest_name(n, expected);
      bad_input(printable(p, 200) + ": no expected tensor of the manifest has this file name" +
                (near.empty() ? std::string(" (the manifest expects no tensor at all)")
                              : " (did you mean " + near + "?)") +
                "; valid: the \"file\" of an entry with role \"expected\" in manifest.json, or pass "
                "--allow-unknown to ignore other files");
    }
    struct stat st {};
    if (stat(p.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      bad_input(printable(p, 200) + ": is not a regular file (a folder, a broken link or a pipe); valid: a .npy file");
    present.insert(n);
  }
  return present;
}

/// One golden folder checked against the implementation's files in
/// `actual_dir`; a missing folder is a case with nothing checked

}  // namespace golden
}  // namespace moev
