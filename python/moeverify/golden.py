"""A golden folder written by `moeverify export` (format moeverify-golden/2,
docs/contract.md §15): its manifest, its inputs and expected outputs, and the
implementation's outputs written under actual/ for `moeverify check`.

Names. Every tensor has a stage and a name; `name` may be given alone where
one stage has it, or as "stage.name" (e.g. "capacity.counts" beside
"routing.counts"). Layer entries 2 and up (`layers: L` cases) are addressed
with layer=L; an input a later entry shares with entry 1 is read from entry 1.
"""
import builtins
import difflib
import json
import os
import re
import tempfile

import numpy as np

from . import codec

FORMAT = "moeverify-golden/2"
_LAYER = re.compile(r"^layer(\d+)/")


class GoldenError(ValueError):
    """A golden folder, a name or an array that moeverify check would refuse."""


# actual/ folder (real path) -> (the pytest test, {file: (inode, mtime_ns,
# size)} of the expected entries' files there) when Golden.check last judged
# it in this process.
_judged = {}
# actual/ folder (real path) -> the files Golden.write wrote there since its
# last check (written, whatever their stat says).
_written = {}


def _current_test():
    """The pytest test running now ("tests/test_moe.py::test_a[case]"), or ""
    outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _snapshot(golden):
    """The expected entries' files under golden's actual/ with what tells a
    rewritten one from the same one (a write through this package is a new
    inode; np.save over it a new mtime)."""
    snap = {}
    for e in golden.entries:
        if e.role != "expected":
            continue
        try:
            st = os.stat(os.path.join(golden.actual_dir, e.file), follow_symlinks=False)
        except OSError:
            continue
        snap[e.file] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return snap


def _plain_name(name, where):
    """A manifest's file name, accepted only as `check` accepts it: a plain
    name inside the case folder (no separator, not . or .., not absolute)."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise GoldenError("%s: field 'file' is %r; valid: a plain file name inside the case folder (no separator, "
                          "no '..', not absolute), as `moeverify export` writes it" % (where, name[:200]))
    return name


class Entry:
    """One manifest row: a (stage, name, rank, layer) tensor and its file."""

    __slots__ = ("name", "stage", "role", "rank", "layer", "file", "dtype", "shape", "layout")

    def __init__(self, row, where="manifest.json"):
        if not isinstance(row, dict):
            raise GoldenError("%s: expected an object with name, stage, role, rank, file, dtype and shape, got %s"
                              % (where, type(row).__name__))
        for field, kinds, valid in (("name", str, "a tensor name"), ("stage", str, "a stage name"),
                                    ("role", str, "input or expected"), ("rank", int, "a rank, 0..R-1"),
                                    ("file", str, "a plain file name inside the case folder"),
                                    ("dtype", str, "a dtype such as bfloat16"), ("shape", list, "a list of sizes")):
            if field not in row or not isinstance(row[field], kinds) or isinstance(row[field], bool):
                raise GoldenError("%s: field %r is %s; valid: %s" % (
                    where, field, "missing" if field not in row else repr(row[field])[:80], valid))
        if row["role"] not in ("input", "expected"):
            raise GoldenError("%s: field 'role' is %r; valid: input or expected" % (where, row["role"]))
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in row["shape"]):
            raise GoldenError("%s: field 'shape' is %r; valid: a list of non-negative integers" % (where, row["shape"]))
        self.file = _plain_name(row["file"], where)
        self.name = row["name"]
        self.stage = row["stage"]
        self.role = row["role"]
        self.rank = row["rank"]
        self.dtype = row["dtype"]
        self.shape = tuple(row["shape"])
        self.layout = row.get("layout", "")
        m = _LAYER.match(self.stage)  # "layerL/stage" for entries L >= 2
        self.layer = int(m.group(1)) if m else 1
        if m:
            self.stage = self.stage[m.end():]

    @property
    def qualified(self):
        return self.stage + "." + self.name

    def __repr__(self):
        return "Entry(%s, rank=%d, layer=%d, %s %s, %r)" % (
            self.qualified, self.rank, self.layer, self.dtype, list(self.shape), self.layout)


