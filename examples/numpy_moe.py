#!/usr/bin/env python3
"""A local (EP = 1) MoE dispatch and combine written with NumPy only, apart
from moeverify's code: the kind of implementation `moeverify check` verifies.

    python3 examples/numpy_moe.py GOLDEN_DIR [--bug NAME]

Reads the exported inputs and routing of one golden folder (x.npy, ids.npy,
topk_scores.npy, and the expert outputs routed_output.npy, as a model would
hand them to the dispatcher) and writes under GOLDEN_DIR/actual/:
  routed_input.npy, token_sorted.npy, score_sorted.npy   (dispatch)
  out.npy                                                 (combine)
Every other stage is left to the reference (`check` lists it as not checked).

--bug plants a mistake so that a test can see `check` catch it:
  unstable_order   rows of one expert in descending token order
  score_in_bf16    (bf16) score rounded to bf16 before the multiply

The arithmetic follows docs/contract.md §2 literally: a stable argsort of the
flat ids gives expert-major rows with ascending tokens inside an expert; the
combine multiplies in fp32, rounds to the activation dtype, and adds the
token's contributions in ascending dispatch row order, rounding after every
addition (`per_add`) or once at the end (`fp32_accumulate`); under
`score_multiply: act` the score is rounded to the activation dtype first.
"""
import json
import os
import sys

import numpy as np


def to_f32(a, dtype):
    """Stored activations to float32 values (bf16/fp16 arrive as uint16 bits)."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return a.view(np.float16).astype(np.float32)
    return a.astype(np.float32)


def from_f32(v, dtype):
    """float32 values to the stored form, one round-to-nearest-even."""
    v = np.ascontiguousarray(v, dtype=np.float32)
    if dtype == "bfloat16":
        u = v.view(np.uint32).astype(np.uint64)
        nan = np.isnan(v)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = 0x7FC0
        return r
    if dtype == "float16":
        return v.astype(np.float16).view(np.uint16)
    return v


def rnd(v, dtype):
    """Round float32 values to the activation dtype, back as float32."""
    return to_f32(from_f32(v, dtype), dtype)


def main():
    args = sys.argv[1:]
    bug = None
    if "--bug" in args:
        i = args.index("--bug")
        bug = args[i + 1]
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    gdir = args[0]
    with open(os.path.join(gdir, "manifest.json")) as f:
        man = json.load(f)
    case = man["case"]
    if man["ranks"] != 1:
        sys.exit("numpy_moe.py implements the local path only (ranks == 1)")
    dtypes = {t["name"]: t["dtype"] for t in man["tensors"]}
    act = dtypes["x"]
    load = lambda n: np.load(os.path.join(gdir, n + ".npy"))

    x = to_f32(load("x"), act)                       # (T, D)
    ids = load("ids").astype(np.int64)               # (T, K)
    topk = load("topk_scores").astype(np.float32)    # (T, K)
    T, K = ids.shape
    before = case["score_before_experts"] == "on"

    # Dispatch: a stable sort of the flat assignment ids a = t*K + k.
    flat = ids.reshape(-1)
    perm = np.argsort(flat, kind="stable")
    if bug == "unstable_order":
        e0 = flat[perm[0]]
        rows = np.nonzero(flat[perm] == e0)[0]
        perm[rows] = perm[rows][::-1]
    token_sorted = (perm // K).astype(np.int32)
    score_sorted = topk.reshape(-1)[perm].astype(np.float32)
    # score_multiply: act (docs/contract.md §14) multiplies by the score rounded to act
    smul = rnd(score_sorted, act) if case["score_multiply"] == "act" else score_sorted
    routed = x[token_sorted]
    if before:
        routed = rnd(routed * smul[:, None], act)

    # Combine of the expert outputs in dispatch row order.
    y = to_f32(load("routed_output"), act)           # (T*K, D)
    if not before:
        s = smul
        if bug == "score_in_bf16":
            s = rnd(s, "bfloat16")
        y = rnd(y * s[:, None], act)
    shared = case["shared_experts.kind"] != "none"
    order = case["shared_experts.order"]
    out = np.zeros_like(x)
    if shared and order == "init_with_shared":
        out = to_f32(load("shared_out"), act)
    if case["combine.buffer"] != "fresh":
        sys.exit("numpy_moe.py: combine.buffer must be fresh")
    if case["combine.accumulate"] == "per_add":
        for i in range(len(token_sorted)):           # ascending row = ascending expert
            t = token_sorted[i]
            out[t] = rnd(out[t] + y[i], act)
    else:
        wide = out.copy()
        for i in range(len(token_sorted)):
            wide[token_sorted[i]] += y[i]
        out = rnd(wide, act)
    if shared and order == "add_after":
        out = rnd(out + to_f32(load("shared_out"), act), act)

    adir = os.path.join(gdir, "actual")
    os.makedirs(adir, exist_ok=True)
    np.save(os.path.join(adir, "routed_input.npy"), from_f32(routed, act))
    np.save(os.path.join(adir, "token_sorted.npy"), token_sorted)
    np.save(os.path.join(adir, "score_sorted.npy"), score_sorted)
    np.save(os.path.join(adir, "out.npy"), from_f32(out, act))
    print("numpy_moe.py: wrote dispatch and combine outputs to", adir)


if __name__ == "__main__":
    main()
