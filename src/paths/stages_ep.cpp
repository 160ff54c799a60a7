// Stage variants of the expert-parallel path (docs/contract.md §3, §4, §7): the
// all-to-all dispatch, the rank-major -> expert-major permute (generic and
// equal-count), alignment padding, and their inverses on the way back. With
// ep = 1 they run too (one rank, identity permute), so one pipeline serves all.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "../kernels/ep_host.h"
#include "../kernels/fp8_host.h"
#include "comm.h"
#include "error.h"
#include "stages.h"

namespace moev {

namespace {
/// The executor's element type of a board tensor's rows.
DType row_dtype(ElemType t) {
  if (t == ElemType::bf16) return DType::bf16;
  if (t == ElemType::f16) return DType::fp16;
  return DType::fp32;
}
}  // namespace

void move_rows(const ExecCtx& ex, const Tensor& src, const int64_t* map, int64_t n, Tensor& dst) {
  const int64_t cols = src.shape[1];
  if (src.type == ElemType::e4m3) apply_row_map_e4m3(ex, src.data(), map, n, cols, dst.data());
  else apply_row_map(ex, row_dtype(src.type), src.data(), map, n, cols, dst.data());
}

void move_rows_equal_count(const ExecCtx& ex, const Tensor& src, EqualCountMap m, Tensor& dst) {
  const int64_t cols = src.shape[1];
  if (src.type == ElemType::e4m3) apply_equal_count_e4m3(ex, src.data(), m, src.shape[0], cols, dst.data());
  else apply_equal_count(ex, row_dtype(src.type), src.data(), m, src.shape[0], cols, dst.data());
}

namespace {

Decision always(const Case&) { return {}; }

/// An activation-row variant of a slot that has an FP8 twin: under FP8
/// dispatch it does not apply; otherwise `d` decides, as before the twin.
std::function<Decision(const Case&)> act_only(std::function<Decision(const Case&)> d, const std::string& twin) {
  return [d, twin](const Case& c) {
    if (c.fp8()) return Decision{false, "dispatch.dtype: fp8_e4m3 (" + twin + " moves the e4m3 rows and scales)"};
    return d(c);
  };
}

/// The FP8 twin of a variant (docs/contract.md §16): the same movement of the
/// e4m3 rows and their block scales, listed only for FP8 cases.
Stage fp8_twin(const Stage& act, std::function<void(FastCtx&)> fast, std::function<void(RefCtx&)> ref,
               const std::vector<std::pair<std::string, std::string>>& renames) {
  Stage s = act;
  s.variant = act.variant + "_fp8";
  s.summary = act.summary + "; FP8: e4m3 rows and their block scales (docs/contract.md §16)";
  const auto base = act.applies;
  s.applies = [base](const Case& c) { return c.fp8() ? base(c) : Decision{false, "dispatch.dtype: act"}; };
  s.listed = [](const Case& c) { return c.fp8(); };
  std::vector<std::string> in = act.inputs(Case{});
  std::vector<std::string> ins;
  for (const auto& n : in) {
    bool renamed = false;
    for (const auto& [from, to] : renames)
      if (n == from) {
        ins.push_back(to + "_q");
        ins.push_back(to + "_scale");
        renamed = true;
      }
    if (!renamed) ins.push_back(n);
  }
  s.inputs = fixed_inputs(ins);
  std::vector<OutputSpec> outs;
  for (const OutputSpec& o : act.outputs) {
    bool renamed = false;
    for (const auto& [from, to] : renames)
      if (o.name == from) {
        OutputSpec q = o, sc = o;
        q.name = to + "_q";
        sc.name = to + "_scale";
        outs.push_back(q);
        outs.push_back(sc);
        renamed = true;
      }
    if (!renamed) outs.push_back(o);
  }
  s.outputs = outs;
  s.fast = std::move(fast);
  s.ref = std::move(ref);
  return s;
}

std::string list_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

std::vector<int64_t> vec_of(const Tensor& t) { return to_ints(t); }

Tensor& out_ints(FastCtx& ctx, const std::string& name, const std::vector<int64_t>& v) {
  Tensor& t = ctx.output(name, ElemType::i64, {int64_t(v.size())});
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 8);
  return t;
}

/// The row tensors a forward movement stage carries, each (input, output)
/// moved by the same map: the activation rows, or under FP8 dispatch
/// (docs/contract.md §16) the e4m3 rows and their block scales.
using RowSet = std::vector<std::pair<std::string, std::string>>;
RowSet act_rows(const std::string& in, const std::string& out) { return {{in, out}}; }
RowSet fp8_rows(const std::string& in, const std::string& out) {
  return {{in + "_q", out + "_q"}, {in + "_scale", out + "_scale"}};
}
bool is_scale(const std::string& name) { return name.size() > 6 && name.compare(name.size() - 6, 6, "_scale") == 0; }

EmptyGroupRows empty_rows(const Case& c) {
  return c.empty_groups == EmptyGroups::pad ? EmptyGroupRows::align : EmptyGroupRows::zero;
}

std::vector<int64_t> real_counts_from(const std::vector<int64_t>& recv_counts, int R, int E_l) {
  std::vector<int64_t> n(size_t(E_l), 0);
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) n[size_t(j)] += recv_counts[size_t(p * E_l + j)];
  return n;
}