class Golden:
    """One case folder. `ranks`, `layers`, `case` (the case keys), `name`."""

    def __init__(self, path, actual=None):
        self.path = os.path.abspath(path)
        mpath = os.path.join(self.path, "manifest.json")
        try:
            with builtins.open(mpath) as f:
                man = json.load(f)
        except OSError as e:
            raise GoldenError("%s: no manifest (%s); valid: a case folder written by `moeverify export`"
                              % (self.path, e.strerror)) from None
        except ValueError as e:
            raise GoldenError("%s: not JSON (%s)" % (mpath, e)) from None
        if not isinstance(man, dict):
            raise GoldenError("%s: a JSON %s; valid: the object `moeverify export` writes" % (mpath, type(man).__name__))
        fmt = man.get("format")
        if fmt != FORMAT:
            raise GoldenError("%s: format %r; this package reads %s: export the case again with this "
                              "moeverify" % (mpath, fmt, FORMAT))
        self.manifest = man
        for field, kinds in (("case", dict), ("ranks", int), ("tensors", list)):
            if not isinstance(man.get(field), kinds) or isinstance(man.get(field), bool):
                raise GoldenError("%s: field %r is %s; valid: %s, as `moeverify export` writes it" % (
                    mpath, field, "missing" if field not in man else repr(man[field])[:80],
                    {"case": "an object of case keys", "ranks": "an integer", "tensors": "a list"}[field]))
        if not isinstance(man.get("layers", 1), int) or man.get("layers", 1) < 1:
            raise GoldenError("%s: field 'layers' is %r; valid: an integer >= 1" % (mpath, man.get("layers")))
        self.case = man["case"]
        # case keys that change nothing in this case -> why (older folders: none)
        self.keys_without_effect = man.get("keys_without_effect", {})
        self.name = self.case.get("name", os.path.basename(self.path))
        self.ranks = man["ranks"]
        self.layers = man.get("layers", 1)
        self.entries = [Entry(t, "%s: tensors[%d]" % (mpath, i)) for i, t in enumerate(man["tensors"])]
        self.actual_dir = os.path.abspath(actual) if actual else os.path.join(self.path, "actual")
        if os.path.realpath(self.actual_dir) == os.path.realpath(self.path):
            # write() would replace the expected files that check compares with
            raise GoldenError("actual=%s is the case folder itself; valid: another folder (default %s)"
                              % (actual, os.path.join(self.path, "actual")))
        self._by_key = {(e.role, e.stage, e.name, e.rank, e.layer): e for e in self.entries}

    def __repr__(self):
        return "Golden(%r, ranks=%d, layers=%d)" % (self.name, self.ranks, self.layers)

    # ---- lookup ---------------------------------------------------------

    def stages(self):
        """The stages with expected outputs, in manifest order."""
        seen = []
        for e in self.entries:
            if e.role == "expected" and e.stage not in seen:
                seen.append(e.stage)
        return seen

    def outputs(self, stage=None, rank=0, layer=1):
        """Expected entries of one rank and layer, of one stage or all."""
        return [e for e in self.entries if e.role == "expected" and e.rank == rank and e.layer == layer
                and (stage is None or e.stage == stage)]

    def entry(self, name, role="expected", rank=0, stage=None, layer=1):
        """The manifest entry `name` ("name" or "stage.name") of `role`."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.ranks:
            raise GoldenError("%s: rank %r; valid: 0..%d (an integer)" % (self.name, rank, self.ranks - 1))
        if not 1 <= layer <= self.layers:
            raise GoldenError("%s: layer %d; valid: 1..%d" % (self.name, layer, self.layers))
        if stage is None and "." in name:
            stage, name = name.split(".", 1)
        pool = [e for e in self.entries if e.role == role and e.name == name
                and (stage is None or e.stage == stage)]
        if not pool:
            valid = sorted({e.qualified for e in self.entries if e.role == role})
            bare = sorted({e.name for e in self.entries if e.role == role})
            close = difflib.get_close_matches(name, bare, n=3, cutoff=0.6)
            near = [v for c in close for v in valid if v.endswith("." + c)]
            raise GoldenError("%s: no %s tensor %r%s; nearest: %s" % (
                self.name, role, name, " in stage " + stage if stage else "",
                ", ".join(near) if near else "(none); valid: " + ", ".join(valid)))
        stages = sorted({e.stage for e in pool})
        if len(stages) > 1:
            raise GoldenError("%s: %r is a tensor of stages %s: say which, e.g. %r" % (
                self.name, name, ", ".join(stages), stages[0] + "." + name))
        st = stages[0]
        for L in range(layer, 0, -1):  # a later entry's input may be entry 1's
            e = self._by_key.get((role, st, name, rank, L))
            if e is not None:
                return e
            if role != "input":
                break
        raise GoldenError("%s: %s.%s has no rank %d, layer %d entry" % (self.name, st, name, rank, layer))

    # ---- reading --------------------------------------------------------

    def input(self, name, rank=0, layer=1, as_torch=False, raw=False):
        """An input of the case (x, wg, bias, w13, ...) for `rank`."""
        return self._read(self.entry(name, "input", rank, None, layer), as_torch, raw)

    def expected(self, name, rank=0, stage=None, layer=1, as_torch=False, raw=False):
        """The reference's output `name` of a stage for `rank`."""
        return self._read(self.entry(name, "expected", rank, stage, layer), as_torch, raw)

    def _read(self, e, as_torch, raw):
        a = np.load(os.path.join(self.path, e.file), allow_pickle=False)
        if as_torch:
            return _to_torch(a, e.dtype)
        return a if raw else codec.decode(a, e.dtype)

    # ---- writing --------------------------------------------------------

    def write(self, name, array, rank=0, stage=None, layer=1):
        """Writes the implementation's `name` for `rank` under actual/, named and
        encoded as `moeverify check` reads it. `array`: NumPy or torch (a
        bf16 or fp16 tensor of the entry's type as it is, of the other half
        type converted where every value is held exactly, else refused;
        float32 values are rounded once). The row count
        may differ from the expected one (check judges it INCORRECT at its
        stage); the other dimensions may not. Returns the path written."""
        e = self.entry(name, "expected", rank, stage, layer)
        what = "%s %s rank %d" % (self.name, e.qualified, rank)
        try:
            a = codec.encode(_from_torch(array), e.dtype, what)
        except (TypeError, ValueError) as err:  # every refusal of an array is a GoldenError
            raise GoldenError(str(err)) from err
        if a.ndim != len(e.shape) or tuple(a.shape[1:]) != e.shape[1:]:
            raise GoldenError("%s: shape %s; valid: %s with any number of rows, layout %s" % (
                what, list(a.shape), ["rows"] + list(e.shape[1:]), e.layout))
        if os.path.islink(self.actual_dir):
            raise GoldenError("%s: a symbolic link; this package does not write through one (moeverify check "
                              "reads it); valid: a real folder, or open(path, actual=THE_TARGET)" % self.actual_dir)
        os.makedirs(self.actual_dir, exist_ok=True)
        dest = os.path.join(self.actual_dir, e.file)
        # A new file of a name no one else has (O_EXCL: nothing planted there is
        # followed), renamed over the final name once complete.
        fd, tmp = tempfile.mkstemp(dir=self.actual_dir, prefix="." + e.file + ".", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(a), allow_pickle=False)
            os.replace(tmp, dest)
            _written.setdefault(os.path.realpath(self.actual_dir), set()).add(e.file)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return dest


    def clear_actual(self, rank=None):
        """Removes the files under actual/ that an earlier run wrote for this
        folder's expected entries (of `rank`, or every rank), so that a tensor
        this run does not write is reported missing instead of judged on a
        stale value. Nothing else under actual/ is touched. Returns how many
        files it removed."""
        if not os.path.isdir(self.actual_dir) or os.path.islink(self.actual_dir):
            return 0
        removed = 0
        for e in self.entries:
            if e.role != "expected" or (rank is not None and e.rank != rank):
                continue
            f = os.path.join(self.actual_dir, e.file)
            if os.path.isfile(f) and not os.path.islink(f):
                os.remove(f)
                removed += 1
        return removed

    # ---- judging ----------------------------------------------------------

    def check(self, strict_ties=False, raise_on_failure=True, stale_ok=False):
        """`moeverify check` on this folder and its actual outputs: the Verdict;
        AssertionError with the failing rows unless it PASSED.

        Under pytest, a test that wrote some outputs beside others that
        another test's check() judged and nothing wrote since is judged on
        that test's leftovers (one case list parametrizing two tests, the
        second writing less): this raises AssertionError naming them, unless
        stale_ok. Call clear_actual() before writing. Checking outputs no
        test rewrote (one fixture's outputs judged by several tests),
        within one test a rewrite and a second check, and anything outside
        pytest are as intended."""
        from .impl import check
        key, test = os.path.realpath(self.actual_dir), _current_test()
        now = _snapshot(self)
        by, before = _judged.get(key, ("", {}))
        written = _written.get(key, set())
        stale = sorted(f for f, st in now.items() if before.get(f) == st and f not in written)
        if not (test and by and by != test) or len(stale) == len(now):
            stale = []  # outside pytest, within one test, or nothing written since: as intended
        if stale and not stale_ok:
            raise AssertionError(
                "%s: %d of the %d output file(s) under %s were judged in test %s and not written since (%s%s): its "
                "outputs, left in a folder the two tests share; call golden.clear_actual() before writing (or "
                "check(stale_ok=True))" % (self.name, len(stale), len(now), self.actual_dir, by,
                                           ", ".join(stale[:3]), ", ..." if len(stale) > 3 else ""))
        default = self.actual_dir == os.path.join(self.path, "actual")
        # nothing written to the default folder: check's own NOT_VERIFIED
        # ("the implementation wrote no outputs"), not an error about --actual
        try:
            return check(self.path, actual=None if default else self.actual_dir, strict_ties=strict_ties,
                         raise_on_failure=raise_on_failure)
        finally:
            _judged[key] = (test, _snapshot(self))
            _written.pop(key, None)


