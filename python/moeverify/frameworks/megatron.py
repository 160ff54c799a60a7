"""Megatron-Core's MoE layer, as installed, on exported case folders.

    python -m moeverify.frameworks.megatron CASE_DIR...
    moeverify fuzz --impl "python -m moeverify.frameworks.megatron --serve" --worker \\
        --profile cases/profiles/megatron-0.16.yaml

Builds Megatron-Core's own `MoELayer` (TopKRouter, the all-gather token
dispatcher with moe_utils.permute/unpermute, SequentialMLP experts with a
fused [w1 | w3] linear_fc1, a SharedExpertMLP where the case has one) in a one-process gloo group, loads the case's
inputs into its parameters, runs its forward and writes what its code made
at its seams (moeverify.torch.Capture; SEAMS below, docs/frameworks.md).

What it judges, and what not (docs/frameworks.md "Megatron-Core"):
  - router_logits, routing (ids and top-k probabilities from its dense
    probs and routing map), dispatch (the permute), the experts' [h1 | h3],
    their scaled hidden and outputs, and the combine: Megatron-Core 0.16
    multiplies each row's probability into H before linear_fc2
    (per_token_scale), the case key score_on_hidden (docs/contract.md §14),
    which the profile sets.
  - Its router-level capacity (moe_expert_capacity_factor): the top-k
    before apply_router_token_dropping (routing), the kept rows (capacity);
    policy probs only, no padding to capacity (docs/frameworks.md: its
    position policy keeps arbitrary tokens, its padding rows are tokens).
  - The backward through autograd: x.grad, the probabilities' gradient at
    each token's ids, the experts' input and weight gradients, the shared
    expert's, and the router's (router_bwd): the gradient of its gating
    output, of its weight, and of its own copy of x.
Expert parallelism runs as real processes, one per EP rank:
`torchrun --nproc-per-node R -m moeverify.frameworks.megatron [--serve]`
(gloo), each rank building the MoE with MoEAlltoAllTokenDispatcher and its
E/R local experts, under moe_apply_probs_on_input only (per_token_scale's
probabilities cross the all-to-all, which score_on_hidden does not model).
A case runs where its `ep` is the world's size, else a skip naming the
torchrun line that runs it.

Shims make it run on a CPU, none touching a value: the router's gating
moves its weight to `torch.cuda.current_device()` (made the CPU);
moe_utils names `te_general_gemm` only when Transformer Engine is installed
(set to None, the fallback its own code tests for: without it,
megatron-core 0.16.1 raises NameError on every router call); the all-to-all
dispatcher's CUDA stream and events become no-ops, and its split sizes
reach all_to_all_single as the numpy arrays a GPU run hands it.
"""
import os
import sys
import warnings

try:
    import torch
except ImportError as e:  # an honest skip: nothing ran
    print("moeverify.frameworks.megatron: skipped: %s" % e, file=sys.stderr)
    sys.exit(77)

from ..impl import Unsupported
from ..torch import Capture, Seam
from . import main_for, refuse_keys, refuse_other_world, world


# The grad rows are taken in a backward run only (moeverify.torch.Capture).
SEAMS = [
    Seam("router", "call", {"router_logits.logits": None}, method="gating", grad={"router_bwd.grad_logits": None}),
    Seam("router", "out", {"_probs": 0, "_routing_map": 1}, grad={"_probs_grad": 0}),
    # its rows; under moe_apply_probs_on_input run() takes the scaled ones instead
    Seam("token_dispatcher", "call",
         {"dispatch.routed_input": 0, "routing.counts": 1, "dispatch.score_sorted": 2},
         method="dispatch_postprocess"),
    # SequentialMLP returns (output, bias): the expert rows' outputs
    Seam("experts", "out", {"experts.expert_output": 0}, grad={"combine_bwd.grad_routed_output": 0}),
]

