#!/usr/bin/env python3
"""Issue 36's "Done when", read from a kit run's output folder (kit_run.sh).

Usage: done_when.py OUT_DIR

Prints one line per target with the figure this run measured and whether it
meets the target; a target whose input file is missing reads "not run". The
figures are the bench JSON's own (device seconds, one run, the roof and the
peer in the same run); nothing is computed here but the comparison:

- every row-moving stage variant of bench.deepseek_v3.json and
  bench.deepseek_v3_moves.json (capacity and SP, KIT_MOVES=1): its
  ratio_to_device_copy >= 0.85 (bytes as the bench's formula counts them);
- the router (slot routing) against PyTorch's in the same JSON: peer ratio
  (moeverify / torch device time) <= 2;
- every expert GEMM variant of bench.swiglu_deepseek_experts.json (the
  forward) and bench.swiglu_deepseek_experts_bwd.json (backward on) whose
  GEMMs went to the device as a group (a gemm_path: the issue's target is
  the grouped SwiGLU, forward and backward): device_gemm_ratio >= 0.60 of one
  device GEMM of the same FLOPs. The loop variant, one call an expert by
  design, is printed as not a target;
- full_layer.json (run --json of the full DeepSeek-V3 SwiGLU layer): outcome
  PASSED in under 600 s.

Exit 0 always: the kit's table says which checks failed; this says which
targets are met. Standard library only (the GPU machine's python3).
"""
import json
import os
import sys

ROW_MOVES = {"dispatch", "ep_permute", "ep_unpermute", "align_pad", "align_unpad", "combine", "capacity",
             "sp_pad_route", "sp_shard", "sp_gather"}


def load(out, name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def part_text(p):
    """A part of a stage's device time, with the host's share of its calls'
    intervals where the bench recorded it (near 100%: launch-bound)."""
    text = f"{p['part']} {1e3 * p['seconds']:.3f} ms"
    if p.get("interval_seconds"):
        text += f" (host {100 * p['host_seconds'] / p['interval_seconds']:.0f}%)"
    return text


def verdict(ok):
    return "met" if ok else "NOT MET"


def row_moves(bench, always_tag=False):
    """One line per row-moving stage variant of a bench JSON: its share of the
    device copy against 85%, and where a stage that misses spent its time."""
    for case in (bench or {}).get("cases", []):
        at = f" [{case['name']}]" if always_tag or len(bench["cases"]) > 1 else ""
        for s in case["stages"]:
            if s["slot"] in ROW_MOVES and s.get("timed") and s.get("ratio_to_device_copy") is not None:
                r = s["ratio_to_device_copy"]
                parts = s.get("device_parts") or []
                where = ""
                if r < 0.85 and len(parts) > 1:
                    where = " [" + ", ".join(part_text(p) for p in parts) + "]"
                print(f"row move{at} {s['slot']}/{s['variant']}: {100 * r:.1f}% of the device copy "
                      f"(>= 85%): {verdict(r >= 0.85)}{where}")


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = argv[1]
    print("== issue 36, Done when (this run's figures)")
    bench = load(out, "bench.deepseek_v3.json")
    if bench is None:
        print("row-moving stages, router: not run (no bench.deepseek_v3.json)")
    row_moves(bench)
    for case in (bench or {}).get("cases", []):
        at = f" [{case['name']}]" if len(bench["cases"]) > 1 else ""
        peers = [p for p in case.get("peer", {}).get("stages", []) if p["slot"] == "routing"]
        if not peers:
            note = case.get("peer", {}).get("note") or "no peer in this run"
            print(f"router{at}: not compared ({note})")
        for p in peers:
            print(f"router{at} {p['variant']}: {p['ratio']:.2f}x PyTorch's {p['what']} (<= 2x): "
                  f"{verdict(0 < p['ratio'] <= 2.0)}")
    moves = load(out, "bench.deepseek_v3_moves.json")
    if moves is None:
        print("capacity and SP row moves: not run (no bench.deepseek_v3_moves.json; KIT_MOVES=1)")
    row_moves(moves, always_tag=True)
    for name, what in [("bench.swiglu_deepseek_experts.json", "expert GEMMs"),
                       ("bench.swiglu_deepseek_experts_bwd.json", "expert GEMMs, backward")]:
        gemm = load(out, name)
        if gemm is None:
            print(f"{what}: not run (no {name})")
        for case in (gemm or {}).get("cases", []):
            at = f" [{case['name']}]" if len(gemm["cases"]) > 1 else ""
            for s in case["stages"]:
                r = s.get("device_gemm_ratio")
                if not s.get("timed") or r is None or s["slot"] == "router_logits":
                    continue
                line = f"GEMMs{at} {s['slot']}/{s['variant']}: {100 * r:.1f}% of one same-FLOP GEMM"
                if s.get("gemm_path"):
                    print(f"{line} [{s['gemm_path']}] (>= 60%): {verdict(r >= 0.60)}")
                else:
                    print(f"{line} [one call a GEMM, back to back]: not a target")
    layer = load(out, "full_layer.json")
    if layer is None:
        print("full DeepSeek-V3 SwiGLU layer: not run (no full_layer.json)")
    for case in (layer or {}).get("cases", []):
        ok = case["outcome"] == "PASSED" and case["seconds"] < 600
        print(f"full layer {case['name']}: {case['outcome']} in {case['seconds']:.0f} s (PASSED, < 600 s): "
              f"{verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