def open(path, actual=None):  # noqa: A001 (the package's verb, as in moeverify.open)
    """One case folder written by `moeverify export`."""
    return Golden(path, actual)


def open_all(root):
    """Every case folder under `root` (or `root` itself if it is one), by name."""
    root = os.fspath(root)
    if os.path.isfile(os.path.join(root, "manifest.json")):
        return [Golden(root)]
    if not os.path.isdir(root):
        raise GoldenError("%s: no such folder; valid: the folder given to `moeverify export`" % root)
    found = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "manifest.json")))
    if not found:
        raise GoldenError("%s: no case folder (no */manifest.json); valid: the folder given to "
                          "`moeverify export`" % root)
    return [Golden(os.path.join(root, d)) for d in found]


def _torch():
    try:
        import torch
    except ImportError as e:
        raise GoldenError("as_torch=True needs torch: %s" % e) from None
    return torch


def _to_torch(a, dtype):
    torch = _torch()
    if dtype in codec.HALF:  # the bit patterns reinterpreted, not converted
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy())
        return t.view(torch.bfloat16 if dtype == "bfloat16" else torch.float16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def _from_torch(x):
    """torch tensors to NumPy; bf16/fp16 as their bit patterns, tagged with
    their type (codec.HalfBits: a tensor of the other half type is converted
    only where exact)."""
    if type(x).__module__.split(".")[0] != "torch":
        return x
    torch = _torch()
    x = x.detach().cpu().contiguous()
    if x.dtype in (torch.bfloat16, torch.float16):
        return codec.HalfBits(x.view(torch.int16).numpy().view(np.uint16),
                              "bfloat16" if x.dtype == torch.bfloat16 else "float16")
    return x.numpy()