// ---- fast functions ----------------------------------------------------------

/// Splits from counts and the count exchange (docs/contract.md §3.2): writes
/// input_splits, recv_counts and output_splits.
struct Splits {
  std::vector<int64_t> in, out, recv_counts;
  int64_t M = 0;
};

Splits exchange_counts(FastCtx& ctx) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E = c.num_experts, E_l = E / R;
  const Tensor& counts = ctx.input("counts");
  Splits s;
  s.in = splits_from_counts(counts.as<int64_t>(), E, R);
  out_ints(ctx, "input_splits", s.in);
  // the E counts as R chunks of E_l; rank q receives counts_p[q*E_l + j]
  Tensor& rc = ctx.output("recv_counts", ElemType::i64, {int64_t(R) * E_l});
  const std::vector<int64_t> chunk(static_cast<size_t>(R), E_l);
  ctx.comm->alltoallv(counts.data(), counts.numel(), chunk, rc.data(), rc.numel(), chunk, sizeof(int64_t), "count exchange");
  s.recv_counts = vec_of(rc);
  s.out.assign(size_t(R), 0);
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) s.out[size_t(p)] += s.recv_counts[size_t(p * E_l + j)];
  out_ints(ctx, "output_splits", s.out);
  for (int64_t v : s.out) s.M += v;
  return s;
}

void overload_and_notes(FastCtx& ctx, const Splits& s, int64_t N) {
  const int R = ctx.ranks, E_l = ctx.c.num_experts / R;
  int64_t mx = s.M, total = N;  // docs/contract.md §12: max received rows, total assignments
  ctx.comm->allreduce_max(&mx, 1, "overload max");
  ctx.comm->allreduce_sum(&total, 1, "overload sum");
  out_ints(ctx, "overload", {mx, total});
  std::ostringstream o;
  o << "rank " << ctx.rank << ": input_splits " << list_str(s.in) << ", received " << list_str(s.out)
    << " per source, " << list_str(real_counts_from(s.recv_counts, R, E_l)) << " per local expert";
  if (ctx.rank == 0 && total > 0)
    o << "; overload factor " << double(mx) / (double(total) / R) << " (max received " << mx << " rows vs balanced "
      << double(total) / R << ")";
  ctx.notes.push_back(o.str());
}

void a2a_dispatch_rows(FastCtx& ctx, const RowSet& rows) {
  const Splits s = exchange_counts(ctx);
  for (const auto& [in, out] : rows) {
    const Tensor& src = ctx.input(in);
    Tensor& dst = ctx.output(out, src.type, {s.M, src.shape[1]});
    ctx.exchange_rows(src, s.in, dst, s.out, is_scale(in) ? "block-scale all-to-all (dispatch)" : "token all-to-all (dispatch)");
  }
  overload_and_notes(ctx, s, ctx.input(rows[0].first).shape[0]);
}
void fast_a2a_dispatch(FastCtx& ctx) { a2a_dispatch_rows(ctx, act_rows("routed_input", "recv")); }
void fast_a2a_dispatch_fp8(FastCtx& ctx) { a2a_dispatch_rows(ctx, fp8_rows("routed_input", "recv")); }

/// The equal-split decision (docs/contract.md §5, docs/frameworks.md §5.2): M* = all-reduce
/// max of the splits; the padding overhead [sum(M*-in) + sum(M*-out)] /
/// [sum in + sum out] is reduced to its maximum over the EP group *before* any
/// data collective, so every rank takes the same branch. Returns M* when
/// padding is used, 0 (with the reason) when not.
int64_t equal_split_decision(FastCtx& ctx, const std::vector<int64_t>& in, const std::vector<int64_t>& out,
                             std::string& why) {
  const Case& c = ctx.c;
  int64_t mstar = 0;
  for (int64_t v : in) mstar = std::max(mstar, v);
  ctx.comm->allreduce_max(&mstar, 1, "equal-split M*");
  int64_t pad = 0, data = 0;
  for (int64_t v : in) { pad += mstar - v; data += v; }
  for (int64_t v : out) { pad += mstar - v; data += v; }
  int64_t bp = data ? pad * 10000 / data : 0;  // basis points
  if (!ctx.exec.faults.has(Fault::local_equal_split_decision)) ctx.comm->allreduce_max(&bp, 1, "equal-split overhead");
  const double overhead = double(bp) / 10000.0;
  std::ostringstream o;
  o.precision(3);
  o << "M*=" << mstar << ", padding overhead " << 100 * overhead << "% (";
  if (c.equal_split.policy == EqualSplitPolicy::adaptive) o << "threshold " << 100 * c.equal_split.threshold << "%, ";
  o << "policy " << enum_name(equal_split_table(), c.equal_split.policy) << ")";
  why = o.str();
  if (mstar == 0) {
    why = "no rank sends any row";
    return 0;
  }
  if (c.equal_split.policy == EqualSplitPolicy::adaptive && overhead > c.equal_split.threshold) {
    std::ostringstream n;
    n.precision(3);
    n << "padding overhead " << 100 * overhead << "% > threshold " << 100 * c.equal_split.threshold << "% (M*=" << mstar
      << ")";
    why = n.str();
    return 0;
  }
  return mstar;
}

