"""Adapters that run an installed framework's own MoE code on exported case
folders and write what it computes under moeverify's stage names
(docs/frameworks.md): `python -m moeverify.frameworks.torchtitan CASE_DIR`,
`python -m moeverify.frameworks.megatron CASE_DIR`, or either with --serve as
a `moeverify fuzz --impl ... --worker`."""


def refuse_keys(case, needs, who, without_effect=()):
    """Raises moeverify.Unsupported (exit 77, a skip) naming the first key of
    `needs` ({key: valid values}) whose value in `case` the framework cannot
    express, e.g. "ep: 2; torchtitan's MoE runs 1". Keys in `without_effect`
    (the manifest's keys_without_effect) change nothing in the case: never
    refused (capacity.pad_to_capacity without a capacity)."""
    from ..impl import Unsupported
    for key, valid in needs.items():
        if key in case and case[key] not in valid and key not in without_effect:
            raise Unsupported("%s: %r; %s runs %s" % (key, case[key], who, " or ".join(map(str, valid))))


def world():
    """(rank, size) of the torchrun world this process is in; (0, 1) alone."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def refuse_other_world(case, module):
    """Raises moeverify.Unsupported unless the case's ep is the world's size:
    one process per EP rank. The message names the torchrun line that runs
    it (tests/frameworks_cases.sh reads "ep: N; this adapter runs as")."""
    from ..impl import Unsupported
    R, size = case.get("ep", 1), world()[1]
    if R != size:
        raise Unsupported("ep: %d; this adapter runs as %d process(es), one per EP rank (run it as "
                          "`torchrun --nproc-per-node %d -m moeverify.frameworks.%s`)" % (R, size, R, module))


def main_for(run, argv=None):
    """The adapter's command line (moeverify.main: CASE_DIR... or --serve),
    torch limited to MOEVERIFY_TORCH_THREADS threads (default 1: fuzz --jobs
    runs one worker per core). Under torchrun (WORLD_SIZE > 1: one process
    per EP rank) the gloo world is initialised and main_distributed serves."""
    import datetime
    import os

    import torch

    from ..impl import main
    torch.set_num_threads(int(os.environ.get("MOEVERIFY_TORCH_THREADS", "1")))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return main(run, argv)
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        return main_distributed(run, argv)
    finally:
        dist.destroy_process_group()


def main_distributed(run, argv=None):
    """The same command line when torchrun started one process per EP rank:
    every rank runs `run` on each folder (writing its own rank's tensors),
    the ranks' answers are gathered, and rank 0 speaks for all: the first
    error, else the first skip, else done. With --serve rank 0 alone reads
    stdin and passes each folder on; every rank's prints go to stderr, so
    that rank 0's answers stay the only lines on stdout. (torchrun itself
    turns a skip's exit 77 into 1: with fuzz --impl use --serve and
    --worker, whose answers say skip.)"""
    import sys

    import torch.distributed as dist

    from ..impl import _call, main
    rank, size = dist.get_rank(), dist.get_world_size()

    def agreed(fn, folder):
        every = [None] * size
        dist.all_gather_object(every, _call(fn, folder))
        for r, a in enumerate(every):
            if a.startswith("error"):
                return "error rank %d: %s" % (r, a[6:])
        return next((a for a in every if a.startswith("skip")), "done")

    def folders():  # rank 0's stdin, line by line, on every rank
        while True:
            box = [sys.stdin.readline() or None] if rank == 0 else [None]  # None: stdin closed
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            yield box[0]

    return main(run, argv, call=agreed, stdin=folders(), speak=rank == 0)
