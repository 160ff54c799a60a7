#include "tensor.h"

#include <cstring>

#include <xxhash.h>
#include <stdexcept>
#include <type_traits>

#include "error.h"

namespace moev {

const char* elem_name(ElemType t) {
  switch (t) {
    case ElemType::f32: return "fp32";
    case ElemType::bf16: return "bf16";
    case ElemType::f16: return "fp16";
    case ElemType::i32: return "int32";
    case ElemType::i64: return "int64";
    case ElemType::e4m3: return "e4m3";
  }
  return "?";
}

size_t elem_bytes(ElemType t) {
  switch (t) {
    case ElemType::bf16:
    case ElemType::f16: return 2;
    case ElemType::f32:
    case ElemType::i32: return 4;
    case ElemType::i64: return 8;
    case ElemType::e4m3: return 1;
  }
  return 0;
}

ElemType act_elem(DType d) {
  return d == DType::fp32 ? ElemType::f32 : d == DType::bf16 ? ElemType::bf16 : ElemType::f16;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Written as NumPy writes a shape, a 1-d one with its comma: (80,).
std::string Tensor::shape_str() const {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

Tensor Tensor::alloc(ElemType t, std::vector<int64_t> shape, uint8_t fill, size_t extra) {
  Tensor r;
  r.type = t;
  r.shape = std::move(shape);
  const size_t bytes = r.bytes() + extra;
  try {
    r.storage = std::make_shared<std::vector<uint8_t>>(bytes, fill);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(bytes);
  }
  return r;
}

Tensor Tensor::view(ElemType t, std::vector<int64_t> shp, size_t offset) const {
  Tensor r;
  r.type = t;
  r.shape = std::move(shp);
  r.storage = storage;
  r.offset_bytes = offset;
  if (offset + r.bytes() > storage->size()) throw std::out_of_range("tensor view past its storage");
  return r;
}

Tensor Tensor::clone() const {
  Tensor r = *this;  // the whole storage is copied: views past the tensor stay valid
  try {
    r.storage = std::make_shared<std::vector<uint8_t>>(*storage);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(storage->size());
  }
  return r;
}

// The type switch sits outside the element loops, which then vectorise.
std::vector<float> to_floats(const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  auto widen = [&](const auto* p) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = to_float(p[i]);
  };
  switch (t.type) {
    case ElemType::f32: widen(t.as<float>()); break;
    case ElemType::bf16: widen(t.as<bf16>()); break;
    case ElemType::f16: widen(t.as<fp16>()); break;
    default: throw std::logic_error("to_floats on an integer tensor");
  }
  return v;
}

Tensor from_floats(const std::vector<float>& v, ElemType type, std::vector<int64_t> shape) {
  Tensor t = Tensor::alloc(type, std::move(shape), 0);
  if (size_t(t.numel()) != v.size()) throw std::logic_error("from_floats: size does not match shape");
  auto narrow = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (size_t i = 0; i < v.size(); ++i) p[i] = from_float<T>(v[i]);
  };
  switch (type) {
    case ElemType::f32: narrow(t.as<float>()); break;
    case ElemType::bf16: narrow(t.as<bf16>()); break;
    case ElemType::f16: narrow(t.as<fp16>()); break;
    default: throw std::logic_error("from_floats to an integer tensor");
  }
  return t;
}

std::vector<int64_t> to_ints(const Tensor& t) {
  std::vector<int64_t> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[size_t(i)] = t.type == ElemType::i32 ? t.as<int32_t>()[i] : t.as<int64_t>()[i];
  return v;
}

Tensor from_ints(const std::vector<int64_t>& v, ElemType type, std::vector<int64_t> shape) {
  Tensor t = Tensor::alloc(type, std::move(shape), 0);
  if (size_t(t.numel()) != v.size()) throw std::logic_error("from_ints: size does not match shape");
  for (size_t i = 0; i < v.size(); ++i) {
    if (type == ElemType::i32) t.as<int32_t>()[i] = int32_t(v[i]);
    else t.as<int64_t>()[i] = v[i];
  }
  return t;
}

double value_at(const Tensor& t, int64_t i) {
  switch (t.type) {
    case ElemType::f32: return t.as<float>()[i];
    case ElemType::bf16: return to_float(t.as<bf16>()[i]);
    case ElemType::f16: return to_float(t.as<fp16>()[i]);
    case ElemType::i32: return t.as<int32_t>()[i];
    case ElemType::i64: return double(t.as<int64_t>()[i]);
    case ElemType::e4m3: return t.as<uint8_t>()[i];
  }
  return 0;
}

uint64_t checksum(const Tensor& t) { return XXH3_64bits(t.data(), t.bytes()); }

bool any_nonzero(const Tensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data());
  const int64_t n = t.numel();
  const size_t eb = elem_bytes(t.type);
  // The magnitude bits of a float (all bits of an integer) are non-zero.
  const uint64_t mask = t.type == ElemType::f32                               ? 0x7FFFFFFFu
                        : t.type == ElemType::bf16 || t.type == ElemType::f16 ? 0x7FFFu
                        : t.type == ElemType::e4m3                            ? 0x7Fu
                                                                              : ~0ull;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t u = 0;
    std::memcpy(&u, p + size_t(i) * eb, eb);
    if (u & mask) return true;
  }
  return false;
}

}  // namespace moev