/// Padded send buffer (R*M* rows, built from src by `pad`) -> equal
/// all-to-all -> compact(recv splits) into dst.
void equal_split_exchange(FastCtx& ctx, const Tensor& src, const std::vector<int64_t>& pad,
                          const std::vector<int64_t>& recv, int64_t mstar, Tensor& dst, const char* what) {
  const int R = ctx.ranks;
  const int64_t cols = src.shape[1];
  Tensor padded = Tensor::alloc(src.type, {R * mstar, cols});
  move_rows(ctx.exec, src, pad.data(), R * mstar, padded);
  Tensor got = Tensor::alloc(src.type, {R * mstar, cols});
  const std::vector<int64_t> equal(static_cast<size_t>(R), mstar);
  ctx.exchange_rows(padded, equal, got, equal, what);
  const std::vector<int64_t> compact = equal_split_compact_map(recv, mstar);
  move_rows(ctx.exec, got, compact.data(), int64_t(compact.size()), dst);
}

void equal_split_dispatch_rows(FastCtx& ctx, const RowSet& rows) {
  const Splits s = exchange_counts(ctx);
  std::string why;
  const int64_t mstar = equal_split_decision(ctx, s.in, s.out, why);
  if (mstar == 0) {
    ctx.skip(why);
    return;
  }
  for (const auto& [in, out] : rows) {
    const Tensor& src = ctx.input(in);
    Tensor& dst = ctx.output(out, src.type, {s.M, src.shape[1]});
    equal_split_exchange(ctx, src, equal_split_pad_map(s.in, mstar, ctx.exec.faults), s.out, mstar, dst,
                         is_scale(in) ? "equal-split block-scale all-to-all (dispatch)" : "equal-split all-to-all (dispatch)");
  }
  overload_and_notes(ctx, s, ctx.input(rows[0].first).shape[0]);
  if (ctx.rank == 0) ctx.notes.push_back("equal_split: taken, " + why);
}
void fast_equal_split_dispatch(FastCtx& ctx) { equal_split_dispatch_rows(ctx, act_rows("routed_input", "recv")); }
void fast_equal_split_dispatch_fp8(FastCtx& ctx) { equal_split_dispatch_rows(ctx, fp8_rows("routed_input", "recv")); }

/// Force-load-balance dispatch (docs/contract.md §6): analytic counts and splits on
/// every rank, no count exchange; the direct equal-split route from x when
/// K == E_l, else the generic gathered rows with a variable all-to-all.
void fast_force_lb_dispatch(FastCtx& ctx) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E = c.num_experts, E_l = E / R, K = c.top_k;
  const Tensor& x = ctx.input("x");
  const int64_t T = x.shape[0];
  const std::vector<int64_t> counts = force_lb_counts(T, K, E);
  Splits s;
  s.in = splits_from_counts(counts.data(), E, R);
  // every source sends this rank's block of the same counts
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) s.recv_counts.push_back(counts[size_t(ctx.rank * E_l + j)]);
  s.out.assign(size_t(R), 0);
  for (int p = 0; p < R; ++p)
    for (int j = 0; j < E_l; ++j) s.out[size_t(p)] += s.recv_counts[size_t(p * E_l + j)];
  for (int64_t v : s.out) s.M += v;
  out_ints(ctx, "input_splits", s.in);
  out_ints(ctx, "output_splits", s.out);
  out_ints(ctx, "recv_counts", s.recv_counts);
  Tensor& recv = ctx.output("recv", x.type, {s.M, c.hidden});
  const int64_t mstar = *std::max_element(s.in.begin(), s.in.end());
  // docs/frameworks.md §6.3: the shortcut is only right when E == K*R, and only for
  // the score applied after the experts (routed_input holds x * score otherwise).
  const bool guard = K == E_l || ctx.exec.faults.has(Fault::direct_route_unguarded);
  const bool scores_after =
      c.score_before_experts == Switch::off || ctx.exec.faults.has(Fault::direct_route_score_before);
  const bool direct = guard && scores_after && mstar > 0 && mstar % E_l == 0;
  if (direct) {
    equal_split_exchange(ctx, x, direct_route_map(T, R, E_l, mstar), s.out, mstar, recv,
                         "direct equal-split all-to-all");
  } else {
    const Tensor& routed = ctx.input("routed_input");
    ctx.exchange_rows(routed, s.in, recv, s.out, "token all-to-all (force-LB)");
  }
  overload_and_notes(ctx, s, T * K);
  if (ctx.rank == 0)
    ctx.notes.push_back(std::string("force_lb: analytic splits, no count exchange; ") +
                        (direct ? "direct equal-split route from x (M*=" + std::to_string(mstar) + ")"
                         : !guard ? "generic gather (direct route needs K == E_l: K=" + std::to_string(K) +
                                        ", E_l=" + std::to_string(E_l) + ")"
                         : !scores_after ? std::string("generic gather (direct route needs the score applied after "
                                                       "the experts; score_before_experts is on)")
                                         : "generic gather (direct route needs M* a positive multiple of E_l: M*=" +
                                               std::to_string(mstar) + ", E_l=" + std::to_string(E_l) + ")"));
}

