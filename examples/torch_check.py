#!/usr/bin/env python3
"""A torchtitan-style local dispatcher run on exported inputs (docs/frameworks.md §2):
argsort of the flat expert ids, index_select of the token rows, and a
scatter_add combine; its outputs go to GOLDEN_DIR/actual/ for `moeverify check`.

    python3 examples/torch_check.py GOLDEN_DIR

Exits 77 (reported skipped by ctest, never passed) when torch cannot be
imported. The combine follows torchtitan: y = (float(routed_output) * score)
rounded to the activation dtype, then scatter_add into zeros. PyTorch's CPU
scatter_add on bf16 accumulates a token's contributions in fp32 and rounds
once (docs/contract.md §14: `combine.accumulate: fp32_accumulate`), so bf16 cases are
exported with that option; in fp32 both accumulate modes are the same.
"""
import json
import os
import sys

try:
    import numpy as np
    import torch
except ImportError as e:  # an honest skip: the check did not run
    print("torch_check.py: skipped:", e)
    sys.exit(77)

TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(gdir, name, dtype):
    a = np.load(os.path.join(gdir, name + ".npy"))
    if dtype in ("bfloat16", "float16"):  # stored as uint16 bit patterns
        return torch.from_numpy(a.view(np.int16).copy()).view(TORCH_DTYPE[dtype])
    return torch.from_numpy(a.copy())


def save(adir, name, t):
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        a = t.view(torch.int16).numpy().view(np.uint16)
    else:
        a = t.numpy()
    np.save(os.path.join(adir, name + ".npy"), a)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    gdir = sys.argv[1]
    with open(os.path.join(gdir, "manifest.json")) as f:
        man = json.load(f)
    case = man["case"]
    if man["ranks"] != 1 or case["shared_experts.kind"] != "none" or case["score_before_experts"] != "off":
        sys.exit("torch_check.py: local path without shared experts, scores after the experts only")
    act = {t["name"]: t["dtype"] for t in man["tensors"]}["x"]
    torch.set_num_threads(1)
    x = load(gdir, "x", act)
    ids = load(gdir, "ids", "int32").long()
    top_scores = load(gdir, "topk_scores", "float32")
    T, K = ids.shape
    D = x.shape[1]

    # dispatch (torchtitan TokenReorderer + LocalTokenDispatcher)
    token_indices_experts_sorted = torch.argsort(ids.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    token_indices_experts_sorted = token_indices_experts_sorted // K
    routed_input = torch.index_select(x, 0, token_indices_experts_sorted)

    # combine (torchtitan: score after the experts, then scatter_add)
    routed_output = load(gdir, "routed_output", act)
    y = (routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
    out = torch.zeros_like(x)
    index = token_indices_experts_sorted.reshape(-1, 1).expand(-1, D)
    out = out.scatter_add(0, index, y)

    adir = os.path.join(gdir, "actual")
    os.makedirs(adir, exist_ok=True)
    save(adir, "routed_input", routed_input)
    save(adir, "token_sorted", token_indices_experts_sorted.to(torch.int32))
    save(adir, "score_sorted", top_scores_experts_sorted.to(torch.float32))
    save(adir, "out", out)
    print("torch_check.py: torch", torch.__version__, "wrote", adir)


if __name__ == "__main__":
    main()
