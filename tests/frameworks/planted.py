"""A framework adapter with a bug planted into the framework at run time
(issue 33): `python planted.py FRAMEWORK BUG --serve` patches the installed
framework's own code, then serves as moeverify.frameworks.FRAMEWORK does.
The fuzz must find each bug and shrink it to a few tokens at its stage.

Bugs (megatron):
  unstable_sort  moe_utils.permute as the dispatcher calls it returns each
                 expert's tokens in descending order
  act_probs      MLP.forward's per_token_scale rounded to the activation dtype
                 before it scales the hidden (fp32 probabilities expected)
  source_major   EP > 1: the received rows are left rank-major, the sort of
                 their chunks into local-expert-major order skipped (and its
                 inverse before the combine's all-to-all)
  gating_grad_bf16  the router's gating backward rounds its incoming
                 gradient to bf16 before its two fp32 GEMMs (the fp32 router,
                 moe_router_dtype, kept in the forward only)

Bugs (torchtitan):
  unstable_sort  the dispatch's argsort of the expert ids puts a group's
                 tokens in descending order (a sort that is not stable)
  per_add_combine  the combine's scatter_add rounds after every row added
                 (bf16), instead of summing a token's rows in fp32
  source_major   EP > 1: the received rows are left rank-major, the permute
                 to local-expert-major order skipped (the experts then read
                 each other's rows wherever two ranks sent rows)
  norm_detached  the router's route_norm denominator is detached: the same
                 forward, but no gradient through the sum (a fused router
                 backward that forgets it)
"""
import sys
import types

fw, bug = sys.argv[1], sys.argv[2]
del sys.argv[1:3]

import torch  # noqa: E402


def unstable_argsort(x, dim=-1, descending=False, stable=False):
    # equal keys come out in descending index order
    n = x.numel()
    key = x.reshape(-1).long() * n + (n - 1 - torch.arange(n))
    return torch.argsort(key, stable=True)


def per_add_scatter_add(out, index, src):
    if src.shape[0] == 0:  # no rows: out as it is, still in src's autograd graph
        return out.index_add(0, index[:, 0].long(), src)
    out = out.clone()
    for i in range(src.shape[0]):
        t = int(index[i, 0])
        out[t] = out[t] + src[i]  # one rounding per row in the output's dtype
    return out


if fw == "torchtitan":
    import torchtitan.models.common.token_dispatcher as td
    if bug == "unstable_sort":
        proxy = types.ModuleType("torch_with_unstable_argsort")
        proxy.__getattr__ = lambda name: getattr(torch, name)
        proxy.argsort = unstable_argsort
        td.torch = proxy
    elif bug == "per_add_combine":
        td.deterministic_scatter_add = per_add_scatter_add
    elif bug == "source_major":
        real = td.AllToAllTokenDispatcher._permute

        def rank_major(self, routed_input_RD, counts_E):
            shape, permuted, indices, counts_e = real(self, routed_input_RD, counts_E)
            keep = torch.arange(routed_input_RD.shape[0])
            return shape, routed_input_RD[keep, :], keep, counts_e

        td.AllToAllTokenDispatcher._permute = rank_major
    elif bug == "norm_detached":
        import torchtitan.models.common.moe as tm
        real_router = tm.TokenChoiceTopKRouter.forward

        def detached_norm(self, x, expert_bias=None):
            # the real router without its norm and scale, then the same ops
            # (the same bits) with the denominator outside the graph
            norm, scale = self.route_norm, self.route_scale
            self.route_norm, self.route_scale = False, 1.0
            try:
                top, ids, scores = real_router(self, x, expert_bias)
            finally:
                self.route_norm, self.route_scale = norm, scale
            if norm:
                top = top / (top.sum(dim=-1, keepdim=True) + 1e-20).detach()
            return top * scale, ids, scores

        tm.TokenChoiceTopKRouter.forward = detached_norm
    else:
        sys.exit("planted.py: no bug %r for torchtitan" % bug)
    from moeverify.frameworks import torchtitan as adapter
elif fw == "megatron":
    import megatron.core.transformer.moe.token_dispatcher as mtd
    real_permute = mtd.permute

    def descending_permute(tokens, routing_map, *args, **kwargs):
        permuted, probs, sorted_indices = real_permute(tokens, routing_map, *args, **kwargs)
        counts = routing_map.sum(dim=0).tolist()
        parts = [seg.flip(0) for seg in torch.split(sorted_indices, counts)]
        order = torch.cat(parts) if parts else sorted_indices
        return tokens.index_select(0, order), probs, order

    if bug == "unstable_sort":
        mtd.permute = descending_permute
    elif bug == "act_probs":
        import megatron.core.transformer.mlp as mlp
        real_forward = mlp.MLP.forward

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                per_token_scale = per_token_scale.to(hidden_states.dtype)
            return real_forward(self, hidden_states, per_token_scale, **kwargs)

        mlp.MLP.forward = forward
    elif bug == "source_major":
        def unsorted(input, split_sizes, sorted_idxs, probs=None, fused=False):
            return input, probs

        mtd.sort_chunks_by_idxs = unsorted
    elif bug == "gating_grad_bf16":
        import megatron.core.transformer.moe.moe_utils as mu
        real_backward = mu.RouterGatingLinearFunction.backward

        def bf16_backward(ctx, grad_output):
            return real_backward(ctx, grad_output.to(torch.bfloat16).to(grad_output.dtype))

        mu.RouterGatingLinearFunction.backward = staticmethod(bf16_backward)
    else:
        sys.exit("planted.py: no bug %r for megatron" % bug)
    from moeverify.frameworks import megatron as adapter
else:
    sys.exit("planted.py: no framework %r" % fw)

sys.exit(adapter.main())
