#!/usr/bin/env bash
# `cmake --install BUILD --prefix DIR` (issue 24): the installed binary runs a
# shipped case from the installed case files, and the docs and the Python
# package are installed beside them.
# Usage: install_prefix.sh BUILD_DIR
set -u
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/p" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; echo "install failed"; exit 1; }
share="$tmp/p/share/moeverify"
for f in "$tmp/p/bin/moeverify" "$share/cases/basic.yaml" "$share/docs/contract.md"; do
  [ -e "$f" ] || { echo "not installed: $f"; exit 1; }
done
if [ -d "$(dirname "$0")/../python" ]; then
  [ -e "$share/python/pyproject.toml" ] || { echo "the Python package is not installed"; exit 1; }
fi
(cd "$tmp" && PATH="$tmp/p/bin:$PATH" moeverify run "$share/cases/basic.yaml" --case exact_fp32 >run.log 2>&1) ||
  { tail -5 "$tmp/run.log"; echo "the installed moeverify did not pass a shipped case"; exit 1; }
echo "install: bin/moeverify, share/moeverify/{cases,docs,python}; the installed binary passes basic.yaml exact_fp32"
