#include "datagen.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace moev {
namespace {

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

enum Stream : uint64_t { kX = 1, kWg, kBias, kW1, kW3, kW2, kSW1, kSW3, kSW2, kTail, kGradOut };

double normal(uint64_t seed, uint64_t stream, uint64_t rank, uint64_t row, uint64_t col) {
  const double u1 = std::max(hash_uniform(seed, stream, rank, row, 2 * col), 1e-300);
  const double u2 = hash_uniform(seed, stream, rank, row, 2 * col + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Exact mode: small nonzero integers (x) or {-1, 0, 1} scaled by a power of two
// (weights): every product and sum of the pipeline is exact in fp32.
float exact_value(uint64_t seed, uint64_t stream, uint64_t rank, uint64_t row, uint64_t col, int kind) {
  const double u = hash_uniform(seed, stream, rank, row, col);
  if (kind == 0) {  // activations: +-1..4
    const int m = 1 + int(u * 8) % 4;
    return float(int(u * 8) < 4 ? -m : m);
  }
  return float(int(u * 3) - 1) * (kind == 1 ? 1.0f : 0.125f);  // 1: router gate, 2: expert weights
}

// Realistic expert weights: about normal with variance 1 (Irwin-Hall: the
// sum of four 16-bit uniforms, centred and scaled), times `scale`. Element
// (row, col) draws its four from two 32-bit hashes of col keyed by a 64-bit
// hash of (seed, tensor, row): 32-bit integer steps that vectorise, so a
// stage that generates the few experts it works on (experts.weights
// streamed) pays a fraction of a nanosecond per element where Box-Muller's
// log and cos cost twenty; and an element has the same value in a slice as
// in the whole tensor.
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}
inline float weight_normal(uint32_t ka, uint32_t kb, uint32_t col) {
  const uint32_t a = hash32(ka ^ (col * 0x9e3779b9u)), b = hash32(kb + col * 0x85ebca6bu);
  const uint32_t quarters = (a & 0xffffu) + (a >> 16) + (b & 0xffffu) + (b >> 16);
  return (float(int32_t(quarters)) - 131070.0f) * (1.7320508f / 65536.0f);  // mean 4 * 32767.5; var 4 * 65536^2 / 12
}

/// Elements [first, first + numel(shape)) of the flat tensor a stream draws
/// (a slice of it when `first` > 0: the values are those of the same flat
/// indices of the whole tensor). `weights`: realistic values by
/// weight_normal, not Box-Muller.
/// `reuse`: a tensor of the same type and size that nothing else shares is
/// written over instead of a new allocation (a streamed stage's next chunk:
/// no fresh pages to fault in).
Tensor fill(const Case& c, ElemType et, std::vector<int64_t> shape, uint64_t stream, int rank, double scale,
            int exact_kind, size_t extra_elems = 0, int threads = 1, int64_t first = 0, bool weights = false,
            Tensor* reuse = nullptr) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t cols = std::max<int64_t>(shape.back(), 1), total = n + int64_t(extra_elems);
  const uint64_t key = mix(c.seed ^ mix(stream ^ mix(uint64_t(rank))));
  // One allocation, each value converted to et where it is drawn; every
  // value is a pure function of its index, so threads change nothing.
  const bool reusable = reuse && reuse->storage && reuse->storage.use_count() == 1 && reuse->offset_bytes == 0 &&
                        reuse->type == et && reuse->storage->size() == size_t(total) * elem_bytes(et);
  Tensor whole = reusable ? reuse->view(et, {total}, 0) : Tensor::alloc(et, {total}, 0);
  if (reusable) *reuse = Tensor{};  // `whole` holds the storage alone again
  auto store = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    auto put = [](float v) {
      if constexpr (std::is_same_v<T, float>) return v;
      else return from_float<T>(v);
    };
    if (weights && c.data == DataMode::realistic) {  // the hot loop of streamed weights, row by row
      const float fs = float(scale);
      const int64_t r0 = first / cols, r1 = (first + total + cols - 1) / cols;
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads)) if (threads > 1 && total > (1 << 16))
      for (int64_t r = r0; r < r1; ++r) {
        const uint64_t rk = mix(key + uint64_t(r));
        const uint32_t ka = uint32_t(rk), kb = uint32_t(rk >> 32);
        const int64_t c0 = std::max<int64_t>(0, first - r * cols), c1 = std::min<int64_t>(cols, first + total - r * cols);
        T* o = out + (r * cols - first);
        if constexpr (std::is_same_v<T, bf16>) {
          // Round to nearest even on the bits (every value is finite): a
          // loop the compiler runs 8 or 16 lanes wide.
          uint16_t* ob = reinterpret_cast<uint16_t*>(o);
#pragma omp simd
          for (int64_t col = c0; col < c1; ++col) {
            uint32_t u;
            const float v = weight_normal(ka, kb, uint32_t(col)) * fs;
            std::memcpy(&u, &v, 4);
            ob[col] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
          }
        } else {
          for (int64_t col = c0; col < c1; ++col) o[col] = put(weight_normal(ka, kb, uint32_t(col)) * fs);
        }
      }
      return;
    }
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads)) if (threads > 1 && total > (1 << 16))
    for (int64_t i = 0; i < total; ++i) {
      const int64_t g = first + i;
      const uint64_t r = uint64_t(g / cols), col = uint64_t(g % cols);
      const uint64_t s = i < n ? stream : kTail;
      out[i] = put(c.data == DataMode::exact ? exact_value(c.seed, s, uint64_t(rank), r, col, exact_kind)
                                             : float(normal(c.seed, s, uint64_t(rank), r, col) * scale));
    }
  };
  switch (et) {
    case ElemType::f32: store(whole.as<float>()); break;
    case ElemType::bf16: store(whole.as<bf16>()); break;
    case ElemType::f16: store(whole.as<fp16>()); break;
    default: throw std::logic_error("fill: an integer tensor");
  }
  return whole.view(et, std::move(shape), 0);
}

}  // namespace

