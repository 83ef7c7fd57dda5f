"""kAuto's share of the dense cuBLAS matmul in the same run, every preset, 512-65536 tokens, bf16,
this session (check/sweep-*.json) beside the last H200 sweep (2026-11-28, final/: the same
rule for the forward and input gradient; the weight gradient's then scored only, kAuto here);
* where kAuto ran cooperative 256x128, + cooperative 128x128, else pingpong. Run in this
folder: python3 sweep_table.py"""
import glob
import json
import os

old_dir = "../gpu-h200-2026-11-28/final"
mark = {"sm90-cooperative-256": "*", "sm90": "+", "sm90-pingpong": ""}


def load(folder):
    rows = {}
    for path in glob.glob(os.path.join(folder, "sweep-*-bf16.json")):
        for r in json.load(open(path)):
            if r["shards"] == 1:
                rows[(r["preset"], r["pass"], r["tokens"])] = r
    return rows


new, old = load("check"), load(old_dir)
tokens = sorted({k[2] for k in new})
print("% of dense, this sweep (the 2026-11-28 sweep in brackets)")
print(f"{'preset':17}{'pass':5}" + "".join(f"{t:>12}" for t in tokens))
for preset in sorted({k[0] for k in new}):
    for p in ("fwd", "dlhs", "drhs"):
        cells = []
        for t in tokens:
            r, o = new.get((preset, p, t)), old.get((preset, p, t))
            cell = f"{100 * r['ratio_to_dense']:.0f}{mark.get(r['ran'], '?')}" if r else "-"
            if o:
                cell += f" ({100 * o['ratio_to_dense']:.0f})"
            cells.append(f"{cell:>12}")
        print(f"{preset:17}{p:5}" + "".join(cells))
