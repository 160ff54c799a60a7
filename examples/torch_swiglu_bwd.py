#!/usr/bin/env python3
"""PyTorch autograd of torchtitan's SwiGLU experts, run on exported inputs: the
gradients of the experts_bwd (and shared_experts_bwd) stages go to
GOLDEN_DIR/actual/ for `moeverify check` (docs/contract.md §13: the rounding points of
experts.rounding torchtitan and experts.compute_dtype bf16 are autograd's).

    python3 examples/torch_swiglu_bwd.py GOLDEN_DIR [--bug fp32_activation] [--device cuda]

Per expert, as torchtitan's GroupedExperts: h = silu(x @ w1.T) * (x @ w3.T),
out = h @ w2.T, under compute_dtype bf16 with x.bfloat16() taken once per
GEMM and the weights' .bfloat16(), the output .type_as(x); out.backward(dY)
gives the input and weight gradients in the operands' dtypes. The shared
expert is the same module on every token, in the activation dtype.
--bug fp32_activation computes silu(h1) * h3 in fp32 and rounds once (a
fused activation): `check` must then fail at experts_bwd. --device runs the
autograd on that torch device (default cpu).

Exits 77 (reported skipped by ctest, never passed) when torch cannot be
imported. One rank only (the stage's inputs are rank 0's).
"""
import os
import sys

try:
    import torch
    import torch.nn.functional as Fn
except ImportError as e:  # an honest skip: the check did not run
    print("torch_swiglu_bwd.py: skipped:", e)
    sys.exit(77)
try:
    import moeverify
except ImportError:  # not installed: the package beside this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeverify


def experts_grads(x, dy, w1, w3, w2, counts, bf16_compute, bug):
    """Autograd gradients (dx, dw1, dw3, dw2) of the grouped experts."""
    x = x.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in (w1, w3, w2)]
    cast = (lambda t: t.bfloat16()) if bf16_compute else (lambda t: t)
    outs, r0 = [], 0
    for j, n in enumerate(counts):
        xe = x[r0:r0 + n]
        h1 = cast(xe) @ cast(ws[0][j]).mT
        h3 = cast(xe) @ cast(ws[1][j]).mT
        if bug == "fp32_activation":
            h = (Fn.silu(h1.float()) * h3.float()).to(h1.dtype)
        else:
            h = Fn.silu(h1) * h3
        outs.append((h @ cast(ws[2][j]).mT).type_as(x))
        r0 += n
    torch.cat(outs).backward(dy[:r0])
    return x.grad, ws[0].grad, ws[1].grad, ws[2].grad


def main():
    args = sys.argv[1:]
    bug = None
    device = "cpu"
    while len(args) >= 3 and args[-2] in ("--bug", "--device"):
        if args[-2] == "--bug":
            if args[-1] != "fp32_activation":
                sys.exit(__doc__)
            bug = args[-1]
        else:
            device = args[-1]
        args = args[:-2]
    if len(args) != 1:
        sys.exit(__doc__)
    g = moeverify.open(args[0])
    case = g.case
    if g.ranks != 1 or case["experts.kind"] != "swiglu" or case["experts.rounding"] != "torchtitan":
        sys.exit("torch_swiglu_bwd.py: one rank, SwiGLU experts, experts.rounding torchtitan")
    torch.set_num_threads(1)
    bf16_compute = case["experts.compute_dtype"] == "bf16"
    counts = [int(c) for c in g.expected("align_pad.expert_counts")]
    x = g.expected("align_pad.expert_input", as_torch=True).to(device)
    dy = g.expected("align_unpad_bwd.grad_expert_output", as_torch=True).to(device)
    w = [g.input(n, as_torch=True).to(device) for n in ("w1", "w3", "w2")]
    dx, dw1, dw3, dw2 = experts_grads(x, dy, *w, counts, bf16_compute, bug)
    g.write("experts_bwd.grad_expert_input", dx[:sum(counts)])
    for name, t in (("grad_w1", dw1), ("grad_w3", dw3), ("grad_w2", dw2)):
        g.write("experts_bwd." + name, t.float())
    if case["shared_experts.kind"] == "swiglu":
        xs = g.input("x", as_torch=True).to(device)
        ws = [g.input(n, as_torch=True).reshape(1, *g.input(n).shape[-2:]).to(device)
              for n in ("shared_w1", "shared_w3", "shared_w2")]
        dx, dw1, dw3, dw2 = experts_grads(xs, g.input("grad_out", as_torch=True).to(device), *ws, [xs.shape[0]], False, bug)
        g.write("shared_experts_bwd.grad_x_shared", dx)
        for name, t in (("grad_shared_w1", dw1), ("grad_shared_w3", dw3), ("grad_shared_w2", dw2)):
            g.write("shared_experts_bwd." + name, t[0].float())
    print("torch_swiglu_bwd.py: torch", torch.__version__, "on", device, "wrote", g.actual_dir)


if __name__ == "__main__":
    main()
