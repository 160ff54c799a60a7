#!/usr/bin/env python3
"""Hostile and careless folders and manifests against `export`, `run --dump`
and the Python package (ctest cli.hostile_folders): every entry must end in
exit 2 (the tool) or GoldenError (the package), never a bare Python error,
and every file outside what moeverify owns must be unchanged (hashes taken
before and after). The three data-loss repros first:

  export_foreign_manifest   export into a folder holding the user's own manifest.json and
                            my_weights.npy: exit 2 naming the manifest, both files kept
  export_keeps_unlisted     export over an earlier export with the user's my_weights.npy
                            beside it: the export is replaced, my_weights.npy kept and named
  write_outside             a hand-edited manifest "file" of ../../outside.npy, an absolute
                            path, ../manifest.json: GoldenError, nothing outside written
  partial_link              a symbolic link planted at actual/<file>.partial: written
                            without following it
  cross_kind                --dump over a golden folder, export over a --dump folder: exit 2,
                            nothing touched
  export_stale_outputs      export again over a folder the implementation wrote to: its earlier
                            outputs removed and said, its other files kept
  output_onto_input         --json, --plot or --emit naming a file the command reads (its case
                            file, profile, a golden folder's manifest): exit 2, the input intact

    hostile_folders.py MOEVERIFY SOURCE_DIR
"""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

tool, src = sys.argv[1], sys.argv[2]
# the package's calls run the tool under test too (a tree built elsewhere than
# build/, as .ci/sanitize's build-asan, has no build/moeverify to find)
os.environ["MOEVERIFY_BIN"] = os.path.abspath(tool)
sys.path.insert(0, os.path.join(src, "python"))
import moeverify  # noqa: E402

failures = []


