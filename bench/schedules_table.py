"""The sm90 bf16 schedules by name against kAuto's choice, from `scripts/device-check schedules`
(each `moekit bench ragged_dot --device cuda --impl I --baseline auto --json` in FOLDER as
schedules-I-PRESET.json): for each shape (preset, tokens, pass), each schedule's time over kAuto's
in its own run (so that drift between the runs' processes cancels), the best (kAuto's own choice,
'auto' at 1.000, among them), and the best's share of the dense cuBLAS matmul. The schedules are those FOLDER holds; a shape some schedule did
not run shows '-' there.

python3 bench/schedules_table.py FOLDER > FOLDER/table.txt
(bench/results/gpu-h200-2026-11-28/: schedules, check/schedules, final/schedules-24576.)

python3 bench/schedules_table.py --runs FOLDER: from `scripts/device-check runs` (runs-*.json,
each run-order schedule with its own schedule as the baseline), each shape's time on the run
order over CUTLASS's order (below 1: the runs faster), and the faster one's share of dense."""
import collections
import glob
import json
import os
import sys

# Short names, in the table's column order.
NAMES = {"sm90-pingpong": "pingpong", "sm90": "coop128", "sm90-cooperative-256": "coop256",
         "sm90-pingpong-64x256": "pp64x256", "sm90-pingpong-64x256-runs": "pp64runs",
         "sm90-cooperative-256-runs": "c256runs"}


def runs(folder):
    rows = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(folder, "runs-*.json")):
        for r in json.load(open(path)):
            if "baseline_ms" in r:
                rows[(r["preset"], r["tokens"], r["pass"])][r["baseline_impl"]] = r
    bases = sorted({b for v in rows.values() for b in v})
    print(f"{'preset':17}{'tokens':>6}{'pass':>5} {'r':>6}  "
          + "  ".join(f"{NAMES[b] + ' runs/base':>17} {'% dense':>7}" for b in bases))
    for key in sorted(rows):
        v = rows[key]
        r0 = next(iter(v.values()))
        cells = []
        for b in bases:
            if b not in v:
                cells.append(f"{'-':>17} {'-':>7}")
                continue
            x = v[b]
            cells.append(f"{x['ms'] / x['baseline_ms']:17.3f} "
                         f"{100 * x['dense_ms'] / min(x['ms'], x['baseline_ms']):7.1f}")
        print(f"{key[0]:17}{key[1]:>6}{key[2]:>5} {r0['m'] // r0['E']:>6}  " + "  ".join(cells))


def main(folder):
    rows = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(folder, "schedules-*.json")):
        for r in json.load(open(path)):
            rows[(r["preset"], r["tokens"], r["pass"])][NAMES[r["impl"]]] = r
    present = {name for v in rows.values() for name in v}
    order = [name for name in NAMES.values() if name in present]
    print(f"{'preset':17}{'tokens':>6}{'pass':>5} {'E_loc':>5}{'K':>6}{'n':>6}{'r':>6}  "
          + "  ".join(f"{o:>8}" for o in order) + "   best      its % of dense")
    for key in sorted(rows):
        v = rows[key]
        r0 = next(iter(v.values()))
        rel = {o: v[o]["ms"] / v[o]["baseline_ms"] for o in order if o in v}
        best = min(rel, key=rel.get) if min(rel.values()) < 1 else "auto"
        best_ms = r0["baseline_ms"] if best == "auto" else v[best]["ms"]
        print(f"{key[0]:17}{key[1]:>6}{key[2]:>5} {r0['E_loc']:>5}{r0['K']:>6}{r0['n']:>6}"
              f"{r0['m'] // r0['E']:>6}  "
              + "  ".join(f"{rel[o]:8.3f}" if o in rel else f"{'-':>8}" for o in order)
              + f"   {best:9} {100 * r0['dense_ms'] / best_ms:5.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        runs(sys.argv[2])
    else:
        main(sys.argv[1])
