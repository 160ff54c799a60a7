"""Your implementation under moeverify: judge it (`check`), fuzz it (`fuzz`),
and run it as `moeverify fuzz --impl` expects (`main`, `serve`).

An implementation is a function fn(golden) that reads a case folder's inputs
and writes its outputs with golden.write(...) (docs/guide.md "Fuzz your own
implementation"). It raises Unsupported for a configuration it does not
implement: that configuration is then skipped and counted, never passed.

    def my_moe(g):
        if g.case["capacity.factor"] != 0:
            raise moeverify.Unsupported("no capacity")
        ...

    if __name__ == "__main__":
        moeverify.main(my_moe)    # my_moe.py CASE_DIR..., or my_moe.py --serve

    moeverify fuzz --impl "python3 my_moe.py {case}"           # a process per configuration
    moeverify fuzz --impl "python3 my_moe.py --serve" --worker  # one process per job (torch imported once)
"""
import builtins
import functools
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import traceback
import unittest

from .golden import GoldenError, open as open_golden

EXIT_UNSUPPORTED = 77  # the exit status `fuzz --impl` counts as "skipped"


class Unsupported(unittest.SkipTest):
    """Raised by an implementation for a configuration it does not support:
    main() exits 77, serve() answers "skip", fuzz() counts it skipped. It is a
    unittest.SkipTest, so a pytest or unittest test that raises it (its
    implementation refusing a case of moeverify.testing.cases) is reported
    skipped with the reason, not failed."""


# ---- the binary -----------------------------------------------------------

def binary():
    """The moeverify executable: $MOEVERIFY_BIN, else `moeverify` on the PATH,
    else this source tree's build/moeverify."""
    env = os.environ.get("MOEVERIFY_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise GoldenError("MOEVERIFY_BIN=%s: not an executable file; valid: the path of moeverify" % env)
        return env
    found = shutil.which("moeverify")
    if found:
        return found
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "..", "..", "build", "moeverify"),       # source tree
                 os.path.join(here, "..", "..", "..", "bin", "moeverify")):  # share/moeverify/python
        if os.access(cand, os.X_OK):
            return os.path.normpath(cand)
    raise GoldenError("moeverify: not found; valid: set MOEVERIFY_BIN, put moeverify on the PATH "
                      "(cmake --install build), or build it in this source tree (build/moeverify)")


# ---- check ----------------------------------------------------------------

class Verdict:
    """What `moeverify check` said of one golden folder (or a folder of them).

    outcome: "PASSED", "INCORRECT", "ERROR", "NOT_VERIFIED", ...
    rows: every check as a dict (stage, tensor, rank, outcome, class,
        mismatches, total, note, first: the first mismatches in MoE coordinates)
    failures: the rows that did not pass
    notes: per case, the report's notes (coverage: what was checked)
    report: the text report; json: the whole JSON document (docs/json-schema.md)
    """

    def __init__(self, doc, report):
        self.json = doc
        self.report = report
        self.outcome = doc["outcome"]
        self.rows = []
        self.notes = []
        for case in doc["cases"]:
            self.notes.extend(case.get("notes", []))
            for ch in case["checks"]:
                row = dict(ch)
                row["case"] = case["name"]
                self.rows.append(row)
        self.failures = [r for r in self.rows if r["outcome"] != "PASSED"]

    @property
    def passed(self):
        return self.outcome == "PASSED"

    def __bool__(self):
        return self.passed

    def __repr__(self):
        return "Verdict(%s, %d checks, %d failing)" % (self.outcome, len(self.rows), len(self.failures))

    def describe(self, limit=12):
        """The failing rows, one per line, as an AssertionError shows them."""
        lines = ["moeverify check: %s" % self.outcome]
        for r in self.failures[:limit]:
            rank = "" if r.get("rank") is None else "@%d" % r["rank"]
            first = r["first"][0] if r.get("first") else None
            yours = first and first.get("yours", first.get("fast"))  # "fast" in reports before "yours"
            where = "; first at %s: yours %s vs expected %s" % (first["at"], yours, first["ref"]) if first else ""
            # a tensor with the wrong rows compared no element: its note says so
            count = "" if not r.get("total") else " (%s of %s elements)" % (r.get("mismatches"), r["total"])
            lines.append("  %s %s/%s%s: %s%s%s%s" % (
                r["case"], r["stage"], r["tensor"], rank, r["outcome"], count,
                where, "; " + r["note"][:300] if r.get("note") else ""))
        if len(self.failures) > limit:
            lines.append("  ... %d more" % (len(self.failures) - limit))
        if self.outcome == "NOT_VERIFIED":
            lines.extend("  " + n for n in self.notes if n.startswith("coverage") or "no actual" in n)
        return "\n".join(lines)


