"""pytest support: one test per exported case folder.

    import moeverify.testing

    @pytest.mark.parametrize("golden", moeverify.testing.cases("cases/ep4.yaml", profile="torchtitan"))
    def test_my_moe(golden):
        golden.clear_actual() # another test's outputs in this folder would be judged as yours
        my_moe(golden)        # writes golden/<case>/actual/*.npy
        golden.check()        # AssertionError naming the failing stages

`cases` takes a case file (exported once, into a temporary folder removed at
exit) or a folder `moeverify export` wrote. With pytest importable each case
is a pytest.param named after the case; without it, a list of Golden.
"""
import atexit
import os
import shutil
import tempfile

from .golden import open_all
from .impl import export


def cases(source, profile=None, only=()):
    """The case folders of `source` for pytest.mark.parametrize (see above).
    `profile` and `only` (case names or patterns) apply when source is a
    case file."""
    source = os.fspath(source)
    if os.path.isfile(source):
        root = tempfile.mkdtemp(prefix="moeverify-cases-")
        atexit.register(shutil.rmtree, root, True)
        export(source, root, profile=profile, cases=only)
    else:
        root = source
    goldens = open_all(root)
    try:
        import pytest
    except ImportError:
        return goldens
    return [pytest.param(g, id=g.name) for g in goldens]