void fast_equal_split_return(FastCtx& ctx) {
  const Tensor& in = ctx.input("recv_out");
  std::vector<int64_t> send = vec_of(ctx.input("output_splits")), recv = vec_of(ctx.input("input_splits"));
  std::string why;
  const int64_t mstar = equal_split_decision(ctx, recv, send, why);
  if (mstar == 0) {
    ctx.skip(why);
    return;
  }
  int64_t N = 0;
  for (int64_t v : recv) N += v;
  Tensor& out = ctx.output("routed_output", in.type, {N, ctx.c.hidden});
  equal_split_exchange(ctx, in, equal_split_pad_map(send, mstar, ctx.exec.faults), recv, mstar, out,
                       "equal-split all-to-all (combine)");
  if (ctx.rank == 0) ctx.notes.push_back("equal_split: taken, " + why);
}

void permute_generic_rows(FastCtx& ctx, const RowSet& rows) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E_l = c.num_experts / R;
  const std::vector<int64_t> rc = vec_of(ctx.input("recv_counts"));
  const std::vector<int64_t> map = permute_map_generic(rc.data(), R, E_l);
  for (const auto& [in, out] : rows) {
    const Tensor& src = ctx.input(in);
    Tensor& dst = ctx.output(out, src.type, src.shape);
    // docs/contract.md §16: a row's block scales move with it (scale_row_map: the same map)
    const std::vector<int64_t> m = is_scale(in) ? scale_row_map(map, ctx.exec.faults) : map;
    move_rows(ctx.exec, src, m.data(), int64_t(m.size()), dst);
  }
  out_ints(ctx, "expert_counts_real", real_counts_from(rc, R, E_l));
}
void fast_permute_generic(FastCtx& ctx) { permute_generic_rows(ctx, act_rows("recv", "permuted")); }
void fast_permute_generic_fp8(FastCtx& ctx) { permute_generic_rows(ctx, fp8_rows("recv", "permuted")); }

/// Equal-count permute (docs/contract.md §7); its precondition is checked on the
/// received counts of every rank, and all ranks agree before any skips.
bool equal_count_ready(FastCtx& ctx, int64_t& cnt) {
  cnt = uniform_count(vec_of(ctx.input("recv_counts")));
  int64_t not_ready = cnt == 0;
  ctx.comm->allreduce_max(&not_ready, 1, "equal-count precondition");
  if (not_ready) {
    ctx.skip("received segment counts are not all equal and > 0 on every rank");
    return false;
  }
  return true;
}

void permute_equal_rows(FastCtx& ctx, const RowSet& rows) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E_l = c.num_experts / R;
  int64_t cnt = 0;
  if (!equal_count_ready(ctx, cnt)) return;
  for (const auto& [in, out] : rows) {
    const Tensor& src = ctx.input(in);
    Tensor& dst = ctx.output(out, src.type, src.shape);
    move_rows_equal_count(ctx.exec, src, EqualCountMap{R, E_l, cnt, 0}, dst);
  }
  out_ints(ctx, "expert_counts_real", std::vector<int64_t>(size_t(E_l), R * cnt));
  ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": transpose of (R, E_l, c) = (" + std::to_string(R) + ", " +
                      std::to_string(E_l) + ", " + std::to_string(cnt) + ")");
}
void fast_permute_equal(FastCtx& ctx) { permute_equal_rows(ctx, act_rows("recv", "permuted")); }
void fast_permute_equal_fp8(FastCtx& ctx) { permute_equal_rows(ctx, fp8_rows("recv", "permuted")); }