def check(path, actual=None, strict_ties=False, raise_on_failure=True, extra_args=()):
    """Runs `moeverify check` on a golden folder (or a folder of them) and
    returns its Verdict. Unless raise_on_failure is False, anything but
    PASSED raises AssertionError with the failing rows; malformed files
    (check's exit 2) raise GoldenError."""
    path = os.fspath(path)
    with tempfile.TemporaryDirectory(prefix="moeverify-check-") as tmp:
        out = os.path.join(tmp, "check.json")
        cmd = [binary(), "check", path, "--json", out]
        if actual is not None:
            cmd += ["--actual", os.fspath(actual)]
        if strict_ties:
            cmd.append("--strict-ties")
        cmd.extend(extra_args)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not os.path.exists(out):
            raise GoldenError("moeverify check %s: exit %d: %s" % (path, p.returncode, p.stderr.strip()[-2000:]))
        with builtins.open(out) as f:
            doc = json.load(f)
    v = Verdict(doc, p.stdout)
    if p.returncode == 2:
        raise GoldenError("moeverify check %s: %s" % (path, p.stderr.strip()[-2000:]))
    if raise_on_failure and not v.passed:
        raise AssertionError(v.describe())
    return v


# ---- export ---------------------------------------------------------------

def export(case_file, out_dir, profile=None, cases=(), sets=()):
    """`moeverify export CASE_FILE OUT_DIR`: one golden folder per case; with a
    profile its fixed keys are set and the cases outside it left out.
    Returns the case folders written."""
    cmd = [binary(), "export", os.fspath(case_file), os.fspath(out_dir)]
    if profile:
        cmd += ["--profile", os.fspath(profile)]
    for c in (cases,) if isinstance(cases, str) else cases:  # one name, or several
        cmd += ["--case", c]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise GoldenError("moeverify export: exit %d: %s" % (p.returncode, p.stderr.strip()[-2000:]))
    return [line.split(" -> ", 1)[1] for line in p.stdout.splitlines() if line.startswith("exported ")]


# ---- running as `fuzz --impl` expects ---------------------------------------

def _one_line(text):
    return " ".join(str(text).split())[:300]


def _call(fn, folder):
    """Runs fn on one case folder: "done", "skip REASON" or "error REASON"
    (with the traceback on stderr where fn raised; a folder that is no case
    folder is one line: the traceback would be the package's, not fn's)."""
    try:
        golden = open_golden(folder)
    except GoldenError as e:
        return "error " + _one_line("GoldenError: %s" % e)
    try:
        fn(golden)
        return "done"
    except Unsupported as e:
        return "skip " + _one_line(str(e) or "unsupported")
    except SystemExit as e:  # sys.exit(77) inside fn means unsupported too
        if e.code == EXIT_UNSUPPORTED:
            return "skip exit 77"
        traceback.print_exc()
        return "error SystemExit(%r)" % (e.code,)
    except Exception as e:  # noqa: BLE001 (every failure of the implementation is reported)
        traceback.print_exc()
        return "error " + _one_line("%s: %s" % (type(e).__name__, e))


def serve(fn, stdin=None, call=None, speak=True):
    """The worker loop of `moeverify fuzz --impl CMD --worker`: reads one case
    folder per line from stdin, runs fn on it and answers one line on stdout
    ("done", "skip REASON" or "error REASON"; the traceback goes to stderr),
    until stdin closes. Whatever fn prints goes to stderr, so that the
    answers stay the only lines on stdout. `call(fn, folder)` gives the
    answer (default: run fn here); with speak=False nothing is answered (a
    rank other than 0 of moeverify.frameworks' torchrun worker)."""
    call = call or _call
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1) if speak else None
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    src = stdin if stdin is not None else sys.stdin
    for line in src:
        folder = line.rstrip("\r\n")
        if not folder:
            continue
        answer = call(fn, folder)
        sys.stderr.flush()
        if answers:
            answers.write(answer + "\n")
            answers.flush()


USAGE = """usage: %(prog)s CASE_DIR...    run on exported case folders (exit 77: a configuration not supported)
       %(prog)s --serve        worker for `moeverify fuzz --impl "%(prog)s --serve" --worker`"""


