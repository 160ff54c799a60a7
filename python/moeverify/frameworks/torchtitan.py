"""torchtitan's MoE, as installed, on exported case folders.

    python -m moeverify.frameworks.torchtitan CASE_DIR...
    moeverify fuzz --impl "python -m moeverify.frameworks.torchtitan --serve" --worker \\
        --profile cases/profiles/torchtitan-0.3.yaml

Builds torchtitan's own `MoE` module (TokenChoiceTopKRouter, RoutedExperts
with LocalTokenDispatcher and GroupedExperts, the FeedForward shared
expert) from the case's shapes and options, loads the case's inputs into
its parameters and buffers, runs its forward (and, for a backward case,
autograd's backward from the case's grad_out), and writes the tensors its
code produced at its own seams (moeverify.torch.Capture; the table of
seams is SEAMS below, and docs/frameworks.md lists it). Nothing is
recomputed here: every value written is one that torchtitan's code made.

The module's parameters hold the case's weights as mixed-precision training
holds them: the router gate and the shared expert in the activation dtype
(FSDP's param_dtype), the routed experts in fp32 (GroupedExperts casts them
with .bfloat16() itself, so their gradients arrive in fp32).

Configurations torchtitan cannot express raise Unsupported (exit 77, a
skip): see NEEDS below and docs/frameworks.md "What each framework runs".

Expert parallelism runs as real processes, one per EP rank, as torchtitan
runs it: under `torchrun --nproc-per-node R` (gloo on the CPU), each process
builds the MoE with torchtitan's AllToAllTokenDispatcher wired to a
one-dimensional "ep" DeviceMesh and its GroupedExperts holding its E/R local
experts, and writes its own rank's tensors. A case runs when its `ep` is the
world's size (else a skip naming the torchrun line that runs it):

    torchrun --nproc-per-node 2 -m moeverify.frameworks.torchtitan CASE_DIR...
    moeverify fuzz --impl "torchrun --nproc-per-node 2 -m moeverify.frameworks.torchtitan --serve" \
        --worker --profile PROFILE   # a copy of torchtitan-0.3.yaml allowing ep: [2] only

With --serve, rank 0 reads the folders and answers for every rank.
"""
import sys

try:
    import torch
except ImportError as e:  # an honest skip: nothing ran
    print("moeverify.frameworks.torchtitan: skipped: %s" % e, file=sys.stderr)
    sys.exit(77)

from ..impl import Unsupported
from ..torch import Capture, Seam
from . import main_for, refuse_keys, refuse_other_world, world


# torchtitan's seams -> moeverify stage names (docs/frameworks.md). EP = 1:
# the expert-parallel stages between dispatch and the experts are identities
# there and torchtitan has no tensor for them, so they are not written.
SEAMS = [
    # the router's backward (docs/contract.md §13, router): the gradients of
    # its logits and of its dense scores (the gather's included)
    Seam("router.gate", "out", {"router_logits.logits": None}, grad={"router_bwd.grad_logits": None}),
    Seam("router", "out", {"routing.topk_scores": 0, "routing.ids": 1, "routing.scores": 2},
         grad={"combine_bwd.grad_topk_scores": 0, "router_bwd.grad_scores": 2}),
    Seam("routed_experts", "in", {"routing.counts": 3}),
    Seam("routed_experts.token_dispatcher", "call",
         {"dispatch.routed_input": 0,
          "dispatch.token_sorted": lambda r: r[2].token_indices_experts_sorted_N,
          "dispatch.score_sorted": lambda r: r[2].topk_scores_experts_sorted_N},
         grad={"ep_dispatch_bwd.grad_routed_input": 0}, method="dispatch"),
    Seam("routed_experts.inner_experts", "out",
         {"experts.expert_output": None, "ep_combine.routed_output": None},
         grad={"combine_bwd.grad_routed_output": None}),
    Seam("routed_experts.inner_experts", "in", {}, grad={"experts_bwd.grad_expert_input": 0}),
    # GroupedExperts makes three grouped GEMMs per call: h1 = X W1^T (before
    # the silu), h3 = X W3^T, then Y = H W2^T, whose operand A is H.
    Seam("routed_experts.inner_experts", "call", {"_gemm_out": None}, method="_grouped_mm"),
    Seam("routed_experts.inner_experts", "call_in", {"_gemm_a": "A"}, method="_grouped_mm"),
    # x feeds the routed experts and the shared expert: the shared one's share
    # of its gradient (dispatch_bwd.grad_x is x.grad, both shares summed by
    # autograd)
    Seam("shared_experts", "grad_in", {"shared_experts_bwd.grad_x_shared": 0}),
    Seam("shared_experts", "out", {"shared_experts.shared_out": None}),
    Seam("shared_experts.w1", "out", {"_shared_h1": None}),
    Seam("shared_experts.w3", "out", {"_shared_h3": None}),
    Seam("shared_experts.w2", "in", {"shared_experts.shared_hidden": 0}),
]