void fast_unpermute_generic(FastCtx& ctx) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E_l = c.num_experts / R;
  const Tensor& in = ctx.input("unpadded");
  const std::vector<int64_t> rc = vec_of(ctx.input("recv_counts"));
  const std::vector<int64_t> inv = invert_map(permute_map_generic(rc.data(), R, E_l));
  Tensor& out = ctx.output("recv_out", in.type, in.shape);
  apply_row_map(ctx.exec, c.dtype, in.data(), inv.data(), int64_t(inv.size()), c.hidden, out.data());
}

void fast_unpermute_equal(FastCtx& ctx) {
  const Case& c = ctx.c;
  const int R = ctx.ranks, E_l = c.num_experts / R;
  int64_t cnt = 0;
  if (!equal_count_ready(ctx, cnt)) return;
  const Tensor& in = ctx.input("unpadded");
  Tensor& out = ctx.output("recv_out", in.type, in.shape);
  apply_equal_count(ctx.exec, c.dtype, in.data(), EqualCountMap{R, E_l, cnt, 1}, in.shape[0], c.hidden, out.data());
}

void pad_rows(FastCtx& ctx, const RowSet& rows) {
  const Case& c = ctx.c;
  const std::vector<int64_t> n = vec_of(ctx.input("expert_counts_real"));
  const PadLayout l = pad_layout(n.data(), int(n.size()), c.align, empty_rows(c), ctx.exec.faults);
  const std::vector<int64_t> map = pad_map(n.data(), l, ctx.exec.faults);
  for (const auto& [in, out] : rows) {
    const Tensor& src = ctx.input(in);
    Tensor& dst = ctx.output(out, src.type, {l.buffer_rows, src.shape[1]});
    move_rows(ctx.exec, src, map.data(), l.buffer_rows, dst);
  }
  out_ints(ctx, "expert_counts", l.rows);
  if (c.align > 1 || c.empty_groups == EmptyGroups::pad)
    ctx.notes.push_back("rank " + std::to_string(ctx.rank) + ": groups padded to " + list_str(l.rows) + ", " +
                        std::to_string(l.buffer_rows - ctx.input(rows[0].first).shape[0]) + " padding rows");
}
void fast_pad(FastCtx& ctx) { pad_rows(ctx, act_rows("permuted", "expert_input")); }
void fast_pad_fp8(FastCtx& ctx) { pad_rows(ctx, fp8_rows("permuted", "expert_input")); }

void fast_unpad(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& in = ctx.input("expert_output");
  const std::vector<int64_t> n = vec_of(ctx.input("expert_counts_real"));
  const PadLayout l = pad_layout(n.data(), int(n.size()), c.align, empty_rows(c), ctx.exec.faults);
  const std::vector<int64_t> map = unpad_map(n.data(), l);
  Tensor& out = ctx.output("unpadded", in.type, {int64_t(map.size()), c.hidden});
  apply_row_map(ctx.exec, c.dtype, in.data(), map.data(), int64_t(map.size()), c.hidden, out.data());
}

void fast_a2a_return(FastCtx& ctx) {
  const Case& c = ctx.c;
  const Tensor& in = ctx.input("recv_out");
  std::vector<int64_t> send = vec_of(ctx.input("output_splits")), recv = vec_of(ctx.input("input_splits"));
  if (ctx.exec.faults.has(Fault::unswapped_combine_splits)) std::swap(send, recv);
  int64_t N = 0;
  for (int64_t v : recv) N += v;
  Tensor& out = ctx.output("routed_output", in.type, {N, c.hidden});
  ctx.exchange_rows(in, send, out, recv, "token all-to-all (combine)");
}

// ---- reference functions (global view) ----------------------------------------

std::vector<ref::RowsRef> rows_of_ranks(const Board& b, const std::string& n) {
  std::vector<ref::RowsRef> v;
  for (size_t q = 0; q < b.ranks.size(); ++q) v.push_back(rows_of(b.at(n, int(q))));
  return v;
}

