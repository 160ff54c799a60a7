"""Capture a PyTorch MoE's tensors at its own seams and write them under
moeverify's stage names: a table of seams instead of an adapter.

A seam is a module (by its dotted path in the model) or a method of one, and
what to take there. Each table row names the golden tensors it fills
("stage.name", as in the exported manifest) and how to pick each from what
the seam saw; `grad` rows take the gradient autograd computes for that
tensor in the backward:

    from moeverify.torch import Capture, Seam

    SEAMS = [
        Seam("router.gate", "out", {"router_logits.logits": None}),
        Seam("router", "out", {"routing.topk_scores": 0, "routing.ids": 1}),
        Seam("experts", "in", {"dispatch.routed_input": 0},
             grad={"ep_dispatch_bwd.grad_routed_input": 0}),
        Seam("experts", "out", {"experts.expert_output": None}),
    ]
    with Capture(model, SEAMS) as cap:
        out = model(x)
        out.backward(grad_out)
    cap.write(golden)        # every captured tensor, encoded as check reads it
    moeverify.check(golden.path)

Kinds: "out" (a module's forward output), "in" (its positional inputs),
"call" (the result of the method `method` of the module at `path`) and
"call_in" (that method's arguments by parameter name, keywords and defaults
included)
and "grad_in" (the gradients autograd computes for a module's inputs in the
backward: a full backward hook, so the gradient of an input that other
modules also read is this module's share alone). A
picker is None (the whole value), an index into a tuple, a name (a
result's field, e.g. a dispatch metadata object, or an argument) or a
function of the value. A seam seen more than once (a module called twice)
keeps its last value unless `every=True`, which concatenates them along
rows in call order. A name starting with "_" is scratch, not a golden
tensor: every value seen is kept, in call order, in `scratch[name]` (the
three GEMMs of one grouped call, say, to assemble [h1 | h3] from).

With backward=False (a forward-only run) the grad rows are not taken.
Values are detached copies: the capture does not change what the model
computes. Parameter gradients come from `param_grads`, a map
"stage.name" -> parameter path, read after the backward.
"""
import functools
import inspect

import torch

__all__ = ["Seam", "Capture"]


class Seam:
    """One place in the model and the golden tensors taken there."""

    KINDS = ("out", "in", "call", "call_in", "grad_in")

    def __init__(self, path, kind, take=None, grad=None, method=None, every=False):
        if kind not in self.KINDS:
            raise ValueError("Seam(%r): kind %r; valid: %s" % (path, kind, ", ".join(self.KINDS)))
        if kind.startswith("call") and not method:
            raise ValueError("Seam(%r, %r): a call seam names its method (method=...)" % (path, kind))
        self.path, self.kind, self.method, self.every = path, kind, method, every
        self.take = dict(take or {})
        self.grad = dict(grad or {})


def _pick(value, picker):
    if picker is None:
        return value
    if callable(picker):
        return picker(value)
    if isinstance(picker, str):
        return value[picker] if isinstance(value, dict) else getattr(value, picker)
    return value[picker]


def _module(model, path):
    m = model
    for part in filter(None, path.split(".")):
        m = getattr(m, part, None)
        if m is None:
            raise ValueError("seam %r: the model has no %r (valid at that level: %s)" % (
                path, part, ", ".join(n for n, _ in model.named_children()) or "none"))
    return m


class Capture:
    """Hooks the seams of `model` while in a `with` block; `values` maps
    "stage.name" to the captured tensor."""

    def __init__(self, model, seams, param_grads=None, backward=True):
        self.model, self.seams = model, list(seams)
        self.backward = backward  # False: the grad rows are not taken (a forward-only run)
        self.param_grads = dict(param_grads or {})
        self.values = {}
        self.scratch = {}
        self._parts = {}
        self._undo = []

    # ---- hooking --------------------------------------------------------

    def _store(self, seam, value):
        for name, picker in seam.take.items():
            self._keep(name, _pick(value, picker), seam.every)
        for name, picker in (seam.grad.items() if self.backward else ()):
            t = _pick(value, picker)
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                raise ValueError("seam %s %r: %s takes a gradient, but the tensor needs none (no backward "
                                 "through it, or it was computed under no_grad)" % (seam.path, seam.kind, name))
            t.register_hook(lambda g, name=name, every=seam.every: self._keep(name, g, every))

    def _keep(self, name, t, every):
        if isinstance(t, torch.Tensor):
            t = t.detach().clone()
        if name.startswith("_"):
            self.scratch.setdefault(name, []).append(t)
        elif every:
            self._parts.setdefault(name, []).append(t)
            self.values[name] = torch.cat(self._parts[name])
        else:
            self.values[name] = t

    def _hook(self, seam):
        target = _module(self.model, seam.path)
        if seam.kind == "out":
            h = target.register_forward_hook(lambda m, args, out: self._store(seam, out))
            self._undo.append(h.remove)
        elif seam.kind == "grad_in":
            if self.backward:
                h = target.register_full_backward_hook(lambda m, grad_in, grad_out: self._store(seam, grad_in))
                self._undo.append(h.remove)
        elif seam.kind == "in":
            h = target.register_forward_pre_hook(lambda m, args: self._store(seam, args))
            self._undo.append(h.remove)
        else:
            original = getattr(target, seam.method)
            signature = inspect.signature(original)

            @functools.wraps(original)  # a second seam on this method sees its signature
            def wrapped(*args, **kwargs):
                if seam.kind == "call_in":
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    self._store(seam, dict(bound.arguments))
                result = original(*args, **kwargs)
                if seam.kind == "call":
                    self._store(seam, result)
                return result

            had = seam.method in vars(target)
            setattr(target, seam.method, wrapped)
            self._undo.append(lambda: setattr(target, seam.method, original) if had
                              else delattr(target, seam.method))

    def __enter__(self):
        for seam in self.seams:
            self._hook(seam)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False

    # ---- writing --------------------------------------------------------

    def collect_param_grads(self):
        """Reads the parameter gradients named in param_grads (after the backward)."""
        for name, path in self.param_grads.items():
            p = self.model.get_parameter(path)
            if p.grad is not None:
                self.values[name] = p.grad.detach().clone()

    def write(self, golden, rank=0, skip=()):
        """Writes every captured tensor the golden folder expects; returns the
        names written. A captured name the folder does not expect (a stage
        that case does not have) is left out; `skip` leaves out more."""
        self.collect_param_grads()
        expected = {"%s.%s" % (e.stage, e.name): e for e in golden.entries
                    if e.role == "expected" and e.rank == rank and e.layer == 1}
        written = []
        for name, t in self.values.items():
            if name in skip or name not in expected:
                continue
            nd = len(expected[name].shape)
            if isinstance(t, torch.Tensor) and t.dim() > nd >= 1:
                t = t.reshape((-1,) + tuple(t.shape[t.dim() - nd + 1:]))  # (B, L, ...) -> (B*L, ...)
            if expected[name].dtype == "float32" and t.dtype in (torch.bfloat16, torch.float16):
                t = t.float()  # a gradient kept in fp32 whose values the framework made in bf16: exact
            stage, _, tensor = name.rpartition(".")
            golden.write(tensor, t, rank=rank, stage=stage)
            written.append(name)
        return written
