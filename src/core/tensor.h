// Host tensors of the tool: a typed, shaped view into shared byte storage.
// Views may share storage at an offset (the aliasing cases of docs/contract.md §9).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtype.h"

namespace moev {

/// e4m3: FP8 e4m3fn bytes (docs/contract.md §16), stored and compared as
/// uint8; value_at gives the byte, value_text the decoded value.
enum class ElemType : uint8_t { f32, bf16, f16, i32, i64, e4m3 };

const char* elem_name(ElemType t);
size_t elem_bytes(ElemType t);
ElemType act_elem(DType d);

struct Tensor {
  ElemType type = ElemType::f32;
  std::vector<int64_t> shape;
  std::shared_ptr<std::vector<uint8_t>> storage;
  size_t offset_bytes = 0;

  int64_t numel() const;
  size_t bytes() const { return size_t(numel()) * elem_bytes(type); }
  void* data() { return storage->data() + offset_bytes; }
  const void* data() const { return storage->data() + offset_bytes; }
  template <class T> T* as() { return static_cast<T*>(data()); }
  template <class T> const T* as() const { return static_cast<const T*>(data()); }
  std::string shape_str() const;

  /// New storage of `extra_bytes` more than needed, every byte set to `fill`
  /// (0xFF poisons: NaN for floats, -1 for integers).
  static Tensor alloc(ElemType t, std::vector<int64_t> shape, uint8_t fill = 0xFF,
                      size_t extra_bytes = 0);
  /// A view of the same storage at another offset, type and shape.
  Tensor view(ElemType t, std::vector<int64_t> shape, size_t offset) const;
  /// A deep copy of the whole storage, at the same offset.
  Tensor clone() const;
};

/// Float values of an f32/bf16/f16 tensor (exact).
std::vector<float> to_floats(const Tensor& t);
/// A tensor of type t from floats already representable in t (exact).
Tensor from_floats(const std::vector<float>& v, ElemType t, std::vector<int64_t> shape);
std::vector<int64_t> to_ints(const Tensor& t);
Tensor from_ints(const std::vector<int64_t>& v, ElemType t, std::vector<int64_t> shape);
/// Value i as double (floats and ints alike).
double value_at(const Tensor& t, int64_t i);
/// Whether any element is non-zero (-0.0 counts as zero, NaN as non-zero);
/// stops at the first one.
bool any_nonzero(const Tensor& t);
/// XXH3 of the bytes: detects a modified input.
uint64_t checksum(const Tensor& t);

}  // namespace moev
