#include "datagen.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
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

Tensor fill(const Case& c, ElemType et, std::vector<int64_t> shape, uint64_t stream, int rank, double scale,
            int exact_kind, size_t extra_elems = 0, int threads = 1) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t cols = std::max<int64_t>(shape.back(), 1), total = n + int64_t(extra_elems);
  // One allocation, each value converted to et where it is drawn; every
  // value is a pure function of its index, so threads change nothing.
  Tensor whole = Tensor::alloc(et, {total}, 0);
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads)) if (threads > 1 && total > (1 << 16))
  for (int64_t i = 0; i < total; ++i) {
    const uint64_t r = uint64_t(i / cols), col = uint64_t(i % cols);
    const uint64_t s = i < n ? stream : kTail;
    const float v = c.data == DataMode::exact ? exact_value(c.seed, s, uint64_t(rank), r, col, exact_kind)
                                              : float(normal(c.seed, s, uint64_t(rank), r, col) * scale);
    switch (et) {
      case ElemType::f32: whole.as<float>()[i] = v; break;
      case ElemType::bf16: whole.as<bf16>()[i] = from_float<bf16>(v); break;
      case ElemType::f16: whole.as<fp16>()[i] = from_float<fp16>(v); break;
      default: throw std::logic_error("fill: an integer tensor");
    }
  }
  return whole.view(et, std::move(shape), 0);
}

}  // namespace

double hash_uniform(uint64_t seed, uint64_t stream, uint64_t rank, uint64_t row, uint64_t col) {
  uint64_t h = mix(seed ^ mix(stream ^ mix(rank ^ mix(row ^ mix(col)))));
  return double(h >> 11) * (1.0 / 9007199254740992.0);
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
  if (c.experts.kind == ExpertKind::swiglu) {
    m["w1"] = fill(c, act, {E, F, D}, kW1, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads);
    m["w3"] = fill(c, act, {E, F, D}, kW3, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads);
    m["w2"] = fill(c, act, {E, D, F}, kW2, 0, 1.0 / std::sqrt(double(F)), 2, 0, threads);
  }
  if (c.shared.kind == SharedKind::swiglu) {
    m["shared_w1"] = fill(c, act, {1, F, D}, kSW1, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads);
    m["shared_w3"] = fill(c, act, {1, F, D}, kSW3, 0, 1.0 / std::sqrt(double(D)), 2, 0, threads);
    m["shared_w2"] = fill(c, act, {1, D, F}, kSW2, 0, 1.0 / std::sqrt(double(F)), 2, 0, threads);
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
