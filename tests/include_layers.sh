#!/usr/bin/env bash
# The include graph follows the layers (docs/architecture.md "Layers", issue 22): each
# folder includes only its own files and folders beneath it. Parses every
# #include "..." in src/ kernels/ reference/; a name is resolved as the
# compiler does: next to the including file, else on the include path (every
# src/ folder, kernels/, reference/). Fails on an upward (or sideways)
# include, on a name that resolves to two folders, and prints file:line.
#
#   tests/include_layers.sh SRC
#
# The layers, highest first (a folder may include the folders of lower rank):
#   6 cli                  commands
#   5 engine               runner in named phases
#   4 report               text, JSON, .npy (engine -> report)
#   3 paths                stage descriptors
#   2 config  comm         case schema, YAML, data; communicators
#   1 kernels reference    fast bodies and executors; the independent oracle
#   0 core                 tensor, dtype, errors, diff, board and stage types
# Folders of one rank never include each other (the reference never sees
# kernels/, nor kernels/ the reference).
set -u
src=${1:-$(dirname "$0")/..}
cd "$src" || exit 2
/usr/bin/python3 - <<'EOF'
import os, re, sys

RANK = {"core": 0, "kernels": 1, "reference": 1, "config": 2, "comm": 2, "paths": 3,
        "report": 4, "engine": 5, "cli": 6}
# Generated headers (in the build folder) are not part of the graph.
GENERATED = {"version.h"}

def folder(path):
    parts = path.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    return parts[0]

roots = ["src", "kernels", "reference"]
files = []
for r in roots:
    for d, _, fs in os.walk(r):
        for f in fs:
            if f.endswith((".h", ".cpp", ".cu", ".hpp", ".cuh")):
                files.append(os.path.normpath(os.path.join(d, f)))
files.sort()
search = sorted({os.path.dirname(f) for f in files} | {"src"})  # the include path: src/ and every folder holding sources

bad = 0
unknown = [f for f in files if folder(f) not in RANK]
for f in unknown:
    print(f"{f}: folder '{folder(f)}' has no layer (add it to RANK in tests/include_layers.sh)")
    bad += 1
inc = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
edges = {}
for f in files:
    with open(f, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            m = inc.match(line)
            if not m:
                continue
            name = m.group(1)
            local = os.path.normpath(os.path.join(os.path.dirname(f), name))
            if os.path.isfile(local):
                targets = [local]
            else:
                targets = sorted({os.path.normpath(os.path.join(d, name)) for d in search
                                  if os.path.isfile(os.path.join(d, name))})
            if not targets:
                if os.path.basename(name) not in GENERATED:
                    print(f"{f}:{n}: #include \"{name}\" resolves to no file in src/ kernels/ reference/")
                    bad += 1
                continue
            if len(targets) > 1:
                print(f"{f}:{n}: #include \"{name}\" is ambiguous: {', '.join(targets)}")
                bad += 1
                continue
            a, b = folder(f), folder(targets[0])
            if a not in RANK or b not in RANK:
                continue
            edges.setdefault((a, b), 0)
            edges[(a, b)] += 1
            if a != b and RANK[b] >= RANK[a]:
                kind = "upward" if RANK[b] > RANK[a] else "sideways"
                print(f"{f}:{n}: {kind} include \"{name}\" ({a} -> {b}, {targets[0]})")
                bad += 1

print("folder arrows (count of #include lines):")
for (a, b), k in sorted(edges.items(), key=lambda e: (-RANK[e[0][0]], e[0][0], -RANK[e[0][1]], e[0][1])):
    if a != b:
        print(f"  {a:9s} -> {b:9s} {k}")
if bad:
    print(f"FAIL: {bad} include(s) against the layers")
    sys.exit(1)
print(f"ok: {len(files)} files, every include downward")
EOF