PARAM_GRADS = {
    "router_bwd.grad_wg": "router.gate.weight",
    "experts_bwd.grad_w1": "routed_experts.inner_experts.w1_EFD",
    "experts_bwd.grad_w3": "routed_experts.inner_experts.w3_EFD",
    "experts_bwd.grad_w2": "routed_experts.inner_experts.w2_EDF",
    "shared_experts_bwd.grad_shared_w1": "shared_experts.w1.weight",
    "shared_experts_bwd.grad_shared_w3": "shared_experts.w3.weight",
    "shared_experts_bwd.grad_shared_w2": "shared_experts.w2.weight",
}

# EP > 1: torchtitan's AllToAllTokenDispatcher methods are the seams of the
# expert-parallel stages (docs/frameworks.md). dispatch() there returns the
# rows permuted to local-expert-major order, so the dispatch stage is taken
# at its local reorder instead.
EP_SEAMS = [
    Seam("routed_experts.token_dispatcher", "call",
         {"dispatch.routed_input": 0, "dispatch.token_sorted": 1, "dispatch.score_sorted": 2},
         grad={"ep_dispatch_bwd.grad_routed_input": 0}, method="_local_reorder"),
    Seam("routed_experts.token_dispatcher", "call",
         {"ep_dispatch.recv_counts": 0,
          "ep_dispatch.input_splits": lambda r: torch.tensor(r[1], dtype=torch.int64),
          "ep_dispatch.output_splits": lambda r: torch.tensor(r[2], dtype=torch.int64)},
         method="_sync_token_count_exchange"),
    Seam("routed_experts.token_dispatcher", "call", {"ep_dispatch.recv": None},
         grad={"ep_permute_bwd.grad_recv": None}, method="_dispatch_token_exchange"),
    Seam("routed_experts.token_dispatcher", "call",
         {"ep_permute.permuted": 1, "ep_permute.expert_counts_real": 3}, method="_permute"),
    Seam("routed_experts.inner_experts", "out", {"experts.expert_output": None},
         grad={"ep_unpermute_bwd.grad_unpadded": None}),
    Seam("routed_experts.token_dispatcher", "call", {"ep_unpermute.recv_out": None},
         grad={"ep_combine_bwd.grad_recv_out": None}, method="_unpermute"),
    Seam("routed_experts.token_dispatcher", "call", {"ep_combine.routed_output": None},
         grad={"combine_bwd.grad_routed_output": None}, method="_combine_token_exchange"),
]

# Keys whose value torchtitan's MoE cannot express, with the values it can.
NEEDS = {
    "sp": (1,),
    "layers": (1,),
    "capacity.factor": (0.0,),
    "score_before_experts": ("off",),
    "score_on_hidden": ("off",),  # GroupedExperts takes no score
    "combine.placement": ("out_of_place",),
    "combine.buffer": ("fresh",),
    "equal_split.policy": ("off",),
    "router.hot_expert": (-1,),
    "experts.kind": ("swiglu",),
    "shared_experts.kind": ("none", "swiglu"),
    "shared_experts.order": ("add_after",),
    # its conventions (docs/contract.md §14; cases/profiles/torchtitan-0.3.yaml
    # sets them): a case asking for another one asks for other arithmetic
    "router.gate_dtype": ("act",),
    "router.score_dtype": ("act",),
    "score_multiply": ("fp32",),
    "experts.rounding": ("torchtitan",),
    "experts.compute_dtype": ("bf16",),
    "experts.w13_fused": ("off",),
    "combine.accumulate": ("fp32_accumulate",),
    "grad_accumulate": ("per_add",),
    "align": (1,),
    "empty_groups": ("zero",),
}


