#!/usr/bin/env bash
# Runs an example implementation on exported golden folders and checks it.
#   run_examples.sh numpy MOEVERIFY SOURCE_DIR   every case of basic.yaml and ep4.yaml, and its planted bugs
#   run_examples.sh torch MOEVERIFY SOURCE_DIR   torch_check.py and torch_ep.py (torchrun, gloo); exits 77 (skipped) without torch
#   run_examples.sh torch_swiglu_bwd MOEVERIFY SOURCE_DIR   torch_swiglu_bwd.py (autograd of torchtitan's
#                                                experts, docs/contract.md §13) and its bug; exits 77 without torch
# MOEVERIFY_TORCH_DEVICE=cuda runs torch_check.py and torch_swiglu_bwd.py on that torch device.
set -u
# --device for the torch examples where MOEVERIFY_TORCH_DEVICE is set, else nothing
device_args=(${MOEVERIFY_TORCH_DEVICE:+--device "$MOEVERIFY_TORCH_DEVICE"})
mode=$1
bin=$2
src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The first interpreter that imports torch and numpy: MOEVERIFY_TORCH_PYTHON
# (a virtual environment, say), then python3 and /usr/bin/python3; empty if none.
torch_python() {
  for p in ${MOEVERIFY_TORCH_PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c "import torch, numpy" 2>/dev/null; then echo "$p"; return; fi
  done
}
case "$mode" in
  numpy)
    py=/usr/bin/python3
    "$py" -c "import numpy" || { echo "numpy is not importable by $py (bash .ci/setup-deps installs python3-numpy)"; exit 1; }
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" >/dev/null || exit 1
    "$bin" export "$src/cases/ep4.yaml" "$tmp/golden" >/dev/null || exit 1
    cp -r "$tmp/golden" "$tmp/pristine"
    for d in "$tmp"/golden/*/; do "$py" "$src/examples/numpy_moe.py" "$d" >/dev/null || exit 1; done
    "$bin" check "$tmp/golden" --verbose >"$tmp/report.txt"
    rc=$?
    tail -3 "$tmp/report.txt"
    [ "$rc" -eq 0 ] || { grep -E "INCORRECT|ERROR" "$tmp/report.txt" | head; exit 1; }
    n=$(grep -c -E '^   dispatch +actual\* +PASSED' "$tmp/report.txt")
    [ "$n" -eq "$(ls -d "$tmp"/golden/*/ | wc -l)" ] || { echo "dispatch was not checked in every case"; exit 1; }
    n=$(grep -c -E '^   ep_permute +actual\* +PASSED' "$tmp/report.txt")
    [ "$n" -eq "$(ls -d "$tmp"/golden/ep4_*/ "$tmp"/golden/mixtral_like/ | wc -l)" ] ||
      { echo "ep_permute was not checked in every EP case ($n)"; exit 1; }
    # A partial run (rank 1 stopped before writing combine.out) is INCORRECT,
    # not PASSED on what the other ranks wrote; --require makes an unwritten
    # stage INCORRECT and a written one pass.
    rm -rf "$tmp/partial" && cp -r "$tmp/golden/ep4_hot_expert" "$tmp/partial"
    rm "$tmp/partial/actual/combine.out.rank1.npy"
    "$bin" check "$tmp/partial" >"$tmp/partial.txt"
    rc=$?
    grep -q "missing on rank 1, written on ranks 0, 2, 3" "$tmp/partial.txt" && [ "$rc" -eq 1 ] ||
      { tail -5 "$tmp/partial.txt"; echo "a combine.out missing on rank 1 is not INCORRECT (exit $rc)"; exit 1; }
    "$bin" check "$tmp/golden/ep4_hot_expert" --require dispatch,combine >/dev/null ||
      { echo "--require dispatch,combine: not PASSED although both are written"; exit 1; }
    "$bin" check "$tmp/golden/ep4_hot_expert" --require all >"$tmp/partial.txt"
    rc=$?
    grep -q "missing on ranks 0, 1, 2, 3 (required by --require)" "$tmp/partial.txt" && [ "$rc" -eq 1 ] ||
      { echo "--require all: the unwritten stages are not INCORRECT (exit $rc)"; exit 1; }
    "$bin" check "$tmp/golden/ep4_hot_expert" --require combin >/dev/null 2>&1
    [ $? -eq 2 ] || { echo "--require with an unknown stage is not exit 2"; exit 1; }
    echo "partial run: INCORRECT (missing on rank 1); --require: a written stage passes, all fails, a typo is exit 2"
    # A padded expert buffer longer than the layout (GroupedExperts' max_len
    # rows) is judged on the layout's rows and the rest ignored, said so; a
    # wrong row inside the layout is still INCORRECT.
    printf '%s\n' "defaults:" "  data: exact" "  seed: 3" "  shape: {tokens: 16, hidden: 8, ffn: 8, experts: 4, top_k: 2}" \
      "  experts: {kind: swiglu, impl: grouped}" "  align: 8" "  empty_groups: pad" "cases:" "  - name: padbuf" >"$tmp/pad.yaml"
    "$bin" export "$tmp/pad.yaml" "$tmp/pad" >/dev/null || exit 1
    for spoil in 0 1; do
      mkdir -p "$tmp/pad/padbuf/actual"
      "$py" - "$tmp/pad/padbuf" "$spoil" <<'PY' || exit 1
