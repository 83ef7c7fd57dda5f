"""The moekit.jax / C++ layer ratios of a bench/record_jax_layer.sh recording, one line per
preset and pass: each round's own ratio where both ran in one process, else the ratio of the
medians of the processes that each ran one of them (alternating), and the rounds' spread.

    .venv/bin/python bench/summarize_jax_layer.py bench/results/jax_layer-cpu-DATE
"""

import collections
import json
import pathlib
import statistics
import sys


def main(folder):
    rounds = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        for row in json.loads(path.read_text()):
            key = (row["preset"], row["pass"])
            for impl in ("moekit", "cpp"):
                rounds[key][impl] += row.get(f"{impl}_rounds_ms", [])
            if "moekit_rounds_ms" in row and "cpp_rounds_ms" in row:
                rounds[key]["ratio"] += [a / b for a, b in zip(row["moekit_rounds_ms"],
                                                               row["cpp_rounds_ms"])]
    print(f"{'preset':<18} {'pass':>8} {'moekit ms':>10} {'cpp ms':>10} {'ratio':>7}  rounds")
    for (preset, ps), r in sorted(rounds.items()):
        if not r["moekit"] or not r["cpp"]:
            continue
        a, b = statistics.median(r["moekit"]), statistics.median(r["cpp"])
        ratios = r["ratio"] or [x / b for x in r["moekit"]]
        how = "in one process" if r["ratio"] else "processes alternating, each over cpp's median"
        print(f"{preset:<18} {ps:>8} {a:>10.1f} {b:>10.1f} {statistics.median(ratios):>6.2f}x  "
              f"{', '.join(f'{x:.2f}' for x in ratios)} ({how})")


if __name__ == "__main__":
    main(sys.argv[1])
