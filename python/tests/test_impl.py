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


def main():
    tool, src = sys.argv[1], sys.argv[2]
    os.environ["MOEVERIFY_BIN"] = tool
    with tempfile.TemporaryDirectory() as tmp:
        run(tool, src, tmp)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


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
    p = subprocess.run([sys.executable, script, "--bogus"], capture_output=True, text=True)
    expect(p.returncode == 2 and "usage" in p.stderr, "main: an unknown option exits 2 with the usage")

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

    # fuzz: a correct function passes, a planted bug is found and shrunk
    out = os.path.join(tmp, "fuzz-out")
    profile = os.path.join(tmp, "local.yaml")
    with open(profile, "w") as f:
        f.write("fix:\n  ep: 1\n  sp: 1\n  score_before_experts: \"off\"\nallow:\n  capacity.factor: [0]\n"
                "  dispatch.dtype: [act]\n")
    s = moeverify.fuzz(local_dispatch, profile=profile, iterations=12, seed=3, jobs=2, out=out,
                       raise_on_failure=False)
    for f in s["failures"]:
        print(f["check"], f["note"], f["stderr_tail"])
    expect(s["failed"] == 0 and s["crashed"] == 0 and s["passed"] > 0 and s["drawn"] == 12,
           "fuzz(fn, profile): a correct dispatch: %s" % {k: s[k] for k in ("drawn", "judged", "passed", "skipped", "failed", "crashed")})
    s = moeverify.fuzz(unstable_dispatch, iterations=12, seed=3, jobs=2, out=out, raise_on_failure=False)
    first = [f for f in s["failures"] if f["same_as"] is None]
    expect(first and first[0]["check"].startswith("dispatch/") and first[0]["shrunk_tokens"] <= 4,
           "fuzz(fn): the unstable order found at dispatch and shrunk: %s" %
           [(f["check"], f["shrunk_tokens"]) for f in first])
    expect(raises(lambda: moeverify.fuzz(unstable_dispatch, iterations=4, seed=3, out=out), AssertionError,
                  "dispatch"), "fuzz(fn) raises AssertionError on a failure")
    expect(raises(lambda: moeverify.fuzz(lambda gg: None, iterations=1), moeverify.GoldenError, "module-level"),
           "fuzz(lambda) is refused: workers load the function from its file")


if __name__ == "__main__":
    sys.exit(main())