# EP > 1: MoEAlltoAllTokenDispatcher. Under moe_apply_probs_on_input (the
# only placement the adapter runs there) its permuted and received rows are
# unscaled where moeverify's dispatch and ep_dispatch rows are scaled, so
# those rows are not written; the scaled rows the experts take are
# ep_permute's (run() takes them at linear_fc1's inputs).
SEAMS_EP = [
    Seam("router", "call", {"router_logits.logits": None}, method="gating", grad={"router_bwd.grad_logits": None}),
    Seam("router", "out", {"_probs": 0, "_routing_map": 1}, grad={"_probs_grad": 0}),
    Seam("token_dispatcher", "call", {"dispatch.score_sorted": 1}, method="dispatch_preprocess"),
    Seam("token_dispatcher", "call", {"ep_permute.expert_counts_real": 1}, method="dispatch_postprocess"),
    Seam("experts", "out", {"experts.expert_output": 0}, grad={"ep_unpermute_bwd.grad_unpadded": 0}),
    Seam("token_dispatcher", "call", {"ep_unpermute.recv_out": None}, method="combine_preprocess",
         grad={"ep_combine_bwd.grad_recv_out": None}),
    Seam("token_dispatcher", "call", {"ep_combine.routed_output": None}, method="token_combine",
         grad={"combine_bwd.grad_routed_output": None}),
]

NEEDS = {
    "sp": (1,), "layers": (1,),
    # apply_router_token_dropping pads with real tokens of probability 0,
    # moeverify's pad_to_capacity with zero rows of token -1 (docs/contract.md §11)
    "capacity.pad_to_capacity": ("off",),
    "experts.kind": ("swiglu",), "shared_experts.kind": ("none", "swiglu"),
    # MoELayer.postprocess: output + shared_expert_output, after the unpermute
    "shared_experts.order": ("add_after",),
    "router.hot_expert": (-1,), "router.force_load_balance": ("off",),
    # its conventions as the adapter configures it (cases/profiles/megatron-0.16*.yaml)
    "router.gate_dtype": ("fp32",), "router.score_dtype": ("fp32",), "experts.rounding": ("torchtitan",), "experts.compute_dtype": ("act",),
    "align": (1,), "empty_groups": ("zero",), "score_multiply": ("fp32",), "experts.w13_fused": ("on",),
    "combine.accumulate": ("fp32_accumulate",),
    # its permute's backward sums a token's K row gradients in fp32, rounding once
    "grad_accumulate": ("as_combine", "fp32_accumulate"),
}


def probs_on_input(c):
    """Whether the case asks for Megatron's moe_apply_probs_on_input (the
    score multiplied into each expert's input rows, K = 1) rather than its
    default per_token_scale (into the SwiGLU hidden)."""
    return c["score_before_experts"] == "on"


def capacity_on(c):
    return float(c.get("capacity.factor", 0)) > 0


class _DroppingSeam:
    """The router's own seam before its capacity: wraps the router module's
    apply_router_token_dropping, recording the probabilities and routing map
    it is given (the top-k before any drop), and returns what the original
    returns (the kept ones). Restored on exit."""

    def __enter__(self):
        import megatron.core.transformer.moe.router as router_mod
        self.mod, self.orig, self.before = router_mod, router_mod.apply_router_token_dropping, []

        def recorded(probs, routing_map, *args, **kwargs):
            self.before.append((probs.detach().clone(), routing_map.detach().clone()))
            return self.orig(probs, routing_map, *args, **kwargs)

        router_mod.apply_router_token_dropping = recorded
        return self

    def __exit__(self, *exc):
        self.mod.apply_router_token_dropping = self.orig
        return False