def refuse_unsupported(c, without_effect=()):
    refuse_keys(c, NEEDS, "torchtitan's MoE", without_effect)
    refuse_other_world(c, "torchtitan")
    if c.get("dispatch.dtype", "act") != "act":
        raise Unsupported("dispatch.dtype: FP8 dispatch is not torchtitan's")
    if c["dtype"] not in ("fp32", "bf16"):
        raise Unsupported("dtype %s: GroupedExperts computes in bf16 and returns the input's dtype; "
                          "fp16 is not a torchtitan training dtype" % c["dtype"])
    D, F = c["shape.hidden"], c["shape.ffn"]
    if D % 8 or F % 8:
        raise Unsupported("hidden or ffn not a multiple of 8: torch._grouped_mm needs rows of a multiple "
                          "of 16 bytes")
    if c["router.groups"] > 1 and c["shape.experts"] // c["router.groups"] < 2:
        raise Unsupported("router.groups: torchtitan needs at least 2 experts per group")


_MESH = []  # the "ep" DeviceMesh of the torchrun world, made once


def ep_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (world()[1],), mesh_dim_names=("ep",)))
    return _MESH[0]


def build(c, act):
    """torchtitan's MoE for case c, its parameters in the dtypes training uses;
    with EP R > 1, this rank's share: the all-to-all dispatcher on the "ep"
    mesh and E/R local experts."""
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

    E, D, F, K = c["shape.experts"], c["shape.hidden"], c["shape.ffn"], c["shape.top_k"]
    R = c.get("ep", 1)
    dispatcher = (AllToAllTokenDispatcher if R > 1 else LocalTokenDispatcher).Config(num_experts=E, top_k=K)
    G = c["router.groups"]
    shared = None
    if c["shared_experts.kind"] == "swiglu":
        Fs = F  # the shared expert has the routed experts' ffn width (input.shared_w1: (1, F, D))
        shared = FeedForward.Config(w1=Linear.Config(in_features=D, out_features=Fs),
                                    w2=Linear.Config(in_features=Fs, out_features=D),
                                    w3=Linear.Config(in_features=D, out_features=Fs))
    cfg = MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E // R),
            token_dispatcher=dispatcher),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
            num_expert_groups=G if G > 1 else None,
            num_limited_groups=c["router.limited_groups"] if G > 1 else None,
            top_k=K, score_func=c["router.score"], route_norm=c["router.route_norm"] == "on",
            route_scale=float(c["router.route_scale"]),
            _debug_force_load_balance=c["router.force_load_balance"] == "on"),
        load_balance_coeff=1e-3 if c["router.bias"] == "on" else None,
        shared_experts=shared)
    with torch.device("cpu"):
        moe = cfg.build()
    moe.router.gate.to(act)
    if moe.shared_experts is not None:
        moe.shared_experts.to(act)
    if R > 1:
        # torchtitan's trainer picks the SPMD backend from
        # parallelism.spmd_backend; "partial_dtensor" (DTensor on the model
        # parallel axes only) runs the dispatcher's all_to_all_single over the
        # "ep" mesh's process group, which needs no global SPMD mesh.
        from torchtitan.distributed.utils import set_spmd_backend
        set_spmd_backend("partial_dtensor")
        moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=ep_mesh())
    return moe


def load(moe, g, rank, R):
    """This rank's inputs into the module: weights (its E/R local experts'),
    the selection bias."""
    def put(param, value):
        with torch.no_grad():
            param.copy_(value.to(param.dtype).reshape(param.shape))

    def local(name):  # experts [rank E_l, (rank + 1) E_l) of (E, ...)
        w = g.input(name, rank=rank, as_torch=True)
        E_l = w.shape[0] // R
        return w[rank * E_l:(rank + 1) * E_l]

    put(moe.router.gate.weight, g.input("wg", rank=rank, as_torch=True))
    ex = moe.routed_experts.inner_experts
    put(ex.w1_EFD, local("w1"))
    put(ex.w3_EFD, local("w3"))
    put(ex.w2_EDF, local("w2"))
    if moe.expert_bias_E is not None:
        moe.expert_bias_E.copy_(g.input("bias", rank=rank, as_torch=True))
    if moe.shared_experts is not None:
        put(moe.shared_experts.w1.weight, g.input("shared_w1", rank=rank, as_torch=True))
        put(moe.shared_experts.w3.weight, g.input("shared_w3", rank=rank, as_torch=True))
        put(moe.shared_experts.w2.weight, g.input("shared_w2", rank=rank, as_torch=True))


