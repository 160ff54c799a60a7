#!/usr/bin/env python3
"""A torchtitan-style expert-parallel dispatcher under torch.distributed, run
on an exported EP case: one process per EP rank, a real all_to_all_single
each way (docs/frameworks.md §3), each rank writing its own files for
`moeverify check`.

    torchrun --nproc-per-node R examples/torch_ep.py GOLDEN_CASE_DIR [--bug NAME]

R must be the case's `ep`. The backend is gloo (CPU), so it runs anywhere
torch does; the steps are the ones a GPU run takes with NCCL:
  1. local dispatch: stable argsort of the flat ids, index_select of x;
  2. tokens per expert exchanged with all_to_all_single, the split sizes
     derived from them, then the rows exchanged with all_to_all_single;
  3. received rows (source rank, then local expert) permuted expert-major
     (local expert, then source rank), as generate_permute_indices does;
  4. the experts' outputs (the exported align_unpad.unpadded: expert-major,
     no padding) unpermuted and sent back with the reverse splits;
  5. combine: score multiply in fp32, rounded to the activation dtype, then
     scatter_add into zeros.
Written under GOLDEN_CASE_DIR/actual/: dispatch.{routed_input,token_sorted,
score_sorted}, ep_dispatch.{input_splits,output_splits,recv_counts,recv},
ep_permute.{permuted,expert_counts_real}, ep_unpermute.recv_out,
ep_combine.routed_output, combine.out.

--bug no_permute plants a mistake so that a test sees `check` catch it: the
received rows go to the experts in received (source-major) order, the
permute left out (INCORRECT at ep_permute).

Exits 77 (skipped, never passed) when torch or its gloo backend is missing.
"""
import os
import sys

try:
    import torch
    import torch.distributed as dist
except ImportError as e:
    print("torch_ep.py: skipped:", e)
    sys.exit(77)
try:
    import moeverify
except ImportError:  # not installed: the package beside this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import moeverify


def all_to_all(rows, send_sizes, recv_sizes):
    out = rows.new_empty((sum(recv_sizes),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    return out


def expert_major(recv_counts):
    """Indices that reorder received rows (source rank s, then local expert j)
    into local expert j, then source rank s; recv_counts is (R, E_l)."""
    R, El = recv_counts.shape
    starts = torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)
    parts = [torch.arange(int(starts[s * El + j]), int(starts[s * El + j] + recv_counts[s, j]))
             for j in range(El) for s in range(R)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def main():
    args = sys.argv[1:]
    bug = None
    if "--bug" in args:
        i = args.index("--bug")
        bug = args[i + 1] if i + 1 < len(args) else ""
        del args[i:i + 2]
        if bug != "no_permute":
            sys.exit("torch_ep.py: --bug %r; valid: no_permute" % bug)
    if len(args) != 1:
        sys.exit(__doc__)
    if not dist.is_available() or not dist.is_gloo_available():
        print("torch_ep.py: skipped: torch.distributed with gloo is not available")
        sys.exit(77)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = moeverify.open(args[0])
    case = g.case
    if g.ranks != world:
        sys.exit("torch_ep.py: the case has ep %d; run it with torchrun --nproc-per-node %d" % (g.ranks, g.ranks))
    if case["shared_experts.kind"] != "none" or case["score_before_experts"] != "off" or case["align"] != 1 \
            or case.get("score_on_hidden", "off") != "off" \
            or case["capacity.factor"] != 0 or case["equal_split.policy"] != "off":
        sys.exit("torch_ep.py: plain EP path only (no shared experts, scores after the experts, align 1, "
                 "no capacity, no equal split)")
    torch.set_num_threads(1)
    E = case["shape.experts"]
    El = E // world

    # 1. local dispatch
    x = g.input("x", rank=rank, as_torch=True)
    ids = g.expected("routing.ids", rank=rank, as_torch=True).long()
    top_scores = g.expected("routing.topk_scores", rank=rank, as_torch=True)
    K = ids.shape[1]
    order = torch.argsort(ids.view(-1), stable=True)
    score_sorted = top_scores.view(-1)[order]
    token_sorted = order // K
    routed_input = torch.index_select(x, 0, token_sorted)

    # 2. counts, then rows, through all_to_all_single
    tokens_per_expert = torch.bincount(ids.view(-1), minlength=E)
    recv_counts = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(recv_counts, tokens_per_expert)
    input_splits = tokens_per_expert.view(world, El).sum(dim=1).tolist()
    output_splits = recv_counts.view(world, El).sum(dim=1).tolist()
    recv = all_to_all(routed_input, input_splits, output_splits)

    # 3. expert-major permute
    perm = expert_major(recv_counts.view(world, El))
    if bug == "no_permute":
        perm = torch.arange(recv.shape[0])
    permuted = recv[perm]

    # 4. the experts' outputs back: unpermute, reverse all_to_all
    expert_out = g.expected("align_unpad.unpadded", rank=rank, as_torch=True)
    recv_out = torch.empty_like(expert_out)
    recv_out[perm] = expert_out
    routed_output = all_to_all(recv_out, output_splits, input_splits)

    # 5. combine (torchtitan: score after the experts, then scatter_add)
    y = (routed_output.to(torch.float32) * score_sorted.reshape(-1, 1)).to(x.dtype)
    out = torch.zeros_like(x).scatter_add(0, token_sorted.reshape(-1, 1).expand(-1, x.shape[1]), y)

    for name, t in [("dispatch.routed_input", routed_input), ("dispatch.token_sorted", token_sorted),
                    ("dispatch.score_sorted", score_sorted),
                    ("ep_dispatch.input_splits", torch.tensor(input_splits)),
                    ("ep_dispatch.output_splits", torch.tensor(output_splits)),
                    ("ep_dispatch.recv_counts", recv_counts), ("ep_dispatch.recv", recv),
                    ("ep_permute.permuted", permuted),
                    ("ep_permute.expert_counts_real", recv_counts.view(world, El).sum(dim=0)),
                    ("ep_unpermute.recv_out", recv_out), ("ep_combine.routed_output", routed_output),
                    ("combine.out", out)]:
        g.write(name, t, rank=rank)
    dist.barrier()
    if rank == 0:
        print("torch_ep.py: torch %s, %d ranks (gloo): wrote %s" % (torch.__version__, world, g.actual_dir))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