def refuse_unsupported(c, without_effect=()):
    refuse_keys(c, NEEDS, "the adapter", without_effect)
    refuse_other_world(c, "megatron")
    R = c.get("ep", 1)
    if R > 1 and not probs_on_input(c):
        # per_token_scale: the probabilities travel through the all-to-all
        # beside the unscaled rows and scale the hidden at the experts; the
        # contract's score_on_hidden takes each expert row's score from its
        # own dispatch row (EP 1): scores through the EP exchange have no key
        raise Unsupported("ep: %d with the score on the hidden (per_token_scale): its probabilities cross the "
                          "all-to-all beside the rows, which score_on_hidden (EP 1) does not model; EP runs under "
                          "moe_apply_probs_on_input (score_before_experts)" % R)
    if probs_on_input(c) and capacity_on(c):
        raise Unsupported("capacity with moe_apply_probs_on_input: the scaled rows are taken at the experts' "
                          "inputs, which the adapter maps to the dispatch, not the capacity stage")
    if probs_on_input(c):
        # moe_apply_probs_on_input: (probs * x).to(x.dtype) before the experts,
        # per_token_scale then ones: score_before_experts, K = 1 (its assert),
        # with autograd's backward (cases/profiles/megatron-0.16-probs-on-input.yaml)
        if c["shape.top_k"] != 1:
            raise Unsupported("score_before_experts with top_k %d: Megatron applies the probabilities to the "
                              "input (moe_apply_probs_on_input) only with K = 1" % c["shape.top_k"])
    else:
        refuse_keys(c, {"score_on_hidden": ("on",)}, "the adapter (per_token_scale)")
    if c.get("dispatch.dtype", "act") != "act":
        raise Unsupported("dispatch.dtype: FP8 dispatch is not run by this adapter")
    K, G, L = c["shape.top_k"], c["router.groups"], c["router.limited_groups"]
    norm = c["router.route_norm"] == "on"
    if c["router.score"] == "sigmoid" and norm != (K > 1):
        raise Unsupported("sigmoid with route_norm %s: Megatron normalises sigmoid scores exactly when "
                          "K > 1" % ("on and K = 1" if norm else "off and K > 1"))
    if c["router.score"] == "softmax" and norm and K == 1:
        raise Unsupported("softmax, K = 1, route_norm on: Megatron requires moe_router_pre_softmax when K = 1")
    if c["router.score"] == "softmax" and norm and G > 1:
        raise Unsupported("router.groups with softmax after the top-k (route_norm on): Megatron ranks the "
                          "groups by summed logits there, moeverify by summed scores")
    if c["router.bias"] == "on" and c["router.score"] != "sigmoid":
        raise Unsupported("router.bias with softmax: Megatron adds the expert bias in its sigmoid path only")
    if G > 1 and K != 2 * L:
        raise Unsupported("router.groups: Megatron scores a group by its top K / limited_groups experts, "
                          "moeverify by its top 2 (equal when K = 2 * limited_groups)")


_initialised = False


class _NoStream:
    """The all-to-all dispatcher's CUDA stream, its events and its stream
    context on the CPU: synchronisation points with nothing to wait for."""

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    def __hash__(self):
        return 0


def _cpu_shims():
    """The shims of the docstring, none touching a value."""
    import contextlib

    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as td
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.current_device = lambda: "cpu"  # the router's weight "moves" to the CPU
    # MoEAlltoAllTokenDispatcher: a CUDA stream at construction, stream syncs
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    moved = td.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        # on a GPU the split sizes come back as numpy arrays, which
        # all_to_all_single takes; a CPU tensor would stay a tensor, which it refuses
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return moved(tensor, as_numpy=as_numpy, record_stream=record_stream)

    td.maybe_move_tensor_to_cpu = to_host


def _init_process_group():
    global _initialised
    if _initialised:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    _cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    _initialised = True


def build(c, act):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    E, D, F, K = c["shape.experts"], c["shape.hidden"], c["shape.ffn"], c["shape.top_k"]
    G, R = c["router.groups"], world()[1]
    scale = float(c["router.route_scale"])
    cfg = TransformerConfig(
        num_layers=1, hidden_size=D, ffn_hidden_size=F, moe_ffn_hidden_size=F, num_attention_heads=1,
        num_moe_experts=E, moe_router_topk=K, moe_token_dispatcher_type="alltoall" if R > 1 else "allgather",
        expert_model_parallel_size=R,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, bf16=act == torch.bfloat16, params_dtype=act,
        use_cpu_initialization=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32", moe_router_score_function=c["router.score"],
        moe_router_pre_softmax=c["router.route_norm"] == "off",
        moe_router_num_groups=G if G > 1 else None,
        moe_router_group_topk=c["router.limited_groups"] if G > 1 else None,
        moe_router_topk_scaling_factor=scale if scale != 1.0 else None,
        moe_router_enable_expert_bias=c["router.bias"] == "on",
        moe_apply_probs_on_input=probs_on_input(c),
        # router-level dropping (apply_router_token_dropping, docs/contract.md §11)
        moe_expert_capacity_factor=float(c["capacity.factor"]) if capacity_on(c) else None,
        moe_token_drop_policy=c.get("capacity.policy", "probs"),
        moe_pad_expert_input_to_capacity=False,
        # its SharedExpertMLP (ungated), as wide as the routed experts (input.shared_w1: (F, D))
        moe_shared_expert_intermediate_size=F if c["shared_experts.kind"] == "swiglu" else None)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    return build_module(spec, config=cfg)


