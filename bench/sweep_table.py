"""kAuto's share of the dense cuBLAS matmul in the same run, every preset and token count of a
sweep (`scripts/device-check sweep`: sweep-*-bf16.json in NEW), beside an earlier sweep's (OLD,
in brackets); * where kAuto ran cooperative 256x128, + cooperative 128x128, # pingpong 64x256,
else pingpong 128x128.

python3 bench/sweep_table.py NEW OLD > NEW/../sweep-table.txt
(bench/results/gpu-h200-2026-11-29: check/ beside gpu-h200-2026-11-28/final/; the same table
as gpu-h200-2026-11-28/final/sweep_table.py printed there.)"""
import glob
import json
import os
import sys

MARK = {"sm90-cooperative-256": "*", "sm90": "+", "sm90-pingpong-64x256": "#",
        "sm90-pingpong": ""}


def load(folder):
    rows = {}
    for path in glob.glob(os.path.join(folder, "sweep-*-bf16.json")):
        for r in json.load(open(path)):
            if r["shards"] == 1:
                rows[(r["preset"], r["pass"], r["tokens"])] = r
    return rows


def main(new_dir, old_dir):
    new, old = load(new_dir), load(old_dir)
    tokens = sorted({k[2] for k in new})
    print(f"% of dense, {new_dir} ({old_dir} in brackets)")
    print(f"{'preset':17}{'pass':5}" + "".join(f"{t:>12}" for t in tokens))
    for preset in sorted({k[0] for k in new}):
        for p in ("fwd", "dlhs", "drhs"):
            cells = []
            for t in tokens:
                r, o = new.get((preset, p, t)), old.get((preset, p, t))
                cell = f"{100 * r['ratio_to_dense']:.0f}{MARK.get(r['ran'], '?')}" if r else "-"
                if o:
                    cell += f" ({100 * o['ratio_to_dense']:.0f})"
                cells.append(f"{cell:>12}")
            print(f"{preset:17}{p:5}" + "".join(cells))


if __name__ == "__main__":
    main(*sys.argv[1:3])
