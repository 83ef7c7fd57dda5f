"""Swizzle 1 (the library's) against 2, 4 and 8: each shape's kAuto time at swizzle N over its time
at 1, and each run's share of the dense cuBLAS matmul. Run in this folder: python3 table.py"""
import collections
import glob
import json

runs = {1: "moekit", 2: "moekit-swizzle2", 4: "moekit-swizzle4", 8: "moekit-swizzle8"}
rows = collections.defaultdict(dict)
for sw, exe in runs.items():
    for path in glob.glob(f"swizzle-{exe}-*.json"):
        if sw == 1 and path.startswith("swizzle-moekit-swizzle"):
            continue
        for r in json.load(open(path)):
            if r["shards"] == 1:
                rows[(r["preset"], r["tokens"], r["pass"])][sw] = r
print(f"{'preset':18}{'tokens':>7}{'pass':>5} {'ms sw1':>7}  sw2/1  sw4/1  sw8/1  "
      "% of dense at 1 / 2 / 4 / 8  ran")
for key in sorted(rows):
    v = rows[key]
    base = v[1]["ms"]
    ratios = "  ".join(f"{v[s]['ms'] / base:5.3f}" for s in (2, 4, 8))
    shares = " ".join(f"{100 * v[s]['ratio_to_dense']:5.1f}" for s in (1, 2, 4, 8))
    print(f"{key[0]:18}{key[1]:>7}{key[2]:>5} {base:7.3f}  {ratios}  {shares}  {v[1]['ran']}")
