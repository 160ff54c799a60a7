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


def main_for(run, argv=None):
    """The adapter's command line (moeverify.main: CASE_DIR... or --serve),
    torch limited to MOEVERIFY_TORCH_THREADS threads (default 1: fuzz --jobs
    runs one worker per core)."""
    import os

    import torch

    from ..impl import main
    torch.set_num_threads(int(os.environ.get("MOEVERIFY_TORCH_THREADS", "1")))
    return main(run, argv)