import sys, numpy as np
d, spoil = sys.argv[1], sys.argv[2] == "1"
for n in ["align_pad.expert_input", "experts.expert_output"]:
    a = np.load("%s/%s.rank0.npy" % (d, n))
    b = np.concatenate([a, np.zeros((40, a.shape[1]), a.dtype)])
    if spoil and n == "experts.expert_output":
        b[a.shape[0] - 1, 0] += 1
    np.save("%s/actual/%s.rank0.npy" % (d, n), b)
PY
      "$bin" check "$tmp/pad/padbuf" >"$tmp/pad.txt"
      rc=$?
      if [ "$spoil" = 0 ]; then
        [ "$rc" -eq 0 ] && grep -q "expert_output on rank 0: 40 rows past its .* rows in the padded group layout ignored" "$tmp/pad.txt" ||
          { tail -5 "$tmp/pad.txt"; echo "a padded buffer with 40 trailing rows is not judged on its real rows (exit $rc)"; exit 1; }
      else
        [ "$rc" -eq 1 ] || { echo "a wrong row in a padded buffer was not INCORRECT (exit $rc)"; exit 1; }
      fi
    done
    echo "padded expert buffers: judged on the layout's rows (40 trailing rows ignored); a wrong row inside is INCORRECT"
    # Each planted bug: check exit 1, first INCORRECT at the stage it is in.
    for spec in "unstable_order exact_fp32 dispatch" "score_in_bf16 realistic_bf16 combine" \
                "skip_last_source ep4_hot_expert ep_dispatch" "source_major ep4_zero_token_rank ep_permute"; do
      set -- $spec
      rm -rf "$tmp/bug" && mkdir "$tmp/bug" && cp -r "$tmp/pristine/$2" "$tmp/bug/"
      "$py" "$src/examples/numpy_moe.py" "$tmp/bug/$2" --bug "$1" >/dev/null || exit 1
      "$bin" check "$tmp/bug/$2" >"$tmp/bug.txt"
      rc=$?
      first=$(grep -m1 -E '^   [a-z_]+ +actual\*? +INCORRECT' "$tmp/bug.txt" | awk '{print $1}')
      echo "--bug $1 on $2: check exit $rc, first INCORRECT stage: ${first:-none}"
      [ "$rc" -eq 1 ] && [ "$first" = "$3" ] || { echo "expected exit 1 and INCORRECT first at $3"; exit 1; }
      # source_major's own unpermute undoes its permute: its combine output is
      # the exported one, INCORRECT only on the wrong rows fed on, so marked a
      # consequence of ep_permute (it was a second failure of its own)
      if [ "$1" = source_major ]; then
        grep -q "later check(s) INCORRECT only on the wrong inputs fed on" "$tmp/bug.txt" &&
          grep -q "a consequence of stage ep_permute: yours equals the exported expected output" "$tmp/bug.txt" ||
          { grep -E "INCORRECT|consequence" "$tmp/bug.txt" | head; echo "source_major: the combine is not marked a consequence"; exit 1; }
      fi
    done
    # The router backward (docs/contract.md §13, router) in NumPy's own fp32
    # order: judged PASSED on both router cases of backward.yaml, and a
    # detached route_norm denominator INCORRECT first at router_bwd.
    "$bin" export "$src/cases/backward.yaml" "$tmp/rb" --case 'bwd_router_*' >/dev/null || exit 1
    cp -r "$tmp/rb" "$tmp/rb_pristine"
    for d in "$tmp"/rb/*/; do
      "$py" "$src/examples/numpy_moe.py" "$d" >/dev/null || exit 1
      "$bin" check "$d" --verbose >"$tmp/rb.txt" || { grep -E "INCORRECT|ERROR" "$tmp/rb.txt"; echo "router backward: check failed on $d"; exit 1; }
      grep -q -E '^   router_bwd +actual\* +PASSED +(4|8) ' "$tmp/rb.txt" || { grep router_bwd "$tmp/rb.txt"; echo "router_bwd was not judged on every tensor ($d)"; exit 1; }
      n=$(basename "$d")
      "$py" "$src/examples/numpy_moe.py" "$tmp/rb_pristine/$n" --bug router_norm_detached >/dev/null || exit 1
      "$bin" check "$tmp/rb_pristine/$n" >"$tmp/rb.txt"
      rc=$?
      first=$(grep -m1 -E '^   [a-z_]+ +actual\*? +INCORRECT' "$tmp/rb.txt" | awk '{print $1}')
      echo "router backward on $n: PASSED; --bug router_norm_detached: check exit $rc, first INCORRECT stage: ${first:-none}"
      [ "$rc" -eq 1 ] && [ "$first" = router_bwd ] || { echo "expected exit 1 and INCORRECT first at router_bwd"; exit 1; }
    done
    # grad_accumulate (docs/contract.md §14): a bf16 K = 8 backward whose
    # forward combine sums in fp32 once and whose grad_x adds per row (as
    # PyTorch does) passes under grad_accumulate: per_add; the same grad_x
    # under the default (the combine's fp32_accumulate) is INCORRECT at
    # dispatch_bwd.
    printf '%s\n' "defaults:" "  dtype: bf16" "  data: realistic" "  seed: 7" \
      "  shape: {tokens: 64, hidden: 32, ffn: 16, experts: 16, top_k: 8}" "  backward: on" \
      "  combine: {accumulate: fp32_accumulate}" "cases:" "  - name: ga_per_add" "    grad_accumulate: per_add" \
      "  - name: ga_default" >"$tmp/ga.yaml"
    "$bin" export "$tmp/ga.yaml" "$tmp/ga" >/dev/null || exit 1
    "$py" "$src/examples/numpy_moe.py" "$tmp/ga/ga_per_add" >/dev/null || exit 1
    "$bin" check "$tmp/ga/ga_per_add" --verbose >"$tmp/ga.txt" ||
      { grep -E "INCORRECT|ERROR" "$tmp/ga.txt"; echo "grad_accumulate per_add: check failed"; exit 1; }
    grep -q -E '^   dispatch_bwd +actual\* +PASSED' "$tmp/ga.txt" || { echo "dispatch_bwd was not judged"; exit 1; }
    mkdir -p "$tmp/ga/ga_default/actual"
    cp "$tmp/ga/ga_per_add/actual/dispatch_bwd.grad_x.rank0.npy" "$tmp/ga/ga_default/actual/"
    "$bin" check "$tmp/ga/ga_default" >"$tmp/ga.txt"
    rc=$?
    first=$(grep -m1 -E '^   [a-z_]+ +actual\*? +INCORRECT' "$tmp/ga.txt" | awk '{print $1}')
    echo "per-add grad_x: PASSED under grad_accumulate: per_add; under the default: exit $rc, INCORRECT at ${first:-none}"
    [ "$rc" -eq 1 ] && [ "$first" = dispatch_bwd ] || { echo "expected exit 1 and INCORRECT at dispatch_bwd"; exit 1; }
    # check ends with the failure list and a repro line, and shows the user's values as "yours"
    grep -q "^failures:" "$tmp/ga.txt" && grep -q "^   ga_default: INCORRECT at dispatch_bwd / grad_x" "$tmp/ga.txt" &&
      grep -q "repro: .*moeverify check .*ga_default" "$tmp/ga.txt" && grep -q "mismatch .*: yours " "$tmp/ga.txt" ||
      { echo "check's failure list, repro line or 'yours' is missing"; exit 1; }
    repro=$(grep -m1 "repro: .*moeverify check" "$tmp/ga.txt" | sed "s|.*repro: ||")  # as printed: this binary
    eval "$repro" >/dev/null
    [ $? -eq 1 ] || { echo "the repro line does not reproduce the failure: $repro"; exit 1; }
    ;;
  torch)
    py=$(torch_python)
    [ -n "$py" ] || { echo "torch is not importable (set MOEVERIFY_TORCH_PYTHON to a python with torch): examples.torch skipped"; exit 77; }
    "$py" -c "import torch.distributed as d; assert d.is_available() and d.is_gloo_available()" 2>/dev/null ||
      { echo "torch.distributed with gloo is not available: examples.torch skipped"; exit 77; }
    echo "torch: $("$py" -c 'import torch; print(torch.__version__)') ($py)"
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" --case exact_fp32 >/dev/null || exit 1
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" \
      --case "realistic_swiglu[dtype=bf16,experts.impl=loop,combine.accumulate=fp32_accumulate]" >/dev/null || exit 1
    "$bin" export "$src/cases/ep4.yaml" "$tmp/golden" --case ep4_hot_expert --case ep4_zero_token_rank >/dev/null || exit 1
    cp -r "$tmp/golden" "$tmp/pristine"
    export OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1
    for d in "$tmp"/golden/*/; do
      case "$d" in
        */ep4_*) "$py" -m torch.distributed.run --nproc-per-node 4 "$src/examples/torch_ep.py" "$d" 2>&1 |
                   grep -v '^W[0-9]\|^\*\*\*' ; [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1 ;;
        *) "$py" "$src/examples/torch_check.py" "$d" "${device_args[@]}" || exit 1 ;;
      esac
    done
    "$bin" check "$tmp/golden" --verbose >"$tmp/report.txt"
    rc=$?
    tail -3 "$tmp/report.txt"
    [ "$rc" -eq 0 ] || { grep -E "INCORRECT|ERROR" "$tmp/report.txt" | head; exit 1; }
    n=$(grep -c -E '^   ep_dispatch +actual\* +PASSED' "$tmp/report.txt")
    [ "$n" -eq 2 ] || { echo "ep_dispatch was not checked in both EP cases ($n)"; exit 1; }
    mkdir "$tmp/bug" && cp -r "$tmp/pristine/ep4_hot_expert" "$tmp/bug/"
    "$py" -m torch.distributed.run --nproc-per-node 4 "$src/examples/torch_ep.py" "$tmp/bug/ep4_hot_expert" \
      --bug no_permute >/dev/null 2>&1 || exit 1
    "$bin" check "$tmp/bug/ep4_hot_expert" >"$tmp/bug.txt"
    rc=$?
    first=$(grep -m1 -E '^   [a-z_]+ +actual\*? +INCORRECT' "$tmp/bug.txt" | awk '{print $1}')
    echo "torch_ep.py --bug no_permute: check exit $rc, first INCORRECT stage: ${first:-none}"
    [ "$rc" -eq 1 ] && [ "$first" = ep_permute ] || { echo "expected exit 1 and INCORRECT first at ep_permute"; exit 1; }
    ;;
  torch_swiglu_bwd)
    py=$(torch_python)
    [ -n "$py" ] || { echo "torch is not importable (set MOEVERIFY_TORCH_PYTHON to a python with torch): skipped"; exit 77; }
    echo "torch: $("$py" -c 'import torch; print(torch.__version__)') ($py)"
    # the three conventions of torchtitan's experts, one rank each, with a shared expert where the case has one
    "$bin" export "$src/cases/backward_swiglu.yaml" "$tmp/golden" --case bwd_swiglu_torchtitan_bf16 \
      --case bwd_swiglu_torchtitan_compute_bf16_fp32 --case bwd_swiglu_torchtitan_compute_bf16_fp16 >/dev/null || exit 1
    cp -r "$tmp/golden" "$tmp/bug"
    export OMP_NUM_THREADS=1
    for d in "$tmp"/golden/*/; do
      "$py" "$src/examples/torch_swiglu_bwd.py" "$d" "${device_args[@]}" || exit 1
    done
    "$bin" check "$tmp/golden" --verbose >"$tmp/report.txt"
    rc=$?
    tail -1 "$tmp/report.txt"
    [ "$rc" -eq 0 ] || { grep -E "INCORRECT|ERROR" "$tmp/report.txt" | head; exit 1; }
    n=$(grep -c -E '^   experts_bwd +actual\* +PASSED' "$tmp/report.txt")
    [ "$n" -eq 3 ] || { echo "experts_bwd was not checked in every case ($n)"; exit 1; }
    n=$(grep -c -E '^   shared_experts_bwd +actual\* +PASSED' "$tmp/report.txt")
    [ "$n" -eq 2 ] || { echo "shared_experts_bwd was not checked in both shared cases ($n)"; exit 1; }
    # an fp32 activation (one rounding for silu(h1) h3) must fail experts_bwd in every case
    for d in "$tmp"/bug/*/; do
      "$py" "$src/examples/torch_swiglu_bwd.py" "$d" --bug fp32_activation "${device_args[@]}" >/dev/null || exit 1
    done
    "$bin" check "$tmp/bug" >"$tmp/bug.txt"
    rc=$?
    n=$(grep -c -E '^   experts_bwd +actual\* +INCORRECT' "$tmp/bug.txt")
    echo "torch_swiglu_bwd.py --bug fp32_activation: check exit $rc, experts_bwd INCORRECT in $n of 3 cases"
    [ "$rc" -eq 1 ] && [ "$n" -eq 3 ] || { echo "expected exit 1 and experts_bwd INCORRECT in all 3"; exit 1; }
    ;;
  *) echo "usage: run_examples.sh numpy|torch|torch_swiglu_bwd MOEVERIFY SOURCE_DIR"; exit 2 ;;
esac
