#!/usr/bin/env python3
"""An MoE dispatch, expert-parallel exchange and combine written with NumPy
only, apart from moeverify's code: the kind of implementation `moeverify
check` verifies. Local (EP = 1) and expert-parallel (EP = R) cases; the
all-to-all is done in one process, by handing each rank's rows to the rank
that owns their experts.

    python3 examples/numpy_moe.py GOLDEN_CASE_DIR [--bug NAME]
    python3 examples/numpy_moe.py --serve [--bug NAME]     (a worker for fuzz --impl --worker)
    moeverify fuzz --impl "python3 examples/numpy_moe.py {case}" --profile examples/numpy_moe.profile.yaml

A configuration it does not implement (capacity, equal split, SP, an
in-place or aliased combine, FP8 dispatch) exits 77, so `fuzz --impl` counts it skipped;
examples/numpy_moe.profile.yaml says the same to the generator.

Reads, for every rank, the exported inputs and routing (x, ids, topk_scores)
and the expert outputs in dispatch order (ep_combine.routed_output, as the
model hands them back), and writes under GOLDEN_CASE_DIR/actual/:
  dispatch.{routed_input,token_sorted,score_sorted,row_of}
  ep_dispatch.{input_splits,output_splits,recv_counts,recv,overload}   (EP > 1)
  ep_permute.{permuted,expert_counts_real}                              (EP > 1)
  combine.out
Every other stage is left to the reference (`check` lists it as not written).

--bug plants a mistake so that a test can see `check` catch it:
  unstable_order     rows of one expert in descending token order
  score_in_bf16      (bf16) score rounded to bf16 before the multiply
  skip_last_source   (EP) rank R-1's rows are never received (a skipped send)
  source_major       (EP) ep_permute keeps received order, not expert-major
  router_norm_detached  (backward, route_norm) the denominator's gradient dropped

The arithmetic follows docs/contract.md §2 and §3 literally: a stable argsort
of the flat ids gives expert-major rows with ascending tokens inside an
expert; rank p receives, from every source rank in rank order, that source's
rows for p's experts; the permute orders them by local expert, then source
rank. The combine multiplies in fp32, rounds to the activation dtype, and
adds a token's contributions in ascending dispatch row order, rounding after
every addition (`per_add`) or once at the end (`fp32_accumulate`); under
`score_multiply: act` the score is rounded to the activation dtype first.
With `backward: on` it also writes grad_x, the dispatch backward (§13), and
the router backward (§13, router):
  router_bwd.{grad_scores,grad_logits,grad_wg,grad_x_router}
in float32 in NumPy's own order (its matmul is BLAS's sgemm); under
`router.score_dtype: act` rounded to the activation dtype after every
operation, as PyTorch's autograd of bf16 tensors does.
"""
import os
import sys

import numpy as np

try:
    import moeverify
except ImportError:  # not installed: the package beside this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeverify

BUGS = ("unstable_order", "score_in_bf16", "skip_last_source", "source_major", "router_norm_detached")
ROUND = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def rnd(v, dtype):
    """float32 values rounded to the activation dtype, back as float32."""
    v = np.asarray(v, np.float32)
    if dtype == "float32":
        return v
    return moeverify.decode(moeverify.encode(v, dtype, "value"), dtype)


