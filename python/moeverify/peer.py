"""PyTorch's own way of doing each MoE stage, timed on the same shapes:
the peer of `moeverify bench --peer` (docs/guide.md, "Benchmarks").

    python3 -m moeverify.peer SPEC.json        # prints one JSON object

SPEC (written by bench) gives the case's shape: tokens (all ranks together),
hidden, ffn, experts, top_k, groups, limited_groups, score (sigmoid or
softmax), bias, route_norm, route_scale, dtype, expert_kind, repeat, device
("cuda" or "cpu"). Each stage is what a PyTorch MoE layer (torchtitan's
token-choice router and its index-based dispatch) does, on random data of
that shape: the routing decisions are the peer's own (random logits), not
the case's, so the rows move in another order but in the same amounts.

- routing: scores (sigmoid or softmax), + bias, the group limit (top-2
  sum per group, topk over groups, masked_fill), torch.topk, gather,
  normalisation, scale, and torch.bincount for the per-expert counts;
- dispatch: a stable torch.argsort of the flat expert ids and index_select
  of the token rows (and the scores) into expert order;
- combine: zeros, then index_add_ of the rows times their scores into their
  tokens (scatter-add; atomics on a GPU);
- experts (SwiGLU cases, on a GPU): torch._grouped_mm where this torch and device
  have it, else a loop of per-expert matmuls, W13 fused, then W2.

Each is timed as the best of `repeat` calls after one warm-up (CUDA events
on a GPU, perf_counter on the CPU). Output: {"torch": version, "device":
name, "stages": {slot: {"seconds": s, "what": text}}}.
"""

import json
import sys
import time


def _timer(torch, device):
    if device == "cuda":
        def run(fn, repeat):
            fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(max(1, repeat)):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                best = min(best, a.elapsed_time(b) * 1e-3)
            return best
    else:
        def run(fn, repeat):
            fn()
            best = float("inf")
            for _ in range(max(1, repeat)):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            return best
    return run


def main(argv):
    if len(argv) != 1:
        print("usage: python3 -m moeverify.peer SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    import torch

    device = spec.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("moeverify.peer: the spec asks for cuda and this torch has no usable CUDA device", file=sys.stderr)
        return 77
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    T, D, E, K = int(spec["tokens"]), int(spec["hidden"]), int(spec["experts"]), int(spec["top_k"])
    G, LG = int(spec.get("groups", 1)), int(spec.get("limited_groups", 1))
    repeat = int(spec.get("repeat", 3))
    timed = _timer(torch, device)
    gen = torch.Generator(device=device).manual_seed(20261127)
    logits = torch.randn(T, E, device=device, generator=gen)
    bias = torch.randn(E, device=device, generator=gen) * 0.01 if spec.get("bias") else torch.zeros(E, device=device)
    x = torch.randn(T, D, device=device, generator=gen).to(dt)
    stages = {}

    def route():
        s = torch.sigmoid(logits) if spec.get("score") == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = s + bias
        if G > 1:
            gs = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
            keep = gs.topk(LG, dim=-1, sorted=False)[1]
            mask = torch.ones(T, G, dtype=torch.bool, device=device).scatter_(1, keep, False)
            choice = choice.masked_fill(mask.repeat_interleave(E // G, dim=1), float("-inf"))
        ids = choice.topk(K, dim=-1)[1]
        ts = s.gather(1, ids)
        if spec.get("route_norm"):
            ts = ts / (ts.sum(dim=-1, keepdim=True) + 1e-20)
        ts = ts * float(spec.get("route_scale", 1.0))
        counts = torch.bincount(ids.flatten(), minlength=E)
        return ids, ts, counts

    stages["routing"] = {"seconds": timed(route, repeat),
                         "what": "scores, bias, group limit, torch.topk, gather, normalise, scale, bincount"}
    ids, ts, counts = route()

    def dispatch():
        perm = torch.argsort(ids.flatten(), stable=True)
        return x.index_select(0, perm // K), ts.flatten().index_select(0, perm), perm

    stages["dispatch"] = {"seconds": timed(dispatch, repeat),
                          "what": "stable torch.argsort of the expert ids, index_select of the rows and scores"}
    routed, score_sorted, perm = dispatch()
    token = perm // K

    def combine():
        out = torch.zeros(T, D, dtype=dt, device=device)
        return out.index_add_(0, token, routed * score_sorted.to(dt)[:, None])

    stages["combine"] = {"seconds": timed(combine, repeat),
                         "what": "index_add_ (scatter-add) of the rows times their scores into zeros"}

    # PyTorch's CPU bf16 matmuls are too slow to peer at bench sizes (a
    # 4096-token, E 64, D 512 SwiGLU layer took 22 s), so the experts are
    # peered on a GPU only.
    if spec.get("expert_kind") == "swiglu" and device == "cuda":
        F = int(spec["ffn"])
        w13 = (torch.randn(E, D, 2 * F, device=device, generator=gen) * D ** -0.5).to(dt)
        w2 = (torch.randn(E, F, D, device=device, generator=gen) * F ** -0.5).to(dt)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        grouped = hasattr(torch, "_grouped_mm") and device == "cuda"
        if grouped:
            try:
                torch._grouped_mm(routed, w13, offs=offs)
            except RuntimeError:
                grouped = False
        if grouped:
            def experts():
                h = torch._grouped_mm(routed, w13, offs=offs)
                h = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
                return torch._grouped_mm(h, w2, offs=offs)
            what = "torch._grouped_mm (W13 fused), silu * up, torch._grouped_mm (W2)"
        else:
            bounds = [0] + torch.cumsum(counts, 0).tolist()

            def experts():
                out = torch.empty(routed.shape[0], D, dtype=dt, device=device)
                for e in range(E):
                    a, b = bounds[e], bounds[e + 1]
                    if a == b:
                        continue
                    h = routed[a:b] @ w13[e]
                    out[a:b] = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2[e]
                return out
            what = "a loop of per-expert matmuls (W13 fused, silu * up, W2)"
        stages["experts"] = {"seconds": timed(experts, repeat), "what": what}

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "device": name, "stages": stages}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