void ref_a2a_dispatch_rows(RefCtx& r, const RowSet& rows) {
  const Case& c = r.c;
  const int R = int(r.in.ranks.size()), E_l = c.num_experts / R;
  // From the dispatch's expert-major rows (capacity-limited where capacity
  // applies, docs/contract.md §11), not from x and ids again: the stage's own input.
  std::vector<ref::Counts> counts;
  for (int q = 0; q < R; ++q) counts.push_back(ref_counts(r.in.at("counts", q)));
  ref::EpDispatch d = ref::ep_dispatch(rows_of_ranks(r.in, rows[0].first), counts, R, E_l, r.rank);
  for (size_t k = 1; k < rows.size(); ++k) {  // the block scales: the same all-to-all of their own rows
    ref::EpDispatch ds = ref::ep_dispatch(rows_of_ranks(r.in, rows[k].first), counts, R, E_l, r.rank);
    for (int q = 0; q < R; ++q)
      if (r.wants(q)) {
        const Tensor& src = r.in.at(rows[k].first, q);
        r.out.ranks[size_t(q)][rows[k].second] = rows_tensor(std::move(ds.recv[size_t(q)]), src.type, src.shape[1]);
      }
  }
  int64_t mx = 0, total = 0;
  for (int q = 0; q < R; ++q) {
    RankBoard& out = r.out.ranks[size_t(q)];
    std::vector<int64_t> in_splits(size_t(R), 0), out_splits(size_t(R), 0);
    for (int p = 0; p < R; ++p)
      for (int j = 0; j < E_l; ++j) {
        out_splits[size_t(p)] += d.recv_counts[size_t(q)][size_t(p * E_l + j)];
        in_splits[size_t(p)] += d.recv_counts[size_t(p)][size_t(q * E_l + j)];
      }
    int64_t M = 0;
    for (int64_t v : out_splits) M += v;
    mx = std::max(mx, M);
    for (int64_t v : counts[size_t(q)]) total += v;
    out["input_splits"] = from_ints(in_splits, ElemType::i64, {R});
    out["output_splits"] = from_ints(out_splits, ElemType::i64, {R});
    out["recv_counts"] = from_ints(d.recv_counts[size_t(q)], ElemType::i64, {int64_t(R) * E_l});
    const Tensor& src = r.in.at(rows[0].first, q);
    if (r.wants(q)) out[rows[0].second] = rows_tensor(std::move(d.recv[size_t(q)]), src.type, src.shape[1]);
  }
  for (int q = 0; q < R; ++q) r.out.ranks[size_t(q)]["overload"] = from_ints({mx, total}, ElemType::i64, {2});
}
void ref_a2a_dispatch(RefCtx& r) { ref_a2a_dispatch_rows(r, act_rows("routed_input", "recv")); }
void ref_a2a_dispatch_fp8(RefCtx& r) { ref_a2a_dispatch_rows(r, fp8_rows("routed_input", "recv")); }

void ref_permute_rows(RefCtx& r, const RowSet& rows) {
  const Case& c = r.c;
  const int R = int(r.in.ranks.size()), E_l = c.num_experts / R;
  for (int q = 0; q < R; ++q) {
    if (!r.wants(q)) continue;
    const ref::Counts rc = ref_counts(r.in.at("recv_counts", q));
    for (const auto& [in, out] : rows) {
      const Tensor& src = r.in.at(in, q);
      r.out.ranks[size_t(q)][out] =
          rows_tensor(ref::permute_to_expert_major(rows_of(src), rc, R, E_l), src.type, src.shape[1]);
    }
    std::vector<int64_t> n(size_t(E_l), 0);
    for (int p = 0; p < R; ++p)
      for (int j = 0; j < E_l; ++j) n[size_t(j)] += rc[size_t(p * E_l + j)];
    r.out.ranks[size_t(q)]["expert_counts_real"] = from_ints(n, ElemType::i64, {E_l});
  }
}
void ref_permute(RefCtx& r) { ref_permute_rows(r, act_rows("recv", "permuted")); }
void ref_permute_fp8(RefCtx& r) { ref_permute_rows(r, fp8_rows("recv", "permuted")); }

void ref_unpermute(RefCtx& r) {
  const Case& c = r.c;
  const int R = int(r.in.ranks.size()), E_l = c.num_experts / R;
  for (int q = 0; q < R; ++q) {
    if (!r.wants(q)) continue;
    const Tensor& in = r.in.at("unpadded", q);
    r.out.ranks[size_t(q)]["recv_out"] =
        rows_tensor(ref::permute_to_rank_major(rows_of(in), ref_counts(r.in.at("recv_counts", q)), R, E_l), in.type,
                    c.hidden);
  }
}

void ref_pad_rows(RefCtx& r, const RowSet& rows) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    ref::Counts sizes;
    for (const auto& [in, out] : rows) {
      const Tensor& src = r.in.at(in, int(q));
      r.out.ranks[q][out] =
          rows_tensor(ref::pad_groups(rows_of(src), ref_counts(r.in.at("expert_counts_real", int(q))), c.align,
                                      c.empty_groups == EmptyGroups::pad, sizes),
                      src.type, src.shape[1]);
    }
    r.out.ranks[q]["expert_counts"] = from_ints(sizes, ElemType::i64, {int64_t(sizes.size())});
  }
}
void ref_pad(RefCtx& r) { ref_pad_rows(r, act_rows("permuted", "expert_input")); }
void ref_pad_fp8(RefCtx& r) { ref_pad_rows(r, fp8_rows("permuted", "expert_input")); }

void ref_unpad(RefCtx& r) {
  const Case& c = r.c;
  for (size_t q = 0; q < r.in.ranks.size(); ++q) {
    if (!r.wants(int(q))) continue;
    const Tensor& in = r.in.at("expert_output", int(q));
    r.out.ranks[q]["unpadded"] =
        rows_tensor(ref::unpad_groups(rows_of(in), ref_counts(r.in.at("expert_counts_real", int(q))),
                                      ref_counts(r.in.at("expert_counts", int(q)))),
                    in.type, c.hidden);
  }
}

