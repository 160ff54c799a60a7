#!/usr/bin/env python3
"""A torchtitan-style local dispatcher run on exported inputs (docs/frameworks.md §2):
argsort of the flat expert ids, index_select of the token rows, and a
scatter_add combine; its outputs go to GOLDEN_DIR/actual/ for `moeverify check`.

    python3 examples/torch_check.py GOLDEN_DIR [--device cuda]

--device runs the dispatcher's tensors on that torch device (default cpu), so
a GPU's argsort, index_select and scatter_add go through `moeverify check`.

Exits 77 (reported skipped by ctest, never passed) when torch cannot be
imported. The combine follows torchtitan: y = (float(routed_output) * score)
rounded to the activation dtype, then scatter_add into zeros. PyTorch's CPU
scatter_add on bf16 accumulates a token's contributions in fp32 and rounds
once (docs/contract.md §14: `combine.accumulate: fp32_accumulate`), so bf16 cases are
exported with that option; in fp32 both accumulate modes are the same.
"""
import os
import sys

try:
    import torch
except ImportError as e:  # an honest skip: the check did not run
    print("torch_check.py: skipped:", e)
    sys.exit(77)
try:
    import moeverify
except ImportError:  # not installed: the package beside this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeverify


def main():
    args = sys.argv[1:]
    device = "cpu"
    if len(args) == 3 and args[1] == "--device":
        device = args[2]
    elif len(args) != 1:
        sys.exit(__doc__)
    g = moeverify.open(args[0])
    case = g.case
    if g.ranks != 1 or case["shared_experts.kind"] != "none" or case["score_before_experts"] != "off" \
            or case.get("score_on_hidden", "off") != "off":
        sys.exit("torch_check.py: local path without shared experts, scores after the experts only "
                 "(examples/torch_ep.py runs EP cases)")
    torch.set_num_threads(1)
    x = g.input("x", as_torch=True).to(device)
    ids = g.expected("routing.ids", as_torch=True).long().to(device)
    top_scores = g.expected("routing.topk_scores", as_torch=True).to(device)
    T, K = ids.shape
    D = x.shape[1]

    # dispatch (torchtitan TokenReorderer + LocalTokenDispatcher)
    token_indices_experts_sorted = torch.argsort(ids.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    token_indices_experts_sorted = token_indices_experts_sorted // K
    routed_input = torch.index_select(x, 0, token_indices_experts_sorted)

    # combine (torchtitan: score after the experts, then scatter_add)
    routed_output = g.expected("ep_combine.routed_output", as_torch=True).to(device)
    y = (routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
    out = torch.zeros_like(x)
    index = token_indices_experts_sorted.reshape(-1, 1).expand(-1, D)
    out = out.scatter_add(0, index, y)

    g.write("dispatch.routed_input", routed_input)
    g.write("dispatch.token_sorted", token_indices_experts_sorted)
    g.write("dispatch.score_sorted", top_scores_experts_sorted)
    g.write("combine.out", out)
    print("torch_check.py: torch", torch.__version__, "on", device, "wrote", g.actual_dir)


if __name__ == "__main__":
    main()