def dispatch(x, ids, topk, act, case, bug):
    """One rank's local dispatch (docs/contract.md §2)."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    perm = np.argsort(flat, kind="stable")
    if bug == "unstable_order" and perm.size:
        rows = np.nonzero(flat[perm] == flat[perm[0]])[0]
        perm[rows] = perm[rows][::-1]
    token_sorted = (perm // K).astype(np.int32)
    score_sorted = topk.reshape(-1)[perm].astype(np.float32)
    row_of = np.empty(T * K, np.int32)
    row_of[perm] = np.arange(T * K, dtype=np.int32)
    routed = x[token_sorted]
    if case["score_before_experts"] == "on":
        routed = rnd(routed * score_factor(score_sorted, act, case)[:, None], act)
    return routed, token_sorted, score_sorted, row_of.reshape(T, K)


def score_factor(score_sorted, act, case):
    # score_multiply: act (docs/contract.md §14) multiplies by the score rounded to act
    return rnd(score_sorted, act) if case["score_multiply"] == "act" else score_sorted


def exchange(g, counts, routed, bug):
    """The all-to-all of docs/contract.md §3 for every rank at once: rank p
    receives from each source rank s, in rank order, s's rows for p's experts
    (s's dispatch order). Returns per-rank dicts of the ep_* tensors."""
    R = g.ranks
    El = len(counts[0]) // R
    starts = [np.concatenate([[0], np.cumsum(c)]) for c in counts]
    out = []
    for p in range(R):
        sources = [s for s in range(R) if not (bug == "skip_last_source" and s == R - 1 and p != s)]
        blocks = [routed[s][starts[s][p * El]:starts[s][(p + 1) * El]] for s in sources]
        recv_counts = np.array([counts[s][p * El + j] for s in range(R) for j in range(El)], np.int64)
        recv = np.concatenate(blocks) if blocks else routed[p][:0]
        # expert-major: local expert j, then source rank s
        offs = np.concatenate([[0], np.cumsum(recv_counts)])
        order = [np.arange(offs[s * El + j], offs[s * El + j + 1]) for j in range(El) for s in range(R)]
        idx = np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64)
        permuted = recv if bug == "source_major" else recv[idx[idx < len(recv)]]
        out.append({
            "ep_dispatch.input_splits": np.array([counts[p][q * El:(q + 1) * El].sum() for q in range(R)], np.int64),
            "ep_dispatch.output_splits": recv_counts.reshape(R, El).sum(axis=1),
            "ep_dispatch.recv_counts": recv_counts,
            "ep_dispatch.recv": recv,
            "ep_permute.permuted": permuted,
            "ep_permute.expert_counts_real": recv_counts.reshape(R, El).sum(axis=0),
        })
    received = [len(o["ep_dispatch.recv"]) for o in out]
    for o in out:
        o["ep_dispatch.overload"] = np.array([max(received), sum(received)], np.int64)
    return out


def combine(g, r, x, token_sorted, score_sorted, act, case, bug):
    """One rank's combine of the expert outputs in dispatch row order."""
    y = g.expected("ep_combine.routed_output", rank=r)
    if case["score_before_experts"] != "on":
        s = score_factor(score_sorted, act, case)
        if bug == "score_in_bf16":
            s = rnd(s, "bfloat16")
        y = rnd(y * s[:, None], act)
    shared = case["shared_experts.kind"] != "none"
    order = case["shared_experts.order"]
    out = np.zeros_like(x)
    if shared and order == "init_with_shared":
        out = g.expected("shared_experts.shared_out", rank=r)
    if case["combine.accumulate"] == "per_add":
        for i in range(len(token_sorted)):           # ascending row = ascending expert
            t = token_sorted[i]
            out[t] = rnd(out[t] + y[i], act)
    else:
        wide = out.copy()
        np.add.at(wide, token_sorted, y)             # fp32 sums, rounded once
        out = rnd(wide, act)
    if shared and order == "add_after":
        out = rnd(out + g.expected("shared_experts.shared_out", rank=r), act)
    return out


def dispatch_backward(g, r, token_sorted, score_sorted, act, case):
    """grad_x of one rank (docs/contract.md §13): a token's K row gradients
    (ep_dispatch_bwd.grad_routed_input; under score_before_experts each one
    times its score, rounded to act: grad_topk_scores is not written here)
    added in ascending dispatch row order,
    rounding after every addition (`grad_accumulate: per_add`, autograd's
    index_put_) or once (`fp32_accumulate`; `as_combine`: the combine's mode),
    then the shared expert's gradient with one rounding."""
    mode = case.get("grad_accumulate", "as_combine")  # the key is in the manifest only when set
    if mode == "as_combine":
        mode = case["combine.accumulate"]
    rows = g.expected("ep_dispatch_bwd.grad_routed_input", rank=r)
    if case["score_before_experts"] == "on":
        rows = rnd(rows * score_factor(score_sorted, act, case)[:, None], act)
    out = np.zeros((case_tokens(g, r), rows.shape[1]), np.float32)
    if mode == "per_add":
        for i, t in enumerate(token_sorted):
            out[t] = rnd(out[t] + rows[i], act)
    else:
        np.add.at(out, token_sorted, rows)
        out = rnd(out, act)
    if case["shared_experts.kind"] != "none":
        out = rnd(out + g.expected("shared_experts_bwd.grad_x_shared", rank=r), act)
    return out


