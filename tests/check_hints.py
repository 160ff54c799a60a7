#!/usr/bin/env python3
"""`check`'s diagnosing reports (issue 34 item 6), each seen on its planted
pattern: the reference's own outputs written back with one pattern each,
then the report must carry the hint, and a correct folder none; an unstable
sort with a correct combine fails at dispatch alone; stages fed inconsistent
inputs are not judged; a later failure off by the same rows is marked a
consequence of the first; the JSON calls the values "yours".

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


def check(g, *args):
    p = subprocess.run([binary, "check", g.path, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    # ... and a few ulps off: the order of the additions named too (a
    # reversed order moved sums by up to 4 ulps and was hinted as a rounding
    # convention, or not at all)
    out[0, 0] += 2
    h.write("combine.out", out.view(np.uint16))
    expect("order", h, "combine.out three ulps off", "within 3 ulp: a convention? see combine.accumulate, score_multiply (docs/contract.md §14); or the order of the additions")

    # ... and a SwiGLU hidden one rounding off: its bound stated as the
    # rounding class's, not the GEMM classes' sum of |terms|
    h.clear_actual()
    for n in ("experts.expert_h13", "experts.expert_hidden"):
        v = h.expected(n, raw=True).copy()
        if n.endswith("hidden"):
            v.flat[np.flatnonzero(v.view(np.uint16) & 0x7fff)[0]] += 1
        h.write(n, v.view(np.uint16))
    expect("rounding class", h, "expert_hidden one rounding off", "bound atol + rtol * the element's rounding half-width")

    # 5. the phantom combine: an unstable sort at dispatch, a correct combine.
    # Judged in the implementation's own row order, dispatch alone fails.
    fresh(g)
    for n in ("token_sorted", "routed_input", "score_sorted"):
        g.write("dispatch." + n, g.expected("dispatch." + n)[order])
    g.write("combine.out", g.expected("combine.out"))
    rc, out = check(g)
    bad = [l.split()[0] for l in out.splitlines() if l.startswith("   ") and "actual*" in l and "INCORRECT" in l]
    ok = rc == 1 and bad == ["dispatch"] and "later stages are judged in its order" in out
    print(("ok   " if ok else "FAIL ") + "unstable sort with a correct combine: INCORRECT at %s" % bad)
    if not ok:
        failures.append("phantom combine")

    # 6. wrong row indices with rows gathered by them: later stages, fed the
    # reference's index metadata beside those rows, are not judged
    fresh(g)
    tok = g.expected("dispatch.token_sorted")
    x = g.input("x")
    wrong = (tok + 1) % len(x)
    g.write("dispatch.token_sorted", wrong.astype(tok.dtype))
    g.write("dispatch.routed_input", x[wrong])
    g.write("combine.out", g.expected("combine.out") * 2)
    rc, out = check(g)
    comb = [l for l in out.splitlines() if l.startswith("   combine ") and " out " in l]
    ok = rc == 1 and comb and "NOT_VERIFIED" in comb[0] and "not judged: inputs inconsistent with stage dispatch" in out
    print(("ok   " if ok else "FAIL ") + "wrong token indices: combine not judged (%s)" % (comb[0].split()[5] if comb else "no row"))
    if not ok:
        failures.append("inconsistent inputs")
        print("\n".join(comb))

    # 8. a dispatch written without the routing: its score_sorted, gathered
    # from its own top-K scores (one ulp off the reference's here), is judged
    # within the scores tolerance (bitwise, a correct dispatch failed); with
    # its top-K scores written, the gather is bitwise again
    g.clear_actual()
    for n in ("token_sorted", "routed_input", "row_of"):
        g.write("dispatch." + n, g.expected("dispatch." + n))
    ss = g.expected("dispatch.score_sorted")
    g.write("dispatch.score_sorted", np.nextafter(ss, np.float32(np.inf)).astype(np.float32))
    rc, out = check(g)
    ok = rc == 0 and "judged within the scores tolerance" in out
    print(("ok   " if ok else "FAIL ") + "dispatch alone, scores one ulp off: PASSED within the scores tolerance (exit %d)" % rc)
    if not ok:
        failures.append("dispatch alone")
    g.write("routing.topk_scores", g.expected("routing.topk_scores"))
    rc, out = check(g)
    ok = rc == 1 and any(l.split()[:1] == ["dispatch"] and "score_sorted" in l and "INCORRECT" in l for l in out.splitlines())
    print(("ok   " if ok else "FAIL ") + "the same beside its own top-K scores: INCORRECT at dispatch (exit %d)" % rc)
    if not ok:
        failures.append("dispatch beside its top-K scores")

    # 7. a row short at align_pad and, built on it, at the experts: the later
    # failure is marked a consequence of the first, which the failure list names
    fresh(g)
    g.write("align_pad.expert_counts", short)
    g.write("align_pad.expert_input", xin[keep])
    g.write("experts.expert_output", g.expected("experts.expert_output")[keep])
    rc, out = check(g, "--json", os.path.join(tmp, "r.json"))
    import json
    checks = json.load(open(os.path.join(tmp, "r.json")))["cases"][0]["checks"]
    marked = [c["stage"] for c in checks if c.get("consequence_of") == "align_pad"]
    firsts = [c for c in checks if c["outcome"] == "INCORRECT" and "consequence_of" not in c]
    ok = (rc == 1 and marked == ["experts"] and {c["stage"] for c in firsts} == {"align_pad"} and
          "INCORRECT at align_pad" in out and "then 1 later check(s) off by the same rows" in out)
    print(("ok   " if ok else "FAIL ") + "a row short, then the same row short later: consequence marked at %s" % marked)
    if not ok:
        failures.append("consequence")
        print(out[-1500:])

    # 8. the JSON calls the implementation's values "yours"
    fresh(g)
    g.write("combine.out", g.expected("combine.out") + 1)
    check(g, "--json", os.path.join(tmp, "y.json"))
    first = [f for c in json.load(open(os.path.join(tmp, "y.json")))["cases"][0]["checks"] for f in c["first"]]
    ok = first and all("yours" in f and "fast" not in f for f in first)
    print(("ok   " if ok else "FAIL ") + "check --json: first mismatches name the values 'yours'")
    if not ok:
        failures.append("yours")

print("%d failure(s)" % len(failures))
sys.exit(1 if failures else 0)
