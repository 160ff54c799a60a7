# Sourced by tests/frameworks_cases.sh and tests/frameworks_fuzz.sh after they
# set bin, src and fw: the Python with torch and the framework (skip, 77,
# without one, never pass), the package on PYTHONPATH, and a scratch folder
# $tmp removed on exit. Also by tests/bench_peer_torch.sh (fw=torch).
py=${MOEVERIFY_TORCH_PYTHON:-}
if [ -z "$py" ]; then echo "skip: MOEVERIFY_TORCH_PYTHON is not set (a Python with torch and $fw)"; exit 77; fi
mod=$fw; [ "$fw" = megatron ] && mod=megatron.core
"$py" -c "import torch, $mod" 2>/dev/null || { echo "skip: $py cannot import torch and $mod"; exit 77; }
export PYTHONPATH="$src/python${PYTHONPATH:+:$PYTHONPATH}" MOEVERIFY_BIN="$bin"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
