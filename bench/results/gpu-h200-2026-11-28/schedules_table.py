"""Each sm90 bf16 schedule by name against kAuto's choice in the same loop (`--baseline auto`), every
preset, at each run's tokens (2048-65536, 3072-24576, 24576), on this H200. For each shape: each schedule's time over kAuto's (from
its own run, so that the three runs' drift cancels), the best, and the best's share of the dense
cuBLAS matmul. Run here: python3 schedules_table.py FOLDER (schedules, check/schedules,
final/schedules-24576), as FOLDER/table.txt was made."""
import collections
import glob
import json
import os
import sys

names = {"sm90": "coop128", "sm90-pingpong": "pingpong", "sm90-cooperative-256": "coop256"}
rows = collections.defaultdict(dict)
for path in glob.glob(os.path.join(sys.argv[1], "schedules-*.json")):
    for r in json.load(open(path)):
        rows[(r["preset"], r["tokens"], r["pass"])][names[r["impl"]]] = r
order = ["pingpong", "coop128", "coop256"]
print(f"{'preset':17}{'tokens':>6}{'pass':>5} {'E_loc':>5}{'K':>6}{'n':>6}{'r':>6}  "
      + "  ".join(f"{o:>8}" for o in order) + "   best      its % of dense")
for key in sorted(rows):
    v = rows[key]
    r0 = v["pingpong"]
    rel = {o: v[o]["ms"] / v[o]["baseline_ms"] for o in order}
    best = min(order, key=lambda o: rel[o])
    print(f"{key[0]:17}{key[1]:>6}{key[2]:>5} {r0['E_loc']:>5}{r0['K']:>6}{r0['n']:>6}"
          f"{r0['m'] // r0['E']:>6}  " + "  ".join(f"{rel[o]:8.3f}" for o in order)
          + f"   {best:9} {100 * v[best]['ratio_to_dense']:5.1f}")