double hash_uniform(uint64_t seed, uint64_t stream, uint64_t rank, uint64_t row, uint64_t col) {
  uint64_t h = mix(seed ^ mix(stream ^ mix(rank ^ mix(row ^ mix(col)))));
  return double(h >> 11) * (1.0 / 9007199254740992.0);
}

ExpertWeightSlice make_expert_weights(const Case& c, int64_t e0, int64_t n, int threads, ExpertWeightSlice* reuse) {
  const ElemType act = act_elem(c.dtype);
  const int64_t D = c.hidden, F = c.ffn;
  const double s1 = 1.0 / std::sqrt(double(D)), s2 = 1.0 / std::sqrt(double(F));
  ExpertWeightSlice w;
  w.w1 = fill(c, act, {n, F, D}, kW1, 0, s1, 2, 0, threads, e0 * F * D, true, reuse ? &reuse->w1 : nullptr);
  w.w3 = fill(c, act, {n, F, D}, kW3, 0, s1, 2, 0, threads, e0 * F * D, true, reuse ? &reuse->w3 : nullptr);
  w.w2 = fill(c, act, {n, D, F}, kW2, 0, s2, 2, 0, threads, e0 * D * F, true, reuse ? &reuse->w2 : nullptr);
  return w;
}

int64_t streamed_chunk_experts(const Case& c, int64_t n) {
  const double per_expert = c.routed_weight_bytes() / double(std::max(1, c.num_experts));
  int64_t by_bytes = per_expert > 0 ? int64_t(double(512 << 20) / per_expert) : n;
  // An even count: the reference gives each of two threads whole experts.
  if (by_bytes > 2) by_bytes -= by_bytes % 2;
  return std::max<int64_t>(1, std::min<int64_t>(by_bytes, (n + 2) / 3));
}

std::map<std::string, Tensor> make_global_inputs(const Case& c, int threads) {
  const ElemType act = act_elem(c.dtype);
  const int64_t D = c.hidden, F = c.ffn, E = c.num_experts;
  std::map<std::string, Tensor> m;
  // Router gate, bias and expert weights are global: stream rank 0 everywhere.
  // Layer entry l (docs/contract.md §12) draws its own router gate and bias with l in
  // that rank slot, so entry 0 keeps the single-layer values.
  const int lr = c.layer;
  m["wg"] = fill(c, act, {E, D}, kWg, lr, 1.0 / std::sqrt(double(D)), 1);
  std::vector<float> bias(size_t(E), 0.f);
  if (c.router.bias == Switch::on)
    for (int64_t e = 0; e < E; ++e)
      bias[size_t(e)] = c.data == DataMode::exact ? float(int(hash_uniform(c.seed, kBias, uint64_t(lr), 0, uint64_t(e)) * 5) - 2) / 64.f
                                                  : float(normal(c.seed, kBias, uint64_t(lr), 0, uint64_t(e)) * 0.01);
  if (c.router.hot_expert >= 0) bias[size_t(c.router.hot_expert)] += 1.f;
  m["bias"] = from_floats(bias, ElemType::f32, {E});
  if (c.experts.kind == ExpertKind::swiglu && !c.streams_weights()) {
    ExpertWeightSlice w = make_expert_weights(c, 0, E, threads);
    m["w1"] = std::move(w.w1);
    m["w3"] = std::move(w.w3);
    m["w2"] = std::move(w.w2);
  }
  if (c.shared.kind == SharedKind::swiglu) {
    m["shared_w1"] = fill(c, act, {1, F, D}, kSW1, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads, 0, true);
    m["shared_w3"] = fill(c, act, {1, F, D}, kSW3, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads, 0, true);
    m["shared_w2"] = fill(c, act, {1, D, F}, kSW2, 0, 1.0 / std::sqrt(double(F)), 2, 0, threads, 0, true);
  }
  return m;
}

std::map<std::string, Tensor> make_inputs(const Case& c, int rank, int64_t T,
                                          const std::map<std::string, Tensor>* globals) {
  const ElemType act = act_elem(c.dtype);
  const int64_t D = c.hidden;
  std::map<std::string, Tensor> m = globals ? *globals : make_global_inputs(c);
  // Only an output buffer at an offset into x reads past x's end: a fresh
  // buffer must not pay for alias_offset (up to 2^40) unused elements.
  const size_t tail = c.combine.buffer == OutBuffer::alias_x_offset ? size_t(c.combine.alias_offset) : 0;
  m["x"] = fill(c, act, {T, D}, kX, rank, 1.0, 0, tail);
  // The upstream gradient of `out` (docs/contract.md §13), a stream of its own: in
  // exact mode small integers like x, so the backward's sums are exact where
  // the forward's are.
  if (c.backward == Switch::on) m["grad_out"] = fill(c, act, {T, D}, kGradOut, rank, 1.0, 0);
  return m;
}

}  // namespace moev
