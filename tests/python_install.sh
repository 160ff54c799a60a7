#!/usr/bin/env bash
# `pip install ./python` works offline (no build isolation, no index) and the
# installed package, not the source tree, reads an exported folder.
#   python_install.sh MOEVERIFY SOURCE_DIR
set -euo pipefail
bin=$(readlink -f "$1")
src=$(readlink -f "$2")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
py=/usr/bin/python3
"$py" -m pip --version >/dev/null || { echo "pip is missing (bash .ci/setup-deps installs python3-pip)"; exit 1; }
cp -r "$src/python" "$tmp/pkg"   # pip builds in place: keep the source tree clean
"$py" -m pip install -q --no-build-isolation --no-deps --no-index --target "$tmp/site" "$tmp/pkg" 2>&1 |
  grep -v "Running pip as the 'root' user" || true
"$bin" export "$src/cases/basic.yaml" "$tmp/golden" --case exact_fp32 >/dev/null
cd "$tmp"
PYTHONPATH="$tmp/site" "$py" - "$tmp" <<'PY'
import sys, moeverify
tmp = sys.argv[1]
assert moeverify.__file__.startswith(tmp + "/site/"), moeverify.__file__
g = moeverify.open_all(tmp + "/golden")[0]
g.write("combine.out", g.expected("combine.out"))
print("installed", moeverify.__version__, "at", moeverify.__file__, "read", g)
PY
"$bin" check "$tmp/golden" >"$tmp/report.txt" || { tail -20 "$tmp/report.txt"; exit 1; }
grep -q "coverage: 1 of" "$tmp/report.txt" || { echo "combine.out was not checked"; exit 1; }
echo "python_install: ok"
