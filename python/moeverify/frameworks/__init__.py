"""Adapters that run an installed framework's own MoE code on exported case
folders and write what it computes under moeverify's stage names
(docs/frameworks.md): `python -m moeverify.frameworks.torchtitan CASE_DIR`,
`python -m moeverify.frameworks.megatron CASE_DIR`, or either with --serve as
a `moeverify fuzz --impl ... --worker`."""


def refuse_keys(case, needs, who):
    """Raises moeverify.Unsupported (exit 77, a skip) naming the first key of
    `needs` ({key: valid values}) whose value in `case` the framework cannot
    express, e.g. "ep: 2; torchtitan's MoE runs 1"."""
    from ..impl import Unsupported
    for key, valid in needs.items():
        if key in case and case[key] not in valid:
            raise Unsupported("%s: %r; %s runs %s" % (key, case[key], who, " or ".join(map(str, valid))))


def main_for(run, argv=None, distributed=False):
    """The adapter's command line (moeverify.main: CASE_DIR... or --serve),
    torch limited to MOEVERIFY_TORCH_THREADS threads (default 1: fuzz --jobs
    runs one worker per core). With `distributed` (one process per EP rank,
    the torch.distributed world initialised): main_distributed."""
    import os

    import torch

    from ..impl import main
    torch.set_num_threads(int(os.environ.get("MOEVERIFY_TORCH_THREADS", "1")))
    return main_distributed(run, argv) if distributed else main(run, argv)


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
