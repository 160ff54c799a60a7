#!/usr/bin/env python3
"""`check`'s diagnosing hints (issue 34 item 6), each seen on its planted
pattern: the reference's own outputs written back with one pattern each,
then the text report must carry the hint, and a correct folder none.

Usage: check_hints.py MOEVERIFY SOURCE_DIR
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

binary, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(src, "python"))
import moeverify  # noqa: E402

failures = []


def check(g):
    p = subprocess.run([binary, "check", g.path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout


def case(root, name):
    return [g for g in moeverify.open_all(root) if g.name == name][0]


def fresh(g):
    g.clear_actual()
    for n in ("routing.ids", "routing.topk_scores", "routing.counts", "dispatch.token_sorted",
              "dispatch.score_sorted", "dispatch.routed_input"):
        g.write(n, g.expected(n, raw=True) if g.entry(n).dtype == "bfloat16" else g.expected(n))


def expect(pattern, g, what, hint):
    rc, out = check(g)
    ok = rc == 1 and hint in out
    print(("ok   " if ok else "FAIL ") + what + ": " + ("hint shown" if ok else "exit %d, no %r" % (rc, hint)))
    if not ok:
        failures.append(what)
        print("\n".join(l for l in out.splitlines() if "INCORRECT" in l or "note" in l)[:2000])


with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "g")
    subprocess.run([binary, "export", os.path.join(src, "cases", "basic.yaml"), root, "--case", "exact_fp32",
                    "--case", "realistic_bf16"], check=True, stdout=subprocess.DEVNULL)
    g = case(root, "exact_fp32")
    fresh(g)
    rc, out = check(g)
    print(("ok   " if rc == 0 and "hint" not in out else "FAIL ") + "the reference's outputs: PASSED, no hint")
    if rc != 0 or "hint" in out:
        failures.append("no hint on a correct folder")

    # 1. an unstable sort: each expert's rows reversed
    counts = g.expected("routing.counts")
    tok, rows = g.expected("dispatch.token_sorted"), g.expected("dispatch.routed_input")
    order = np.concatenate([np.arange(s, s + n)[::-1] for s, n in zip(np.cumsum(counts) - counts, counts)])
    g.write("dispatch.token_sorted", tok[order])
    g.write("dispatch.routed_input", rows[order])
    expect("sort", g, "each expert's rows in reverse order", "is the sort stable?")

    # 2. an output never written: zeros
    fresh(g)
    g.write("combine.out", np.zeros_like(g.expected("combine.out")))
    expect("zeros", g, "combine.out all zeros", "all zeros where values were expected")

    # 3. a row short in one expert's padded group: its counts and its rows
    fresh(g)
    pc, xin = g.expected("align_pad.expert_counts"), g.expected("align_pad.expert_input")
    e = int(np.nonzero(pc)[0][0])
    short = pc.copy()
    short[e] -= 1
    keep = np.ones(len(xin), bool)
    keep[int(np.sum(pc[:e]))] = False
    g.write("align_pad.expert_counts", short)
    g.write("align_pad.expert_input", xin[keep])
    expect("short", g, "a row missing in expert %d's group" % e, "expert %d has 1 row short" % e)

    # 4. one rounding apart at the combine (bf16): a convention key named
    h = case(root, "realistic_bf16")
    h.clear_actual()
    out = h.expected("combine.out", raw=True).copy()
    out[0, 0] += 1  # one bf16 ulp
    h.write("combine.out", out.view(np.uint16))
    expect("rounding", h, "combine.out one ulp off", "a convention? see combine.accumulate")

print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
