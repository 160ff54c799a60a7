"""`python -m moeverify.worker FILE:FUNCTION`: the worker `moeverify.fuzz(fn)`
starts once per job. It loads FUNCTION from FILE (torch and the rest imported
once) and serves case folders from stdin (moeverify.serve), or with
`--case DIR` runs it on one folder (exit 77 when unsupported)."""
import sys

from .golden import GoldenError
from .impl import load_function, main, serve


def _run(argv):
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--case"):
        print("usage: python -m moeverify.worker FILE:FUNCTION [--case DIR]", file=sys.stderr)
        return 2
    try:
        fn = load_function(argv[0])
    except GoldenError as e:
        print("moeverify.worker: %s" % e, file=sys.stderr)
        return 2
    if len(argv) == 3:
        return main(fn, [argv[2]])
    serve(fn)
    return 0


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