def expect(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def hashes(root):
    """sha256 of every file under root (links as their target path)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            out[p] = os.readlink(p) if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def tool_run(*args):
    return subprocess.run([tool] + list(args), capture_output=True, text=True)


def golden_error(fn, *needles):
    """fn ends in GoldenError naming the needles (any other exception fails)."""
    try:
        fn()
    except moeverify.GoldenError as e:
        return all(n in str(e) for n in needles), str(e)
    except Exception as e:  # noqa: BLE001
        return False, "%s: %s" % (type(e).__name__, e)
    return False, "no error"


def main():
    tmp = tempfile.mkdtemp()
    try:
        run_all(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


def export_cases(tmp):
    case = os.path.join(src, "cases/basic.yaml")
    # 1. a folder with someone else's manifest.json
    d = os.path.join(tmp, "t1")
    os.makedirs(os.path.join(d, "exact_fp32"))
    np.save(os.path.join(d, "exact_fp32", "my_weights.npy"), np.arange(4.0))
    with open(os.path.join(d, "exact_fp32", "manifest.json"), "w") as f:
        json.dump({"my": "own manifest"}, f)
    before = hashes(d)
    p = tool_run("export", case, d, "--case", "exact_fp32")
    expect(p.returncode == 2 and "manifest.json is not a manifest moeverify wrote" in p.stderr and hashes(d) == before,
           "export_foreign_manifest: exit %d, files kept: %s" % (p.returncode, p.stderr.strip()[-160:]))
    # 2. an earlier export with the user's file beside it
    d = os.path.join(tmp, "t2")
    expect(tool_run("export", case, d, "--case", "exact_fp32").returncode == 0, "export into a new folder")
    mine = os.path.join(d, "exact_fp32", "my_weights.npy")
    np.save(mine, np.arange(3.0))
    h = hashes(os.path.dirname(mine))[mine]
    p = tool_run("export", case, d, "--case", "exact_fp32")
    expect(p.returncode == 0 and os.path.exists(mine) and hashes(os.path.dirname(mine))[mine] == h
           and "left in place" in p.stderr and "my_weights.npy" in p.stderr,
           "export_keeps_unlisted: exit %d, my_weights.npy kept and named: %s" % (p.returncode, p.stderr.strip()))
    # 3. --dump into a folder with a foreign manifest
    d = os.path.join(tmp, "t3")
    p = tool_run("run", case, "--case", "exact_fp32", "--dump", d)
    sub = glob.glob(os.path.join(d, "*"))
    expect(p.returncode == 0 and len(sub) == 1, "run --dump into a new folder")
    m = json.load(open(os.path.join(sub[0], "manifest.json")))
    expect(m.get("format") == "moeverify-dump/1" and m.get("tool", "").startswith("moeverify"),
           "a --dump manifest names its format and tool")
    with open(os.path.join(sub[0], "manifest.json"), "w") as f:
        json.dump({"format": "theirs/1", "tensors": [{"file": "x.npy"}]}, f)
    before = hashes(d)
    p = tool_run("run", case, "--case", "exact_fp32", "--dump", d)
    expect(p.returncode == 2 and hashes(d) == before, "--dump over a foreign manifest: exit %d, nothing touched" % p.returncode)
    # 5. --dump over an exported golden folder, export over a --dump folder:
    # each replaces only its own kind (a dump once replaced a golden folder's
    # expected tensors and manifest, and check refused it after)
    d = os.path.join(tmp, "t5")
    expect(tool_run("export", case, d, "--case", "exact_fp32").returncode == 0, "export for the cross-kind folders")
    before = hashes(d)
    p = tool_run("run", case, "--case", "exact_fp32", "--dump", d)
    expect(p.returncode == 2 and "is a golden folder written by `moeverify export`" in p.stderr and hashes(d) == before,
           "--dump over a golden folder: exit %d, nothing touched: %s" % (p.returncode, p.stderr.strip()[-160:]))
    d = os.path.join(tmp, "t3")  # the dump of entry 3, its manifest restored by a second dump
    shutil.rmtree(d)
    expect(tool_run("run", case, "--case", "exact_fp32", "--dump", d).returncode == 0, "a dump for the cross-kind folders")
    before = hashes(d)
    p = tool_run("export", case, d, "--case", "exact_fp32")
    expect(p.returncode == 2 and "is a --dump folder written by `moeverify run`" in p.stderr and hashes(d) == before,
           "export over a --dump folder: exit %d, nothing touched: %s" % (p.returncode, p.stderr.strip()[-160:]))
    # 6. an output path onto what the command reads: exit 2, the input intact
    # (--json once replaced the case file, and a golden folder's manifest)
    mine = os.path.join(tmp, "t6.yaml")
    shutil.copy(case, mine)
    prof = os.path.join(tmp, "t6.profile.yaml")
    shutil.copy(os.path.join(src, "examples/numpy_moe.profile.yaml"), prof)
    g = os.path.join(tmp, "t5", "exact_fp32")
    for what, args, victim in [
            ("run --json onto its case file", ["run", mine, "--case", "exact_fp32", "--json", mine], mine),
            ("bench --plot onto its case file", ["bench", mine, "--case", "exact_fp32", "--plot", mine], mine),
            ("check --json onto the manifest", ["check", g, "--json", os.path.join(g, "manifest.json")],
             os.path.join(g, "manifest.json")),
            ("fuzz --emit onto its profile", ["fuzz", "--profile", prof, "--iterations", "2", "--emit", prof], prof)]:
        before = hashes(os.path.dirname(victim))
        p = tool_run(*args)
        expect(p.returncode == 2 and "would overwrite an input" in p.stderr and hashes(os.path.dirname(victim)) == before,
               "%s: exit %d, the input intact: %s" % (what, p.returncode, p.stderr.strip()[-160:]))
    # 7. export again over a folder the implementation wrote to: its outputs
    # of the earlier export are removed (they once passed check against the
    # new export unrun), its other files kept
    d = os.path.join(tmp, "t7")
    expect(tool_run("export", case, d, "--case", "exact_fp32").returncode == 0, "export for the stale outputs")
    g = os.path.join(d, "exact_fp32")
    subprocess.run([sys.executable, os.path.join(src, "examples/numpy_moe.py"), g], check=True, capture_output=True)
    mine = os.path.join(g, "actual", "my_notes.txt")
    open(mine, "w").write("mine")
    outputs = len(os.listdir(os.path.join(g, "actual"))) - 1
    p = tool_run("export", case, d, "--case", "exact_fp32")
    left = sorted(os.listdir(os.path.join(g, "actual")))
    expect(p.returncode == 0 and outputs > 0 and left == ["my_notes.txt"]
           and ("removed %d output file(s) of the earlier export" % outputs) in p.stderr,
           "export_stale_outputs: exit %d, left %s: %s" % (p.returncode, left, p.stderr.strip()[-200:]))
    os.remove(mine)
    p = tool_run("check", g)
    expect(p.returncode == 4, "check after the new export, nothing written again: exit %d (NOT_VERIFIED)" % p.returncode)
    # ... and an actual/ holding only such outputs goes with them, not named
    # as left in place
    subprocess.run([sys.executable, os.path.join(src, "examples/numpy_moe.py"), g], check=True, capture_output=True)
    p = tool_run("export", case, d, "--case", "exact_fp32")
    expect(p.returncode == 0 and "(and the folder)" in p.stderr and "left in place" not in p.stderr
           and not os.path.exists(os.path.join(g, "actual")),
           "export_stale_outputs, actual/ emptied: exit %d: %s" % (p.returncode, p.stderr.strip()[-300:]))
    # 4. a message keeps its § as written (UTF-8, not escaped bytes)
    p = tool_run("run", case, "--set", "sp=2", "--set", "router.force_load_balance=on", "--case", "exact_fp32")
    expect(p.returncode == 2 and "§1 step 6" in p.stderr and "\\xc2" not in p.stderr,
           "messages are UTF-8 as written: %s" % p.stderr.strip()[-120:])


def package_cases(tmp):
    base = os.path.join(tmp, "golden")
    moeverify.export(os.path.join(src, "cases/basic.yaml"), base, cases=["exact_fp32"])
    pristine = os.path.join(base, "exact_fp32")
    outside = os.path.join(tmp, "outside.npy")
    np.save(outside, np.arange(5.0))

    def hostile(name, edit, *needles, write=True):
        d = os.path.join(tmp, "p_" + name)
        shutil.copytree(pristine, d)
        man = json.load(open(os.path.join(d, "manifest.json")))
        edit(man, d)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(man, f)
        before = {k: v for k, v in hashes(tmp).items() if not k.startswith(os.path.join(d, "actual"))}

        def go():
            g = moeverify.open(d)
            if write:
                g.write("dispatch.routed_input", g.expected("dispatch.routed_input"))
        ok, msg = golden_error(go, *needles)
        after = {k: v for k, v in hashes(tmp).items() if not k.startswith(os.path.join(d, "actual"))}
        expect(ok and after == before, "%s: GoldenError, nothing outside changed: %s" % (name, msg[:160]))

    def set_file(value):
        def edit(man, d):
            for t in man["tensors"]:
                if t["stage"] == "dispatch" and t["name"] == "routed_input":
                    t["file"] = value
        return edit
    hostile("write_outside_relative", set_file("../../outside.npy"), "field 'file'", "plain file name")
    hostile("write_outside_absolute", set_file(outside), "field 'file'")
    hostile("write_own_manifest", set_file("../manifest.json"), "field 'file'")
    hostile("file_empty", set_file(""), "field 'file'")
    hostile("file_not_string", set_file(7), "field 'file'")
    hostile("tensors_not_list", lambda m, d: m.__setitem__("tensors", {"a": 1}), "'tensors'")
    hostile("ranks_missing", lambda m, d: m.pop("ranks"), "'ranks'")
    hostile("ranks_string", lambda m, d: m.__setitem__("ranks", "4"), "'ranks'")
    hostile("case_not_object", lambda m, d: m.__setitem__("case", [1]), "'case'")
    hostile("entry_not_object", lambda m, d: m["tensors"].insert(0, "x"), "tensors[0]")
    hostile("entry_no_role", lambda m, d: m["tensors"][0].pop("role"), "'role'")
    hostile("entry_bad_role", lambda m, d: m["tensors"][0].__setitem__("role", "output"), "'role'")
    hostile("entry_rank_string", lambda m, d: m["tensors"][0].__setitem__("rank", "0"), "'rank'")
    hostile("entry_shape_negative", lambda m, d: m["tensors"][0].__setitem__("shape", [-1, 2]), "'shape'")
    hostile("layers_zero", lambda m, d: m.__setitem__("layers", 0), "'layers'")

    def linked_actual(man, d):
        target = os.path.join(tmp, "elsewhere")
        os.makedirs(target, exist_ok=True)
        os.symlink(target, os.path.join(d, "actual"))
    hostile("actual_linked", linked_actual, "symbolic link", "does not write through")

    # a link planted where the old package put its temporary file
    d = os.path.join(tmp, "p_partial_link")
    shutil.copytree(pristine, d)
    os.makedirs(os.path.join(d, "actual"))
    os.symlink(outside, os.path.join(d, "actual", "dispatch.routed_input.rank0.npy.partial"))
    before = hashes(tmp)[outside]
    g = moeverify.open(d)
    dest = g.write("dispatch.routed_input", g.expected("dispatch.routed_input"))
    expect(hashes(tmp)[outside] == before and not os.path.islink(dest)
           and tool_run("check", d, "--allow-unknown").returncode == 0,
           "partial_link: the planted link is not followed, the file written in place")
    # a malformed JSON document
    d = os.path.join(tmp, "p_list")
    shutil.copytree(pristine, d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        f.write("[1, 2]")
    ok, msg = golden_error(lambda: moeverify.open(d), "JSON list")
    expect(ok, "manifest_is_a_list: GoldenError: %s" % msg[:120])


def run_all(tmp):
    export_cases(tmp)
    package_cases(tmp)


if __name__ == "__main__":
    sys.exit(main())