def load(moe, g, rank):
    """This rank's inputs into the module: its local experts are experts
    [rank E_l, (rank + 1) E_l) of the case's weights, as EP shards them."""
    def put(param, value):
        with torch.no_grad():
            param.copy_(value.to(param.dtype).reshape(param.shape))

    def inp(name):
        return g.input(name, rank=rank, as_torch=True)

    put(moe.router.weight, inp("wg"))
    w1, w3, w2 = (inp(n) for n in ("w1", "w3", "w2"))
    e0 = rank * len(moe.experts.local_experts)
    for e, expert in enumerate(moe.experts.local_experts):
        # gate half first: silu(x[0]) * x[1]
        put(expert.linear_fc1.weight, torch.cat([w1[e0 + e], w3[e0 + e]], dim=0))
        put(expert.linear_fc2.weight, w2[e0 + e])
    if moe.shared_experts is not None:
        put(moe.shared_experts.linear_fc1.weight, torch.cat([inp("shared_w1"), inp("shared_w3")], dim=0))
        put(moe.shared_experts.linear_fc2.weight, inp("shared_w2"))
    if moe.router.expert_bias is not None:
        moe.router.expert_bias.copy_(inp("bias"))


def run(g):
    c = g.case
    refuse_unsupported(c, g.keys_without_effect)
    if c["dtype"] not in ("fp32", "bf16"):
        raise Unsupported("dtype %s: the adapter runs fp32 and bf16" % c["dtype"])
    rank, R = world()
    g.clear_actual(rank=rank)
    _init_process_group()
    act = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = build(c, act)
    load(moe, g, rank)
    x = g.input("x", rank=rank, as_torch=True).to(act)
    T, D = x.shape
    every = [T]
    if R > 1:  # the ranks agree before any enters a collective
        import torch.distributed as dist
        every = [None] * R
        dist.all_gather_object(every, T)
    if min(every) == 0:
        # A framework bug, not a skip of convenience (docs/frameworks.md):
        # RouterGatingLinearFunction.forward views its output as
        # (*input.shape[:-1], -1), which an empty output cannot take.
        raise Unsupported("megatron-core 0.16.1 bug: a rank of 0 tokens raises in the router's gating "
                          "(output.view(*shape[:-1], -1) of an empty tensor)")
    backward = c.get("backward", "off") == "on"
    on_input = probs_on_input(c)
    seams = list(SEAMS if R == 1 else SEAMS_EP)
    E_l = len(moe.experts.local_experts)
    for e in range(E_l):
        fc1 = "experts.local_experts.%d.linear_fc1" % e
        seams.append(Seam(fc1, "out", {"_fc1": 0}))
        seams.append(Seam(fc1, "in", {"_fc1_in_%d" % e: 0}, grad={"_fc1_in_grad_%d" % e: 0}))
        seams.append(Seam("experts.local_experts.%d.linear_fc2" % e, "in", {"_fc2_in": 0}))
    if moe.shared_experts is not None:
        # SharedExpertMLP: the same MLP without per_token_scale; x feeds it and
        # the router's permute, so its input gradient is its share of x.grad
        seams += [Seam("shared_experts", "out", {"shared_experts.shared_out": None}),
                  Seam("shared_experts", "grad_in", {"shared_experts_bwd.grad_x_shared": 0}),
                  Seam("shared_experts.linear_fc1", "out", {"shared_experts.shared_h13": 0}),
                  Seam("shared_experts.linear_fc2", "in", {"shared_experts.shared_hidden": 0})]
    router_x = []
    if backward:
        # moeverify's grad_x is the token path's (docs/contract.md §13): the
        # router reads a leaf copy of x, whose gradient is the router's share
        # (router_bwd.grad_x_router); its weights keep theirs
        def own_x(m, args):
            router_x.append(args[0].detach().requires_grad_(True))
            return (router_x[-1],) + tuple(args[1:])
        moe.router.register_forward_pre_hook(own_x)
        x.requires_grad_(True)
    moe.train(backward)
    with torch.set_grad_enabled(backward), Capture(moe, seams, backward=backward) as cap, _DroppingSeam() as drop:
        out = moe(x.view(T, 1, D))
        out = (out[0] if isinstance(out, tuple) else out).reshape(T, D)
        if backward:
            out.backward(g.input("grad_out", rank=rank, as_torch=True).to(act))
    # the dense (T, E) probabilities and routing map, as the (T, K) layout of
    # the manifest: each token's experts in ascending id, their probabilities;
    # with a capacity, the router's top-k before apply_router_token_dropping
    routing_map, probs = cap.scratch["_routing_map"][-1], cap.scratch["_probs"][-1]
    if capacity_on(c):
        probs, routing_map = drop.before[-1]
    ids = routing_map.nonzero()[:, 1].view(T, c["shape.top_k"])
    cap.values["routing.ids"] = ids
    cap.values["routing.topk_scores"] = probs.gather(1, ids)
    # with a capacity the permute moves the kept rows only: they are the
    # capacity stage's (docs/contract.md §11), the dispatch's never exist
    rows = "capacity" if capacity_on(c) else "dispatch"
    if capacity_on(c):
        for n in ("routed_input", "score_sorted"):
            cap.values["capacity." + n] = cap.values.pop("dispatch." + n)
        cap.values["capacity.counts"] = cap.values.pop("routing.counts")
        # the router's per-expert counts before any drop: its routing map's columns
        cap.values["routing.counts"] = routing_map.sum(dim=0)
    if on_input:  # the rows (probs * x).to(x.dtype) the experts take, expert-major: with EP 1 the
        # dispatch's, with EP the permute's (its permute's rows are unscaled: SequentialMLP scales them)
        cap.values["dispatch.routed_input" if R == 1 else "ep_permute.permuted"] = torch.cat(
            [cap.scratch["_fc1_in_%d" % e][-1] for e in range(E_l)])
    if R > 1:
        # the all-to-all's metadata: rows this rank sends to / receives from
        # each rank, and received rows per (source rank, local expert)
        td = moe.token_dispatcher
        cap.values["routing.counts"] = routing_map.sum(dim=0)
        cap.values["ep_dispatch.input_splits"] = torch.as_tensor(td.input_splits)
        cap.values["ep_dispatch.output_splits"] = torch.as_tensor(td.output_splits)
        cap.values["ep_dispatch.recv_counts"] = (td.num_global_tokens_per_local_expert.reshape(R, E_l) if E_l > 1
                                                 else torch.as_tensor(td.output_splits).reshape(R, 1))
    if backward:
        # the gradient of the dense (T, E) probabilities at each token's ids:
        # the dispatch's under moe_apply_probs_on_input (score_before_experts),
        # the experts' under per_token_scale (score_on_hidden, docs/contract.md §13)
        grad_probs = cap.scratch["_probs_grad"][-1].gather(1, ids)
        cap.values["dispatch_bwd.grad_topk_scores" if on_input else "experts_bwd.grad_topk_scores"] = grad_probs
        cap.values["dispatch_bwd.grad_x"] = x.grad.detach().clone()
        # the router's backward (docs/contract.md §13, router): its gating
        # GEMM's gradients, each cast back to its input's dtype by Megatron
        cap.values["router_bwd.grad_x_router"] = router_x[-1].grad.reshape(T, D)
        cap.values["router_bwd.grad_wg"] = moe.router.weight.grad
        cap.values["experts_bwd.grad_expert_input"] = torch.cat(
            [cap.scratch["_fc1_in_grad_%d" % e][-1] for e in range(E_l)])
        F = c["shape.ffn"]
        fc1 = [ex.linear_fc1.weight.grad for ex in moe.experts.local_experts]
        cap.values["experts_bwd.grad_w1"] = torch.stack([w[:F] for w in fc1])
        cap.values["experts_bwd.grad_w3"] = torch.stack([w[F:] for w in fc1])
        cap.values["experts_bwd.grad_w2"] = torch.stack([ex.linear_fc2.weight.grad for ex in moe.experts.local_experts])
        if moe.shared_experts is not None:
            fc1 = moe.shared_experts.linear_fc1.weight.grad
            cap.values["shared_experts_bwd.grad_shared_w1"] = fc1[:F]
            cap.values["shared_experts_bwd.grad_shared_w3"] = fc1[F:]
            cap.values["shared_experts_bwd.grad_shared_w2"] = moe.shared_experts.linear_fc2.weight.grad
    cap.values[rows + ".token_sorted"] = moe.token_dispatcher.reversed_local_input_permutation_mapping
    cap.values["experts.expert_h13"] = torch.cat(cap.scratch["_fc1"])
    # linear_fc2's operand is H scaled by the row's probability (per_token_scale)
    cap.values["experts.expert_hidden"] = torch.cat(cap.scratch["_fc2_in"])
    # MoELayer returns (output, bias); with one rank its reduce-scatter is the
    # identity, so the output is the unpermute's scatter-add
    cap.values["combine.out"] = out.detach()
    cap.write(g, rank=rank)


def main(argv=None):
    return main_for(run, argv)


if __name__ == "__main__":
    sys.exit(main())