def router_backward(g, r, act, case, bug):
    """The router backward of one rank (docs/contract.md §13, router), in
    float32: from the top-K scores' gradient (whichever stage wrote it)
    through route_scale, route_norm and the gather to the scores, through
    softmax or sigmoid to the logits, then the gate's two GEMMs. Held scores
    (router.score_dtype act): every value an act tensor, rounded after each
    operation in autograd's order (the quotient's gradient for the
    denominator is -g * ((s / den) / den), summed over the K)."""
    held = case["router.score_dtype"] == "act"
    h = (lambda v: rnd(v, act)) if held else (lambda v: np.asarray(v, np.float32))
    s = g.expected("routing.scores", rank=r)
    ids = g.expected("routing.ids", rank=r).astype(np.int64)
    gp = h(g.expected("grad_topk_scores", rank=r) * np.float32(case["router.route_scale"]))
    x, wg = g.input("x", rank=r), g.input("wg", rank=r)
    chosen = np.take_along_axis(s, ids, axis=1)
    if case["router.route_norm"] == "on":
        den = h(h(chosen.sum(axis=1, keepdims=True)) + np.float32(1e-20))
        direct = h(gp / den)
        if bug == "router_norm_detached":
            gp = direct
        else:
            through_den = h((h(gp * h(h(chosen / den) / den))).sum(axis=1, keepdims=True))
            gp = h(direct - through_den)
    gs = np.zeros_like(s)
    np.put_along_axis(gs, ids, gp, axis=1)
    if case["router.score"] == "sigmoid":
        gl = gs * (s * (1 - s))
    else:
        gl = s * (gs - (gs * s).sum(axis=1, keepdims=True))
    if held and case["router.gate_dtype"] == "act":
        gl = h(gl)  # the logits are an act tensor: their gradient is one
    a = rnd(gl, act) if case["router.gate_dtype"] == "act" else gl
    return {"router_bwd.grad_scores": gs, "router_bwd.grad_logits": gl,
            "router_bwd.grad_wg": rnd(a.T @ x, act), "router_bwd.grad_x_router": rnd(a @ wg, act)}


def case_tokens(g, r):
    return g.input("x", rank=r).shape[0]


def refuse_unsupported(case):
    plain = {"capacity.factor": 0.0, "equal_split.policy": "off", "sp": 1, "combine.buffer": "fresh",
             "combine.placement": "out_of_place"}
    for key, want in plain.items():
        if case[key] != want:
            raise moeverify.Unsupported("%s must be %s (this example implements the plain path)" % (key, want))
    if case.get("dispatch.dtype", "act") != "act":  # the key is in the manifest only under FP8 dispatch
        raise moeverify.Unsupported("dispatch.dtype must be act (no FP8 dispatch here)")
    if case.get("score_on_hidden", "off") != "off":
        raise moeverify.Unsupported("score_on_hidden must be off (the score multiplies in the combine here)")


def implement(g, bug=None):
    """Writes this implementation's outputs for one case folder."""
    case = g.case
    refuse_unsupported(case)
    act = ROUND[case["dtype"]]
    R = g.ranks

    per_rank = []
    for r in range(R):
        x = g.input("x", rank=r)
        ids = g.expected("routing.ids", rank=r).astype(np.int64)
        topk = g.expected("routing.topk_scores", rank=r)
        per_rank.append((x, ids) + dispatch(x, ids, topk, act, case, bug))
    if R > 1:
        E = case["shape.experts"]
        counts = [np.bincount(ids.reshape(-1), minlength=E) for _, ids, *_ in per_rank]
        for r, tensors in enumerate(exchange(g, counts, [p[2] for p in per_rank], bug)):
            for name, value in tensors.items():
                g.write(name, value, rank=r)
    for r, (x, ids, routed, token_sorted, score_sorted, row_of) in enumerate(per_rank):
        g.write("dispatch.routed_input", routed, rank=r)
        g.write("dispatch.token_sorted", token_sorted, rank=r)
        g.write("dispatch.score_sorted", score_sorted, rank=r)
        g.write("dispatch.row_of", row_of, rank=r)
        g.write("combine.out", combine(g, r, x, token_sorted, score_sorted, act, case, bug), rank=r)
        if case["backward"] == "on":
            g.write("dispatch_bwd.grad_x", dispatch_backward(g, r, token_sorted, score_sorted, act, case), rank=r)
            for name, value in router_backward(g, r, act, case, bug).items():
                g.write(name, value, rank=r)
    print("numpy_moe.py: %s, %d rank(s): outputs written to %s" % (g.name, R, g.actual_dir))


def main():
    args = sys.argv[1:]
    if args in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    bug = None
    if "--bug" in args:
        i = args.index("--bug")
        bug = args[i + 1] if i + 1 < len(args) else ""
        del args[i:i + 2]
        if bug not in BUGS:
            sys.exit("numpy_moe.py: --bug %r; valid: %s" % (bug, ", ".join(BUGS)))
    return moeverify.main(lambda g: implement(g, bug), args)


if __name__ == "__main__":
    sys.exit(main())