def main(fn, argv=None, call=None, stdin=None, speak=True):
    """A command line for fn: `prog CASE_DIR...` runs it on each folder (exit
    77 when one is Unsupported, 1 when fn raises), `prog --serve` is the
    worker `fuzz --impl ... --worker` starts. `call`, `stdin` and `speak` as
    for serve (moeverify.frameworks.main_distributed sets them)."""
    call = call or _call
    args = sys.argv[1:] if argv is None else list(argv)
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "impl"
    say = functools.partial(print, file=sys.stderr) if speak else (lambda *a, **k: None)
    if args in (["-h"], ["--help"]):
        if speak:
            print(USAGE % {"prog": prog})
        return 0
    if args == ["--serve"]:
        serve(fn, stdin, call, speak)
        return 0
    if not args or any(a.startswith("-") for a in args):
        say(USAGE % {"prog": prog})
        sys.exit(2)
    # The folder given to `moeverify export` stands for its case folders.
    folders = []
    for a in args:
        inner = [] if os.path.isfile(os.path.join(a, "manifest.json")) or not os.path.isdir(a) else sorted(
            os.path.join(a, d) for d in os.listdir(a) if os.path.isfile(os.path.join(a, d, "manifest.json")))
        folders.extend(inner or [a])
    # Every folder runs; the exit status is the worst: 1 when one raised,
    # else 77 when one was not supported (said per folder), else 0.
    failed = unsupported = False
    for folder in folders:
        answer = call(fn, folder)
        if answer.startswith("skip"):
            # (one folder, as fuzz --impl runs it: the reason alone, which
            # fuzz groups its skips by)
            say("%s: not supported: %s" % (prog, answer[5:]) + ("" if len(folders) == 1 else " (%s)" % folder))
            unsupported = True
        elif answer.startswith("error"):
            say("%s: %s: %s" % (prog, folder, answer[6:]))
            failed = True
    if failed:
        sys.exit(1)
    if unsupported:
        sys.exit(EXIT_UNSUPPORTED)
    return 0


def _worker_target(fn):
    """FILE:QUALNAME of a module-level function, for `python -m moeverify.worker`."""
    qual = getattr(fn, "__qualname__", "")
    if not qual or "<" in qual or "." in qual:
        raise GoldenError("fuzz(fn): %r is not a module-level function; valid: a function defined at the top of "
                          "a file (fuzz runs it in worker processes that load that file)" % (fn,))
    mod = sys.modules.get(fn.__module__)
    path = getattr(mod, "__file__", None)
    if not path:
        raise GoldenError("fuzz(fn): the module of %s has no file; valid: a function defined in a .py file" % qual)
    return "%s:%s" % (os.path.abspath(path), qual)


def fuzz(fn, profile=None, seconds=60, iterations=None, jobs=1, seed=None, out="fuzz-failures",
         timeout=60, raise_on_failure=True, extra_args=(), sets=None):
    """`moeverify fuzz --impl` with a Python function: random configurations
    (inside `profile`, with the case keys of `sets` fixed in each: a dict
    such as {"combine.order": "any"}, or "KEY=VALUE" strings), each exported, run through fn in worker processes
    (`python -m moeverify.worker FILE:FN`, started once per job) and judged
    as check does; failures shrunk to case files under `out`. Returns the
    JSON summary (drawn, judged, skipped, crashed, failed, stages,
    failures). Unless raise_on_failure is False, a failure, a crash, or
    nothing judged PASSED raises AssertionError."""
    target = _worker_target(fn)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    # the package's root first, once (a PYTHONPATH that holds it already keeps its order)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != pkg_root]
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + rest)
    # PYTHONPATH in the command itself, so that the repro lines of its
    # failures run as printed
    worker = "env PYTHONPATH=%s %s -m moeverify.worker %s" % (
        shlex.quote(env["PYTHONPATH"]), shlex.quote(sys.executable), shlex.quote(target))
    with tempfile.TemporaryDirectory(prefix="moeverify-fuzz-") as tmp:
        summary = os.path.join(tmp, "fuzz.json")
        cmd = [binary(), "fuzz", "--impl", worker, "--worker", "--jobs", str(jobs), "--out", os.fspath(out),
               "--impl-timeout", str(timeout), "--json", summary]
        cmd += ["--iterations", str(iterations)] if iterations is not None else ["--seconds", str(seconds)]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        if profile:
            cmd += ["--profile", os.fspath(profile)]
        for s in (["%s=%s" % kv for kv in sets.items()] if isinstance(sets, dict) else sets or ()):
            cmd += ["--set", s]
        cmd.extend(extra_args)
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not os.path.exists(summary):
            raise GoldenError("moeverify fuzz: exit %d: %s" % (p.returncode, p.stderr.strip()[-2000:]))
        with builtins.open(summary) as f:
            result = json.load(f)
    result["report"] = p.stdout
    if raise_on_failure and p.returncode != 0:
        raise AssertionError("moeverify fuzz --impl: exit %d\n%s" % (p.returncode, p.stdout[-6000:]))
    return result


def load_function(target):
    """FILE:NAME -> the function NAME of the Python file FILE, loaded as a
    module (its `if __name__ == "__main__"` block does not run)."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise GoldenError("%r: expected FILE:FUNCTION, e.g. my_moe.py:my_moe" % target)
    if not os.path.isfile(path):
        raise GoldenError("%s: no such file; valid: FILE:FUNCTION with an existing .py file" % path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("moeverify_impl_" + str(abs(hash(path))), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise GoldenError("%s: no function %r; valid: %s" % (
            path, name, ", ".join(sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")))))
    return fn
