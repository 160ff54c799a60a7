#!/usr/bin/env python3
"""The package's judging and running side against the real tool (ctest
python.impl): moeverify.check and Golden.check (PASSED returns the Verdict;
a wrong element raises AssertionError naming the stage; a malformed file
raises GoldenError), moeverify.main's exit codes (0, 77 for Unsupported, 1
for an exception), the worker protocol of moeverify.serve (done, skip,
error; printing stays off the answer channel), moeverify.testing.cases,
and moeverify.fuzz driving `fuzz --impl` with a Python function.

    test_impl.py MOEVERIFY SOURCE_DIR
"""
import io
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import moeverify  # noqa: E402
import moeverify.testing  # noqa: E402

failures = []


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def raises(fn, exc, *needles):
    try:
        fn()
    except exc as e:
        return all(n in str(e) for n in needles)
    return False


def local_dispatch(g):
    """A correct local dispatch (module level: fuzz runs it in workers)."""
    if g.ranks != 1 or g.case["capacity.factor"] != 0 or g.case["score_before_experts"] == "on":
        raise moeverify.Unsupported("local dispatch without capacity, scores after the experts")
    ids = g.expected("routing.ids")
    order = np.argsort(ids.reshape(-1), kind="stable")
    g.write("dispatch.token_sorted", order // ids.shape[1])
    g.write("dispatch.routed_input", g.input("x")[order // ids.shape[1]])


def unstable_dispatch(g):
    """The same with a planted bug: descending tokens inside every expert."""
    if g.ranks != 1 or g.case["capacity.factor"] != 0:
        raise moeverify.Unsupported("local dispatch without capacity only")
    ids = g.expected("routing.ids").reshape(-1)
    order = np.lexsort((-np.arange(ids.size), ids))
    g.write("dispatch.token_sorted", order // g.expected("routing.ids").shape[1])


def e4m3_bits(v):
    """fp32 values to e4m3fn bytes: the nearest value, ties to the even
    mantissa, magnitudes past 448 saturating (docs/contract.md §16)."""
    mags = moeverify.e4m3_to_f32(np.arange(127, dtype=np.uint8)).astype(np.float64)  # codes 0 .. 448
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(mags, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    return np.where(np.signbit(v), code | 0x80, code).astype(np.uint8)


def deepseek_quant(g):
    """DeepSeek-V3's act_quant in NumPy: per token and block, s = amax / 448
    and y = x / s, both in fp32 (dispatch.quotient: divide)."""
    x = g.input("x").astype(np.float32)
    B = g.case["dispatch.block"]
    blocks = x.reshape(x.shape[0], -1, B)
    amax = np.maximum(np.abs(blocks).max(axis=2), np.float32(g.case["dispatch.amax_clamp"]))
    s = (amax / np.float32(448)).astype(np.float32)
    g.write("fp8_quant.x_q", e4m3_bits((blocks / s[:, :, None]).astype(np.float32)).reshape(x.shape))
    g.write("fp8_quant.x_scale", s)


def main():
    tool, src = sys.argv[1], sys.argv[2]
    os.environ["MOEVERIFY_BIN"] = tool
    with tempfile.TemporaryDirectory() as tmp:
        run(tool, src, tmp)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


def _unused_fn(g):
    """A module-level function for fuzz(); never called (refused before)."""
    raise AssertionError("fuzz(iterations=0) ran a configuration")


def run(tool, src, tmp):
    golden = os.path.join(tmp, "golden")
    folders = moeverify.export(os.path.join(src, "cases/basic.yaml"), golden, cases=["exact_fp32"])
    expect(len(folders) == 1 and os.path.isdir(folders[0]), "export returns the case folder it wrote")
    g = moeverify.open(folders[0])
    local_dispatch(g)
    v = g.check()
    expect(v.passed and v.outcome == "PASSED" and any(r["stage"] == "dispatch" for r in v.rows),
           "Golden.check: PASSED, the dispatch rows in the Verdict")
    # one element off: AssertionError naming the stage and the coordinates
    x = g.input("x")
    bad = x[g.expected("dispatch.token_sorted")].copy()
    bad[0, 0] += 1
    g.write("dispatch.routed_input", bad)
    expect(raises(g.check, AssertionError, "INCORRECT", "dispatch/routed_input", "yours"),
           "Golden.check: a wrong element raises AssertionError with the stage and 'yours'")
    v = moeverify.check(folders[0], raise_on_failure=False)
    expect(not v and v.failures and v.failures[0]["stage"] == "dispatch", "check(raise_on_failure=False) returns the failure")
    with open(os.path.join(g.actual_dir, "dispatch.routed_input.rank0.npy"), "wb") as f:
        f.write(b"not a numpy file")
    expect(raises(g.check, moeverify.GoldenError, "routed_input"), "a malformed file raises GoldenError")
    os.remove(os.path.join(g.actual_dir, "dispatch.routed_input.rank0.npy"))

    # dispatch.quotient: divide: a NumPy port of DeepSeek-V3's quantiser passes
    fq = moeverify.export(os.path.join(src, "cases/fp8.yaml"), os.path.join(tmp, "fp8"),
                          cases=["fp8_local_divide[dispatch.scale=fp32]"])
    gq = moeverify.open(fq[0])
    deepseek_quant(gq)
    v = moeverify.check(fq[0], raise_on_failure=False)
    expect(v.passed and any(r["stage"] == "fp8_quant" for r in v.rows),
           "dispatch.quotient divide: x / s in fp32 (DeepSeek-V3's act_quant) PASSES fp8_quant")
    # ... and under the reciprocal convention, on rows enough to meet a value
    # where x / s and x * (1 / s) round to neighbouring e4m3 codes, it is INCORRECT
    qcase = os.path.join(tmp, "quotient.yaml")
    with open(qcase, "w") as f:
        f.write("defaults:\n  dtype: bf16\n  data: realistic\n  seed: 3\n"
                "  shape: {tokens: 512, hidden: 1024, ffn: 16, experts: 8, top_k: 2}\n"
                "  dispatch: {dtype: fp8_e4m3, scale: fp32, block: 128}\n"
                "cases:\n  - name: q_div\n    dispatch.quotient: divide\n"
                "  - name: q_rec\n    dispatch.quotient: reciprocal\n")
    for folder in moeverify.export(qcase, os.path.join(tmp, "quotient")):
        deepseek_quant(moeverify.open(folder))
        v = moeverify.check(folder, raise_on_failure=False)
        if folder.endswith("q_div"):
            expect(v.passed, "x / s on 512 x 1024 bf16 rows PASSES under divide")
        else:
            expect(not v and v.failures and v.failures[0]["stage"] == "fp8_quant",
                   "x / s under quotient reciprocal: INCORRECT at fp8_quant")

    # main: exit codes of the one-shot command line
    script = os.path.join(tmp, "impl.py")
    with open(script, "w") as f:
        f.write("import sys\nsys.path.insert(0, %r)\nimport moeverify\n"
                "def fn(g):\n    if g.case['dtype'] == 'fp32': raise moeverify.Unsupported('no fp32')\n"
                "moeverify.main(fn)\n" % os.path.dirname(HERE))
    p = subprocess.run([sys.executable, script, folders[0]], capture_output=True, text=True)
    expect(p.returncode == 77 and "not supported: no fp32" in p.stderr, "main: Unsupported exits 77 with the reason")
    p = subprocess.run([sys.executable, script, os.path.join(tmp, "nowhere")], capture_output=True, text=True)
    expect(p.returncode == 1 and "GoldenError" in p.stderr, "main: an exception exits 1 naming it")
    # Unsupported() without a reason: the default reason (it once sent "skip " and nothing)
    bare = os.path.join(tmp, "bare.py")
    with open(bare, "w") as f:
        f.write("import sys\nsys.path.insert(0, %r)\nimport moeverify\n"
                "def fn(g):\n    raise moeverify.Unsupported()\nmoeverify.main(fn)\n" % os.path.dirname(HERE))
    p = subprocess.run([sys.executable, bare, folders[0]], capture_output=True, text=True)
    expect(p.returncode == 77 and "not supported: unsupported" in p.stderr,
           "main: Unsupported() without a reason says 'unsupported': %r" % p.stderr.strip())
    p = subprocess.run([sys.executable, script, "--bogus"], capture_output=True, text=True)
    expect(p.returncode == 2 and "usage" in p.stderr, "main: an unknown option exits 2 with the usage")
    # main on the folder given to export: every case folder runs, the ones
    # after an unsupported one too (it once stopped at the first), exit 77
    root = os.path.join(tmp, "root")
    cases = moeverify.export(os.path.join(src, "cases/basic.yaml"), root, cases=["exact_fp32", "realistic_bf16"])
    marks = os.path.join(tmp, "marks")
    os.makedirs(marks)
    each = os.path.join(tmp, "each.py")
    with open(each, "w") as f:
        f.write("import os, sys\nsys.path.insert(0, %r)\nimport moeverify\n"
                "def fn(g):\n    open(os.path.join(%r, g.name), 'w').close()\n"
                "    if g.case['dtype'] == 'fp32': raise moeverify.Unsupported('no fp32')\n"
                "moeverify.main(fn)\n" % (os.path.dirname(HERE), marks))
    p = subprocess.run([sys.executable, each, root], capture_output=True, text=True)
    expect(p.returncode == 77 and sorted(os.listdir(marks)) == sorted(os.path.basename(c) for c in cases)
           and p.stderr.count("not supported: no fp32") == 1,
           "main on the export folder: every case folder ran (%s), exit %d" % (os.listdir(marks), p.returncode))
    # a folder that is no case folder (a typo): one line naming it, no traceback
    p = subprocess.run([sys.executable, each, os.path.join(tmp, "no_such_case")], capture_output=True, text=True)
    expect(p.returncode == 1 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
           and "no_such_case" in p.stderr and "moeverify export" in p.stderr,
           "main on a missing folder: one line, no traceback (exit %d): %s" % (p.returncode, p.stderr[-300:]))
    # open(folder, actual=folder) would write over the expected files
    try:
        moeverify.open(folders[0], actual=folders[0])
        expect(False, "open(folder, actual=folder) refused")
    except moeverify.GoldenError as e:
        expect("is the case folder itself" in str(e), "open(folder, actual=folder) refused: %s" % e)
    # Golden.check with nothing written: check's NOT_VERIFIED, not an error about --actual
    fresh = moeverify.open(cases[0])
    fresh.clear_actual()
    if os.path.isdir(fresh.actual_dir):
        os.rmdir(fresh.actual_dir)
    v = fresh.check(raise_on_failure=False)
    expect(v.outcome == "NOT_VERIFIED", "Golden.check with no actual/: %s" % v.outcome)
    # Under pytest, outputs another test judged and nothing rewrote since are
    # refused (two tests sharing one case list once passed the second on the
    # first's outputs); within one test a rewrite and a second check is fine.
    shared = moeverify.open(folders[0])
    shared.clear_actual()
    os.environ["PYTEST_CURRENT_TEST"] = "tests/test_a.py::test_dispatch[exact_fp32] (call)"
    local_dispatch(shared)
    expect(shared.check().passed, "test a: its dispatch PASSED")
    shared.write("dispatch.token_sorted", shared.expected("dispatch.token_sorted"))
    expect(shared.check().passed, "test a: one output rewritten, checked again: PASSED")
    os.environ["PYTEST_CURRENT_TEST"] = "tests/test_b.py::test_sort[exact_fp32] (call)"
    shared.write("dispatch.token_sorted", shared.expected("dispatch.token_sorted"))
    expect(raises(shared.check, AssertionError, "1 of the 2 output file(s)", "dispatch.routed_input.rank0.npy",
                  "judged in test tests/test_a.py::test_dispatch[exact_fp32]", "clear_actual()"),
           "test b, which wrote one output: test a's other output is refused")
    expect(shared.check(stale_ok=True).passed, "test b: check(stale_ok=True) judges them")
    os.environ["PYTEST_CURRENT_TEST"] = "tests/test_b.py::test_combine[exact_fp32] (call)"
    expect(shared.check().passed, "another test judging the same outputs, none rewritten (one fixture's): PASSED")
    os.environ["PYTEST_CURRENT_TEST"] = "tests/test_c.py::test_all[exact_fp32] (call)"
    shared.clear_actual()
    local_dispatch(shared)
    expect(shared.check().passed, "test c, after clear_actual() and its own writes: PASSED")
    del os.environ["PYTEST_CURRENT_TEST"]
    # fuzz(iterations=0) is refused as the command line refuses it (it ran 60 s)
    try:
        moeverify.fuzz(_unused_fn, iterations=0)
        expect(False, "fuzz(iterations=0) refused")
    except moeverify.GoldenError as e:
        expect("--iterations 0" in str(e), "fuzz(iterations=0) refused: %s" % str(e)[-120:])

    # serve: one answer line per folder, whatever fn prints
    def chatty(gg):
        print("chatter that must not reach the answers")
        if gg.case["dtype"] == "bf16":
            raise moeverify.Unsupported("bf16 later")
        if gg.case["dtype"] == "fp16":
            raise ValueError("broken")
    exp2 = moeverify.export(os.path.join(src, "cases/basic.yaml"), os.path.join(tmp, "g2"),
                            cases=["realistic_bf16", "exact_fp32"])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker, its stdout the pipe
        os.dup2(w, 1)
        moeverify.serve(chatty, stdin=io.StringIO("\n".join(exp2 + [os.path.join(tmp, "nowhere")]) + "\n"))
        os._exit(0)
    os.close(w)
    answers = os.fdopen(r).read().splitlines()
    os.waitpid(pid, 0)
    want = ["done" if "exact_fp32" in e else "skip bf16 later" for e in exp2] + ["error GoldenError"]
    expect(len(answers) == 3 and all(a.startswith(w) for a, w in zip(answers, want)),
           "serve: done, skip, error, one line each: %r" % answers)

    # testing.cases: a case file exported once, one Golden per case
    params = moeverify.testing.cases(os.path.join(src, "cases/basic.yaml"), only=["exact_*"])
    names = [getattr(p, "values", [p])[0].name for p in params]
    expect(names and all(n.startswith("exact_") for n in names), "testing.cases: one per exported case: %s" % names)
    # one name as a string (it was taken letter by letter)
    params = moeverify.testing.cases(os.path.join(src, "cases/basic.yaml"), only="exact_fp32")
    names = [getattr(p, "values", [p])[0].name for p in params]
    expect(names == ["exact_fp32"], "testing.cases: only= one name as a string: %s" % names)

    # Unsupported inside a test is a skip with its reason, not a failure:
    # unittest's own runner, and pytest (which takes unittest.SkipTest as a
    # skip) where it is importable: this interpreter's, or $MOEVERIFY_PYTEST_PYTHON's
    import unittest

    class Refusing(unittest.TestCase):
        def test_refused(self):
            raise moeverify.Unsupported("no bf16 here")
    res = unittest.TextTestRunner(stream=io.StringIO()).run(unittest.defaultTestLoader.loadTestsFromTestCase(Refusing))
    expect(res.wasSuccessful() and [r for _, r in res.skipped] == ["no bf16 here"],
           "Unsupported in a unittest test: skipped with its reason (skipped %r, failures %d, errors %d)" %
           (res.skipped and res.skipped[0][1], len(res.failures), len(res.errors)))
    pytest_python = os.environ.get("MOEVERIFY_PYTEST_PYTHON", sys.executable)
    if subprocess.run([pytest_python, "-c", "import pytest"], capture_output=True).returncode == 0:
        t = os.path.join(tmp, "test_refusing.py")
        with open(t, "w") as f:
            f.write("import moeverify\ndef test_refused():\n    raise moeverify.Unsupported('no bf16 here')\n"
                    "def test_wrong():\n    assert False\n")
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        p = subprocess.run([pytest_python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", t],
                           capture_output=True, text=True, env=env, cwd=tmp)
        expect("1 failed" in p.stdout and "1 skipped" in p.stdout and "no bf16 here" in p.stdout,
               "Unsupported in a pytest test: skipped with its reason, beside a failing one: %s" %
               p.stdout.strip().splitlines()[-1:])
    else:
        print("skip  Unsupported under pytest: no pytest in %s (set MOEVERIFY_PYTEST_PYTHON)" % pytest_python)

    # keys without effect: in the manifest, and never refused by an adapter
    # (a framework that cannot pad to a capacity runs a case without one)
    from moeverify.frameworks import refuse_keys
    g = getattr(params[0], "values", [params[0]])[0]
    inert = g.keys_without_effect
    expect("capacity.pad_to_capacity" in inert and "capacity.factor" not in inert,
           "keys_without_effect: capacity.pad_to_capacity at factor 0, capacity.factor itself not: %s" % sorted(inert))
    needs = {"capacity.pad_to_capacity": ("on",)}
    expect(not raises(lambda: refuse_keys(g.case, needs, "x", inert), moeverify.Unsupported) and
           raises(lambda: refuse_keys(g.case, needs, "x"), moeverify.Unsupported, "capacity.pad_to_capacity"),
           "refuse_keys: a value without effect not refused, refused without the manifest's list")

    # fuzz: a correct function passes, a planted bug is found and shrunk
    out = os.path.join(tmp, "fuzz-out")
    profile = os.path.join(tmp, "local.yaml")
    with open(profile, "w") as f:
        f.write("fix:\n  ep: 1\n  sp: 1\n  score_before_experts: \"off\"\nallow:\n  capacity.factor: [0]\n"
                "  dispatch.dtype: [act]\n")
    s = moeverify.fuzz(local_dispatch, profile=profile, iterations=12, seed=3, jobs=2, out=out,
                       raise_on_failure=False, sets={"dtype": "bf16"})
    expect(s["sets"] == ["dtype=bf16"], "fuzz(fn, sets=...): passed as --set: %s" % s["sets"])
    for f in s["failures"]:
        print(f["check"], f["note"], f["stderr_tail"])
    expect(s["failed"] == 0 and s["crashed"] == 0 and s["passed"] > 0 and s["drawn"] == 12,
           "fuzz(fn, profile): a correct dispatch: %s" % {k: s[k] for k in ("drawn", "judged", "passed", "skipped", "failed", "crashed")})
    s = moeverify.fuzz(unstable_dispatch, iterations=12, seed=3, jobs=2, out=out, raise_on_failure=False)
    first = [f for f in s["failures"] if f["same_as"] is None]
    expect(first and first[0]["check"].startswith("dispatch/") and first[0]["shrunk_tokens"] <= 4,
           "fuzz(fn): the unstable order found at dispatch and shrunk: %s" %
           [(f["check"], f["shrunk_tokens"]) for f in first])
    # its repro line runs as printed, with no PYTHONPATH of the caller's
    # (the package's was the fuzz's alone, and the worker found no moeverify)
    if first:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        p = subprocess.run(["bash", "-c", first[0]["repro"]], env=env,
                           capture_output=True, text=True)
        expect(p.returncode == 1 and "No module named" not in p.stderr,
               "fuzz(fn)'s repro line without PYTHONPATH: exit %d %s" % (p.returncode, p.stderr.strip()[-200:]))
    expect(raises(lambda: moeverify.fuzz(unstable_dispatch, iterations=4, seed=3, out=out), AssertionError,
                  "dispatch"), "fuzz(fn) raises AssertionError on a failure")
    expect(raises(lambda: moeverify.fuzz(lambda gg: None, iterations=1), moeverify.GoldenError, "module-level"),
           "fuzz(lambda) is refused: workers load the function from its file")


if __name__ == "__main__":
    sys.exit(main())