void ref_a2a_return(RefCtx& r) {
  const Case& c = r.c;
  const int R = int(r.in.ranks.size()), E_l = c.num_experts / R;
  std::vector<ref::Counts> rc;
  for (int q = 0; q < R; ++q) rc.push_back(ref_counts(r.in.at("recv_counts", q)));
  std::vector<ref::Bytes> back = ref::ep_return(rows_of_ranks(r.in, "recv_out"), rc, R, E_l, r.rank);
  for (int p = 0; p < R; ++p)
    if (r.wants(p)) r.out.ranks[size_t(p)]["routed_output"] = rows_tensor(std::move(back[size_t(p)]), act_elem(c.dtype), c.hidden);
}

Stage make(const std::string& slot, const std::string& variant, const std::string& summary,
           std::vector<std::string> inputs, std::vector<OutputSpec> outputs, std::function<void(FastCtx&)> fast,
           std::function<void(RefCtx&)> ref) {
  Stage s = make_stage(slot, variant, summary, always, std::move(inputs), std::move(outputs), std::move(fast),
                       std::move(ref));
  s.ref_per_rank = true;  // every reference above honours RefCtx::rank
  // Every forward EP variant moves rows with the row-map bodies (on a device
  // when there is one) and exchanges them through the Communicator
  // (FastCtx::exchange_rows: device to device where the Communicator moves
  // device buffers, host-staged under MPI, docs/architecture.md idea 3); the count
  // exchange is host metadata, uploaded after the call where a device reads it.
  s.backends = kHostAndDevice;
  return s;
}

}  // namespace

int64_t uniform_count(const std::vector<int64_t>& v) {
  if (v.empty() || v[0] <= 0) return 0;
  for (int64_t x : v)
    if (x != v[0]) return 0;
  return v[0];
}

