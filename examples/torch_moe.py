#!/usr/bin/env python3
"""A torchtitan-style MoE layer in PyTorch, local (EP = 1): dispatch by a
stable argsort of the expert ids, SwiGLU experts (or identity), and the
combine by scatter_add, written for `moeverify fuzz --impl`:

    python3 examples/torch_moe.py CASE_DIR          # one exported case folder
    python3 examples/torch_moe.py --serve           # worker: torch imported once
    moeverify fuzz --impl "python3 examples/torch_moe.py --serve" --worker \\
        --profile examples/torch_moe.profile.yaml

The arithmetic is torchtitan's at HEAD, the conventions of the torchtitan
profile (docs/contract.md §14): X and the expert weights cast to bf16
(GroupedExperts' .bfloat16()), silu rounded before the multiply, the score
multiplied in fp32 and rounded once, and PyTorch's CPU scatter_add summing
a token's rows in fp32. Writes dispatch.{routed_input,token_sorted,
score_sorted}, experts.expert_output (padded groups, judged within the
GEMM bound), ep_combine.routed_output (those outputs in dispatch order) and
combine.out; the routing is the exported one.

A configuration it does not implement (EP > 1, shared experts, scores
before the experts, capacity, SP, FP8 dispatch) raises moeverify.Unsupported:
exit 77, counted as skipped. Without torch it exits 77 too.
"""
import os
import sys

try:
    import torch
except ImportError as e:  # an honest skip: nothing ran
    print("torch_moe.py: skipped: %s" % e, file=sys.stderr)
    sys.exit(77)
try:
    import moeverify
except ImportError:  # not installed: the package beside this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeverify

torch.set_num_threads(1)  # fuzz --jobs runs one worker per core


def refuse_unsupported(g):
    c = g.case
    needs = {"ep": 1, "shared_experts.kind": "none", "score_before_experts": "off", "capacity.factor": 0.0,
             "sp": 1, "combine.buffer": "fresh", "combine.placement": "out_of_place",
             "combine.accumulate": "fp32_accumulate", "experts.compute_dtype": "bf16",
             "experts.rounding": "torchtitan", "score_multiply": "fp32"}
    for key, want in needs.items():
        if c[key] != want:
            raise moeverify.Unsupported("%s must be %s" % (key, want))
    if c.get("dispatch.dtype", "act") != "act":
        raise moeverify.Unsupported("dispatch.dtype must be act")
    if c.get("score_on_hidden", "off") != "off":
        raise moeverify.Unsupported("score_on_hidden must be off (the score multiplies after the experts here)")


def swiglu_experts(x, counts, w1, w3, w2):
    """torchtitan's for-loop over experts with GroupedExperts' bf16 casts:
    one output block per expert, in expert order."""
    out = []
    for e, rows in enumerate(torch.split(x, counts)):
        xb = rows.bfloat16()
        h = torch.nn.functional.silu(xb @ w1[e].bfloat16().t()) * (xb @ w3[e].bfloat16().t())
        out.append((h @ w2[e].bfloat16().t()).to(x.dtype))
    return out


def padded_groups(blocks, align, pad_empty, D, dtype):
    """The experts stage's layout (docs/contract.md §4): each expert's rows,
    then zero rows up to a multiple of align; an empty expert gets align rows
    under empty_groups: pad, none under zero."""
    parts = []
    for b in blocks:
        m = -(-b.shape[0] // align) * align if b.shape[0] else (align if pad_empty else 0)
        parts += [b, torch.zeros(m - b.shape[0], D, dtype=dtype)]
    return torch.cat(parts) if parts else torch.zeros(0, D, dtype=dtype)


def moe(g):
    refuse_unsupported(g)
    x = g.input("x", as_torch=True)
    ids = g.expected("routing.ids", as_torch=True).long()
    top_scores = g.expected("routing.topk_scores", as_torch=True)
    T, K = ids.shape
    E = g.case["shape.experts"]
    # dispatch (TokenReorderer + LocalTokenDispatcher)
    order = torch.argsort(ids.view(-1), stable=True)
    score_sorted = top_scores.view(-1)[order]
    token_sorted = order // K
    routed_input = torch.index_select(x, 0, token_sorted)
    counts = torch.bincount(ids.view(-1), minlength=E).tolist()
    # experts
    if g.case["experts.kind"] == "swiglu":
        w1, w3, w2 = (g.input(n, as_torch=True) for n in ("w1", "w3", "w2"))
        blocks = swiglu_experts(routed_input, counts, w1, w3, w2)
        routed_output = torch.cat(blocks) if blocks else routed_input
        # judged within the GEMM bound; the stages after it are fed these rows
        g.write("experts.expert_output", padded_groups(blocks, g.case["align"], g.case["empty_groups"] == "pad",
                                                      x.shape[1], x.dtype))
    else:
        routed_output = routed_input
    # combine: score in fp32, rounded once, then scatter_add into zeros
    y = (routed_output.float() * score_sorted.reshape(-1, 1)).to(x.dtype)
    out = torch.zeros_like(x).scatter_add(0, token_sorted.reshape(-1, 1).expand(-1, x.shape[1]), y)
    g.write("dispatch.routed_input", routed_input)
    g.write("dispatch.token_sorted", token_sorted)
    g.write("dispatch.score_sorted", score_sorted)
    g.write("ep_combine.routed_output", routed_output)
    g.write("combine.out", out)


if __name__ == "__main__":
    sys.exit(moeverify.main(moe))
