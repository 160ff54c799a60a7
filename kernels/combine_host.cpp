// The combine on the host executor (docs/contract.md §2 and §9; the `combine`
// slot, src/paths/stages_local.cpp): out of place, from zeros, and in place
// with the byte-range alias guard.
#include "moe_host_detail.h"

#include <cstring>
#include <string>

namespace moev {
using namespace host_detail;

namespace {

/// The device address of an in-place combine's buffer [buf, buf + td) set
/// to its start there (BufferStart: the device's fill or copy; the buffer is
/// never built on the host and uploaded). The combine then writes buf, and
/// its wrote() brings the host copy up to date.
const void* device_start(Mirror& m, void* buf, size_t td, const BufferStart& start) {
  void* d = m.out(buf, td);
  if (start.kind == BufferStart::Kind::zeros)
    m.device().fill_timed(d, 0, td);
  else
    m.device().copy_timed(d, m.in(start.from, td), td);
  return d;
}

/// The combine on the mirror's device: 16 bytes of columns per lane (W = kDeviceSpan), the same
/// operations per column as the host's spans, so the bytes agree.
/// start: in place only (init == out).
void combine_device(const ExecCtx& ctx, const CombineArgs& a, k::CombineInit init_from, const void* init, void* out,
                    const BufferStart& start) {
  Mirror& m = *ctx.mirror;
  Mirror::Scope scope{m};
  dispatch_dtype(a.dt, [&](auto tag) {
    using T = decltype(tag);
    const size_t td = size_t(a.T * a.D) * sizeof(T);
    if (td == 0) return;
    const bool shared = a.shared_add == k::SharedAdd::add_after;
    const void* init_d = nullptr;
    if (init_from == k::CombineInit::buffer)
      init_d = start.kind == BufferStart::Kind::as_is ? m.in(init, td)
                                                      : device_start(m, out, td, start);
    k::CombineBody<T, k::kDeviceSpan<T>> d{static_cast<const T*>(m.in(a.routed_out, size_t(a.rows * a.D) * sizeof(T))),
                           static_cast<const float*>(m.in(a.score_sorted, size_t(a.rows) * 4)),
                           static_cast<const int32_t*>(m.in(a.row_of, size_t(a.T * a.K) * 4)),
                           static_cast<const T*>(init_d),
                           shared ? static_cast<const T*>(m.in(a.shared, td)) : nullptr,
                           static_cast<T*>(m.out(out, td)),
                           a.D, a.K, a.apply, a.acc, a.shared_add,
                           ctx.faults.has(Fault::unordered_combine) ? k::CombineOrder::descending_row
                                                                    : k::CombineOrder::ascending_row,
                           a.smul, init_from};
    m.device().run(d, a.T);
    m.wrote(out, td);
  });
}

// One token of the host combine, compiled for the baseline ISA and for AVX2
// and AVX-512 (GCC function multi-versioning: the loader picks the widest
// the CPU has), so the span loops run 8 or 16 fp32 lanes wide without a
// -march build. The bytes are the same on every ISA: the operations are IEEE
// fp32 ones and the kernels build with -ffp-contract=off (CMakeLists.txt).
#define MOEV_COMBINE_TOKEN(T)                                                                       \
  __attribute__((target_clones("arch=x86-64-v4", "avx2", "default"), flatten)) void combine_token( \
      const k::CombineBody<T, k::kCombineSpan>& body, int64_t t) {                                  \
    body(t, 0, 1);                                                                                  \
  }
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
MOEV_COMBINE_TOKEN(float)
MOEV_COMBINE_TOKEN(bf16)
MOEV_COMBINE_TOKEN(fp16)
#else
template <class T>
void combine_token(const k::CombineBody<T, k::kCombineSpan>& body, int64_t t) {
  body(t, 0, 1);
}
#endif
#undef MOEV_COMBINE_TOKEN

/// start: in place only (init == out), written on the executor that combines.
void combine_impl(const ExecCtx& ctx, const CombineArgs& a, k::CombineInit init_from, const void* init, void* out,
                  const BufferStart& start = {}) {
  if (ctx.mirror) return combine_device(ctx, a, init_from, init, out, start);
  dispatch_dtype(a.dt, [&](auto tag) {
    using T = decltype(tag);
    const size_t td = size_t(a.T * a.D) * sizeof(T);
    if (start.kind == BufferStart::Kind::zeros && td) std::memset(out, 0, td);
    if (start.kind == BufferStart::Kind::copy && td) std::memcpy(out, start.from, td);
    k::CombineBody<T, k::kCombineSpan> body{static_cast<const T*>(a.routed_out), a.score_sorted, a.row_of,
                                            static_cast<const T*>(init), static_cast<const T*>(a.shared),
                                            static_cast<T*>(out), a.D, a.K, a.apply, a.acc, a.shared_add,
                                            ctx.faults.has(Fault::unordered_combine) ? k::CombineOrder::descending_row
                                                                                     : k::CombineOrder::ascending_row,
                                            a.smul, init_from};
    host_run(ctx, a.T, [&](int64_t t, int, int) { combine_token(body, t); });
  });
}

}  // namespace

void combine(const ExecCtx& ctx, const CombineArgs& a, const void* init, void* out) {
  combine_impl(ctx, a, k::CombineInit::buffer, init, out);
}

void combine_from_zeros(const ExecCtx& ctx, const CombineArgs& a, void* out) {
  combine_impl(ctx, a, k::CombineInit::zeros, nullptr, out);
}

bool ranges_overlap(ByteRange a, ByteRange b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a.p), pb = reinterpret_cast<uintptr_t>(b.p);
  return pa < pb + b.bytes && pb < pa + a.bytes;
}

InPlaceResult combine_in_place(const ExecCtx& ctx, const CombineArgs& a, void* buf,
                               void* fallback, const ByteRange* inputs,
                               const char* const* names, int num_inputs, BufferStart start) {
  // On a device the guard compares the device byte ranges: the buffers the
  // kernel really reads and writes (a view keeps its offset in its storage's
  // device copy, so overlap there is overlap on the host and back).
  // The buffer's address is taken for writing (Mirror::out): a new device
  // output is not uploaded for it (its start, if any, is written there).
  Mirror* m = ctx.mirror;
  auto on_device = [m](ByteRange r) { return m && r.bytes ? ByteRange{m->in(r.p, r.bytes), r.bytes} : r; };
  const size_t td = size_t(a.T * a.D) * dtype_bytes(a.dt);
  const ByteRange out = m && td ? ByteRange{m->out(buf, td), td} : ByteRange{buf, td};
  for (int i = 0; i < num_inputs; ++i) {
    // The planted fault reproduces a data-pointer comparison (docs/frameworks.md §9.2
    // pitfall): a view at an offset inside the same allocation slips through.
    const bool hit = ctx.faults.has(Fault::pointer_alias_guard)
                         ? (out.bytes && inputs[i].bytes && out.p == on_device(inputs[i]).p)
                         : ranges_overlap(out, on_device(inputs[i]));
    if (hit) {
      // buf is not written at all (its start would overwrite the input it
      // overlaps): fallback = the start + the scatter.
      if (start.kind == BufferStart::Kind::zeros)
        combine_from_zeros(ctx, a, fallback);
      else
        combine(ctx, a, start.kind == BufferStart::Kind::copy ? start.from : buf, fallback);
      return {Placement::out_of_place_fallback,
              std::string("output buffer overlaps input '") + names[i] + "'"};
    }
  }
  combine_impl(ctx, a, k::CombineInit::buffer, buf, buf, start);
  return {Placement::in_place, ""};
}

}  // namespace moev
