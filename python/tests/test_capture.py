#!/usr/bin/env python3
"""moeverify.torch.Capture, the seam table under the framework adapters
(docs/frameworks.md §19.4): each kind of seam takes what it should, the
model computes the same with the hooks on, the hooks come off, and write()
lays tensors out as check reads them. Needs torch: exit 77 without it.

Usage: test_capture.py MOEVERIFY SOURCE_DIR (with torch: MOEVERIFY_TORCH_PYTHON)
"""
import os
import subprocess
import sys
import tempfile

binary, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(src, "python"))
try:
    import torch
except ImportError as e:
    print("skip: %s" % e)
    sys.exit(77)
import moeverify  # noqa: E402
from moeverify.torch import Capture, Seam  # noqa: E402

failures = []


def expect(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def gemm(self, A, scale=1.0):
        return (A @ self.w) * scale

    def forward(self, x, counts):
        h = self.gemm(x)
        return self.gemm(A=h, scale=2.0)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.side = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.experts(x, 3) + self.side(x)


torch.manual_seed(0)
m = Model()
x = torch.randn(3, 4, requires_grad=True)
plain = m(x)
seams = [
    Seam("experts", "in", {"a.input": 0, "a.counts": 1}),
    Seam("experts", "out", {"a.output": None}, grad={"a.grad_output": None}),
    Seam("experts", "call", {"_gemm": None}, method="gemm"),
    Seam("experts", "call_in", {"_gemm_a": "A", "_scale": "scale"}, method="gemm"),
    Seam("experts", "grad_in", {"a.grad_x_experts": 0}),
    Seam("side", "out", {"a.side": None}, every=True),
]
with Capture(m, seams, {"a.grad_w": "experts.w"}) as cap:
    y = m(x)
    m.side(x)  # a second call: every=True concatenates
    y.backward(torch.ones_like(y))
expect(torch.equal(y, plain), "the model computes the same with the hooks on")
expect(torch.equal(cap.values["a.input"], x.detach()) and cap.values["a.counts"] == 3, "in: positional inputs")
# (the module called again, not y - side(x): that subtraction rounds)
expect(torch.equal(cap.values["a.output"], m.experts(x, 3).detach()), "out: the module's output")
expect(len(cap.scratch["_gemm"]) == 2 and torch.equal(cap.scratch["_gemm"][1], cap.values["a.output"]),
       "call: every result kept in scratch, in call order")
expect(torch.equal(cap.scratch["_gemm_a"][1], cap.scratch["_gemm"][0]) and cap.scratch["_scale"] == [1.0, 2.0],
       "call_in: arguments by name, keywords and defaults included")
expect(torch.equal(cap.values["a.grad_output"], torch.ones(3, 4)), "grad: the gradient of a taken tensor")
expect(torch.allclose(cap.values["a.grad_x_experts"] + torch.ones(3, 4) @ m.side.weight, x.grad),
       "grad_in: the module's share of an input's gradient")
expect(cap.values["a.side"].shape == (6, 4), "every=True: two calls concatenated along rows")
cap.collect_param_grads()
expect(torch.equal(cap.values["a.grad_w"], m.experts.w.grad), "param_grads: read after the backward")
expect("gemm" not in vars(m.experts) and not m.experts._forward_hooks and not m._backward_hooks,
       "the hooks and wrappers come off at the end of the block")
try:
    Seam("nowhere", "call")
    expect(False, "a call seam without a method is refused")
except ValueError:
    expect(True, "a call seam without a method is refused")
try:
    with Capture(m, [Seam("experts.missing", "out", {"a.b": None})]):
        pass
    expect(False, "a seam on a module the model lacks is refused")
except ValueError as e:
    expect("missing" in str(e), "a seam on a module the model lacks is refused, naming it")
with Capture(m, [Seam("experts", "out", {"a.o": None}, grad={"a.g": None})], backward=False) as cap2:
    with torch.no_grad():
        m(x)
expect("a.g" not in cap2.values and "a.o" in cap2.values, "backward=False: grad rows not taken")

# write(): (B, L, D) flattened to the manifest's (T, D), bf16 widened into an
# fp32 entry, names the case lacks left out; check then reads them.
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "g")
    subprocess.run([binary, "export", os.path.join(src, "cases", "basic.yaml"), out, "--case", "exact_fp32"],
                   check=True, stdout=subprocess.DEVNULL)
    g = moeverify.open_all(out)[0]
    xin = g.input("x", as_torch=True)
    logits = g.expected("router_logits.logits", as_torch=True)
    c = Capture(m, [])
    c.values = {"router_logits.logits": logits.view(1, *logits.shape).bfloat16(),
                "combine.out": torch.zeros(1, *xin.shape), "no_such.stage": xin}
    written = c.write(g)
    expect(sorted(written) == ["combine.out", "router_logits.logits"], "write: only the folder's names")
    back = g.expected("router_logits.logits", as_torch=True).bfloat16().float()
    got = torch.from_numpy(__import__("numpy").load(os.path.join(g.actual_dir, "router_logits.logits.rank0.npy")))
    expect(got.shape == logits.shape and torch.equal(got, back), "write: (1, T, E) bf16 -> (T, E) fp32, exact")
    expect(g.clear_actual() == 2 and not os.listdir(g.actual_dir), "clear_actual removes what was written")

print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