void register_ep_stages(std::vector<Stage>& reg) {
  reg.push_back(make("ep_dispatch", "a2a_variable",
                     "splits from counts, count exchange, token all-to-all-v; rank-major receive (docs/contract.md §3)",
                     {"routed_input", "counts", "x", "ids", "topk_scores"},
                     {{"input_splits", CompareClass::exact, Coords::flat, nullptr},
                      {"output_splits", CompareClass::exact, Coords::flat, nullptr},
                      {"recv_counts", CompareClass::exact, Coords::flat, nullptr},
                      {"recv", CompareClass::exact, Coords::rank_major_row, promise_always},
                      {"overload", CompareClass::exact, Coords::flat, nullptr}},
                     fast_a2a_dispatch, ref_a2a_dispatch));
  reg.back().primary = [](const Case& c) { return c.equal_split.policy == EqualSplitPolicy::off; };
  const std::vector<OutputSpec> dispatch_outputs = reg.back().outputs;  // the act variants'
  const std::vector<std::pair<std::string, std::string>> dispatch_rows = {{"routed_input", "routed_input"}, {"recv", "recv"}};
  reg.push_back(fp8_twin(reg.back(), fast_a2a_dispatch_fp8, ref_a2a_dispatch_fp8, dispatch_rows));
  reg[reg.size() - 2].applies = act_only(reg[reg.size() - 2].applies, "a2a_variable_fp8");
  {
    Stage s = make("ep_dispatch", "a2a_equal_split",
                   "pad every chunk to M* = max split (data first, zeros after), equal all-to-all, compact (docs/contract.md §5)",
                   {"routed_input", "counts", "x", "ids", "topk_scores"}, dispatch_outputs, fast_equal_split_dispatch,
                   ref_a2a_dispatch);
    s.applies = [](const Case& c) {
      return Decision{c.equal_split.policy != EqualSplitPolicy::off, "equal_split.policy: off"};
    };
    s.primary = [](const Case& c) { return c.equal_split.policy != EqualSplitPolicy::off; };
    reg.push_back(fp8_twin(s, fast_equal_split_dispatch_fp8, ref_a2a_dispatch_fp8, dispatch_rows));
    s.applies = act_only(s.applies, "a2a_equal_split_fp8");
    reg.insert(reg.end() - 1, s);
  }
  {
    Stage s = make("ep_dispatch", "a2a_force_lb",
                   "force-LB routing: analytic splits, no count exchange; direct route from x iff K == E_l (docs/contract.md §6)",
                   {"routed_input", "counts", "x", "ids", "topk_scores"}, dispatch_outputs, fast_force_lb_dispatch,
                   ref_a2a_dispatch);
    s.applies = [](const Case& c) {
      bool same_T = true;
      for (int r = 0; r < c.ep; ++r) same_T = same_T && c.tokens_on(r) == c.tokens_on(0);
      if (c.router.force_load_balance != Switch::on) return Decision{false, "router.force_load_balance: off"};
      if (c.fp8()) return Decision{false, "dispatch.dtype: fp8_e4m3 (the force-LB route sends activation rows)"};
      return Decision{same_T, "ranks have different token counts (analytic splits need equal T)"};
    };
    s.primary = [](const Case&) { return false; };
    reg.push_back(s);
  }
  for (PermuteMode m : {PermuteMode::generic, PermuteMode::equal_count}) {
    const bool eq = m == PermuteMode::equal_count;
    Stage s = make("ep_permute", eq ? "equal_count" : "generic",
                   eq ? "transpose (R, E_l, c) -> (E_l, R, c) when every segment has c rows (docs/contract.md §7)"
                      : "index table from the received counts, rank-major -> expert-major (docs/contract.md §3)",
                   {"recv", "recv_counts"},
                   {{"permuted", CompareClass::exact, Coords::expert_row, promise_always},
                    {"expert_counts_real", CompareClass::exact, Coords::flat, nullptr}},
                   eq ? fast_permute_equal : fast_permute_generic, ref_permute);
    s.primary = [m](const Case& c) { return c.permute == m || (c.permute == PermuteMode::auto_ && m == PermuteMode::equal_count); };
    s.asked = [m](const Case& c) { return c.permute == m; };
    if (eq) s.applies = [](const Case& c) { return Decision{c.permute != PermuteMode::generic, "permute: generic"}; };
    reg.push_back(s);
    reg.push_back(fp8_twin(s, eq ? fast_permute_equal_fp8 : fast_permute_generic_fp8, ref_permute_fp8,
                           {{"recv", "recv"}, {"permuted", "permuted"}}));
    reg[reg.size() - 2].applies = act_only(s.applies, s.variant + "_fp8");
  }
  reg.push_back(make("align_pad", "pad_groups",
                     "each expert group: real rows, then zero rows to a multiple of align; 64-bit offsets (docs/contract.md §4)",
                     {"permuted", "expert_counts_real"},
                     {{"expert_input", CompareClass::exact, Coords::padded_row, nullptr},  // a rank may hold only padding
                      {"expert_counts", CompareClass::exact, Coords::flat, nullptr}},
                     fast_pad, ref_pad));
  reg.push_back(fp8_twin(reg.back(), fast_pad_fp8, ref_pad_fp8, {{"permuted", "permuted"}, {"expert_input", "expert_input"}}));
  reg[reg.size() - 2].applies = act_only(reg[reg.size() - 2].applies, "pad_groups_fp8");
  reg.push_back(make("align_unpad", "unpad_groups", "keeps each group's real rows; padding never reaches the output",
                     {"expert_output", "expert_counts", "expert_counts_real"},
                     {{"unpadded", CompareClass::exact, Coords::expert_row, nullptr}}, fast_unpad, ref_unpad));
  for (PermuteMode m : {PermuteMode::generic, PermuteMode::equal_count}) {
    const bool eq = m == PermuteMode::equal_count;
    Stage s = make("ep_unpermute", eq ? "equal_count" : "generic",
                   eq ? "inverse transpose (E_l, R, c) -> (R, E_l, c)" : "inverse index table, expert-major -> rank-major",
                   {"unpadded", "recv_counts"}, {{"recv_out", CompareClass::exact, Coords::rank_major_row, nullptr}},
                   eq ? fast_unpermute_equal : fast_unpermute_generic, ref_unpermute);
    s.primary = [m](const Case& c) { return c.permute == m || (c.permute == PermuteMode::auto_ && m == PermuteMode::equal_count); };
    s.asked = [m](const Case& c) { return c.permute == m; };
    if (eq) s.applies = [](const Case& c) { return Decision{c.permute != PermuteMode::generic, "permute: generic"}; };
    reg.push_back(s);
  }
  reg.push_back(make("ep_combine", "a2a_variable", "reverse all-to-all-v with send/receive splits swapped (docs/contract.md §3.5)",
                     {"recv_out", "input_splits", "output_splits"},
                     {{"routed_output", CompareClass::exact, Coords::dispatch_row, nullptr}}, fast_a2a_return,
                     ref_a2a_return));
  reg.back().primary = [](const Case& c) { return c.equal_split.policy == EqualSplitPolicy::off; };
  {
    Stage s = make("ep_combine", "a2a_equal_split", "pad(output_splits) -> equal all-to-all -> compact(input_splits)",
                   {"recv_out", "input_splits", "output_splits"}, reg.back().outputs, fast_equal_split_return,
                   ref_a2a_return);
    s.applies = [](const Case& c) {
      return Decision{c.equal_split.policy != EqualSplitPolicy::off, "equal_split.policy: off"};
    };
    s.primary = [](const Case& c) { return c.equal_split.policy != EqualSplitPolicy::off; };
    reg.push_back(s);
  }
}

}  // namespace moev
