#!/usr/bin/env python3
"""Every fenced block of README.md and docs/*.md is validated or run (issue 24):

  yaml    a case file (it has `cases:`) must pass `moeverify validate`; any other
          YAML must parse
  python  must compile, and runs (with /usr/bin/python3 and the package in
          python/ on PYTHONPATH, after the blocks above it) and must exit 0
  sh      every command line must pass `bash -n`; a line that runs moeverify
          or one of examples/ is run, in order, from a copy of the source tree
          with the binary first on PATH, and must exit 0 (or the status its
          trailing comment names: "exit N"), except long-running commands
          (fuzz, selftest, bench, mpirun, every case file at once, and the
          README's set-up lines, which tests/readme_commands.sh runs), whose
          case files (and --profile files) are validated instead; other lines (your own code, the
          GPU kit) are only syntax-checked
  text    shown output: nothing to run

Usage: doc_blocks.py MOEVERIFY SOURCE_DIR
"""
import glob, os, re, shlex, shutil, subprocess, sys, tempfile

import yaml

binary, src = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
files = [os.path.join(src, "README.md")] + sorted(glob.glob(os.path.join(src, "docs", "*.md")))
tmp = tempfile.mkdtemp()
work = os.path.join(tmp, "tree")
shutil.copytree(src, work, ignore=shutil.ignore_patterns("build*", ".git"))
bindir = os.path.join(tmp, "bin")
os.makedirs(bindir)
os.symlink(binary, os.path.join(bindir, "moeverify"))
env = dict(os.environ, PATH=bindir + ":" + os.environ["PATH"], PYTHONPATH=os.path.join(work, "python"))
failures, counts = [], {}
LONG = ("fuzz", "selftest", "bench")


def run(cmd, where, want=0):
    p = subprocess.run(cmd, shell=True, cwd=work, env=env, capture_output=True, text=True, executable="/bin/bash")
    if p.returncode != want:
        failures.append(f"{where}: `{cmd}` exited {p.returncode}, expected {want}: {(p.stderr or p.stdout)[-300:]}")


for path in files:
    text = open(path).read()
    rel = os.path.relpath(path, src)
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        lang, body = m.group(1), m.group(2)
        line = text[: m.start()].count("\n") + 1
        where = f"{rel}:{line}"
        counts[lang] = counts.get(lang, 0) + 1
        if lang == "yaml":
            try:
                doc = yaml.safe_load(body)
            except yaml.YAMLError as e:
                failures.append(f"{where}: YAML does not parse: {e}")
                continue
            if isinstance(doc, dict) and "cases" in doc:
                f = os.path.join(tmp, "block.yaml")
                open(f, "w").write(body)
                run(f"moeverify validate {f}", where)
        elif lang == "python":
            try:
                compile(body, where, "exec")
            except SyntaxError as e:
                failures.append(f"{where}: Python does not compile: {e}")
                continue
            f = os.path.join(tmp, "block.py")
            open(f, "w").write(body)
            run(f"/usr/bin/python3 {f}", where)
        elif lang == "sh":
            for cmdline in body.splitlines():
                cmd = cmdline.strip()
                if not cmd or cmd.startswith("#"):
                    continue
                p = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
                if p.returncode:
                    failures.append(f"{where}: `{cmd}` is not valid shell: {p.stderr.strip()}")
                    continue
                want = 0
                ex = re.search(r"#.*\bexit (\d+)", cmd)
                if ex:
                    want = int(ex.group(1))
                words = shlex.split(cmd, comments=True)
                if not words or "setup-deps" in cmd:
                    continue
                prog = os.path.basename(words[0])
                wide = any("*" in w and w.endswith(".yaml") for w in words)
                if prog == "python3" and len(words) > 1 and words[1].startswith("examples/"):
                    run(cmd.replace("python3", "/usr/bin/python3", 1), where, want)
                elif prog == "mpirun" or wide or (prog == "moeverify" and len(words) > 1 and words[1] in LONG):
                    for i, w in enumerate(words):
                        if i > 0 and words[i - 1] == "--emit":  # an output file (fuzz --emit)
                            continue
                        if i > 0 and words[i - 1] == "--profile":  # a profile file or name (fuzz --impl)
                            run(f"moeverify validate --profile {shlex.quote(w)}", where)
                        elif w.endswith(".yaml"):
                            run(f"moeverify validate {w if '*' in w else shlex.quote(w)}", where)
                elif prog == "moeverify":
                    run(cmd, where, want)
        elif lang not in ("text", ""):
            failures.append(f"{where}: a ```{lang} block: say sh, yaml, python or text")
shutil.rmtree(tmp)
for f in failures:
    print("FAIL", f)
print("doc blocks:", ", ".join(f"{n} {k or 'plain'}" for k, n in sorted(counts.items())), f"; {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