def seams(c):
    """The table of seams, plus the stages that depend on the case."""
    shared = c["shared_experts.kind"] == "swiglu"
    table = [s for s in SEAMS if shared or not s.path.startswith("shared_experts")]
    if c.get("ep", 1) > 1:  # the dispatcher's own EP seams replace the local dispatch and expert rows
        table = [s for s in table if not (s.kind in ("call", "out") and
                                          (s.method == "dispatch" or "experts.expert_output" in s.take))]
        table += EP_SEAMS
    if shared:
        # torchtitan's combine returns the routed sum; MoE.forward adds shared(x)
        table.append(Seam("", "out", {"combine.out": None}))
    else:
        table.append(Seam("routed_experts.token_dispatcher", "call", {"combine.out": None}, method="combine"))
    return table


def tokens_2d(moe):
    """Whether this torchtitan's MoE takes tokens as (T, D) (its source on
    the main branch, x_TD) rather than (B, L, D) (0.3.0, x_BLD)."""
    import inspect
    first = next(iter(inspect.signature(moe.forward).parameters))
    return first.endswith("_TD")


def run(g):
    """fn(golden) for moeverify.main / fuzz --impl: one case folder."""
    c = g.case
    refuse_unsupported(c, g.keys_without_effect)
    rank, R = world()
    g.clear_actual(rank=rank)
    act = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32
    torch.manual_seed(0)
    moe = build(c, act)
    load(moe, g, rank, R)
    backward = c.get("backward", "off") == "on"
    moe.train(backward)
    x = g.input("x", rank=rank, as_torch=True).to(act)
    T, D = x.shape
    if backward:
        x.requires_grad_(True)
    grads = {k: v for k, v in PARAM_GRADS.items() if moe.shared_experts is not None or "shared" not in k}
    # On the CPU, autocast refuses float32, so in a bf16 case torchtitan's
    # router computes its logits, scores, normalisation and scale in bf16:
    # router.gate_dtype and router.score_dtype act (docs/contract.md §14),
    # which the profile sets and refuse_unsupported requires.
    router_x = []
    if backward:
        # moeverify's grad_x is the token path's (docs/contract.md §13): the
        # router's own input gradient (through the gate, into x) is not part
        # of it, so the router reads a leaf copy of x, whose gradient is the
        # router's share (router_bwd.grad_x_router); its weights keep theirs.
        def own_x(m, args):
            router_x.append(args[0].detach().requires_grad_(True))
            return (router_x[-1],) + tuple(args[1:])
        moe.router.register_forward_pre_hook(own_x)
    with Capture(moe, seams(c), grads, backward=backward) as cap:
        out = moe(x if tokens_2d(moe) else x.view(1, T, D)).view(T, D)
        if backward:
            out.backward(g.input("grad_out", rank=rank, as_torch=True).to(act))
    if backward:
        cap.values["dispatch_bwd.grad_x"] = x.grad.detach().clone()
        cap.values["router_bwd.grad_x_router"] = router_x[-1].grad.detach().clone().reshape(T, D)
    gemm_out, gemm_a = cap.scratch.get("_gemm_out", []), cap.scratch.get("_gemm_a", [])
    if len(gemm_out) == 3:
        cap.values["experts.expert_h13"] = torch.cat([gemm_out[0], gemm_out[1]], dim=1)
        cap.values["experts.expert_hidden"] = gemm_a[2]
    if "_shared_h1" in cap.scratch:
        cap.values["shared_experts.shared_h13"] = torch.cat(
            [cap.scratch["_shared_h1"][-1], cap.scratch["_shared_h3"][-1]], dim=-1)
    cap.write(g, rank=rank)


def main(argv=None):
    return main_for(run, argv)


if __name__ == "__main__":
    sys.exit(main())
