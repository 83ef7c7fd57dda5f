"""The share of the floor per token count in ab-*.txt, each tool and round side by side."""
import re
import sys
from collections import defaultdict

rows = defaultdict(dict)  # (preset, T) -> {(tool, round): share}
bw = defaultdict(list)
key = None
for line in open(sys.argv[1]):
    m = re.match(r"== round (\d+) (\w+) (\S+)", line)
    if m:
        key = (m.group(3), m.group(2), int(m.group(1)))
        continue
    m = re.match(r"\s+T=(\d+)\s+[\d.]+ ms \|[# ]*([\d.]+) %", line)
    if m and key:
        rows[(key[0], int(m.group(1)))][(key[1], key[2])] = float(m.group(2))
    m = re.match(r"\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+\d+$", line)
    if m and key:
        bw[key[0]].append(float(m.group(2)))
tools = sorted({t for r in rows.values() for (t, _) in r}, reverse=True)
print("| preset | tokens | " + " | ".join(f"{t}, rounds 1-3" for t in tools) + " |")
print("| --- | --- |" + " --- |" * len(tools))
for (preset, T), r in sorted(rows.items()):
    cells = [", ".join(f"{r[(t, k)]:.1f}" for k in (1, 2, 3) if (t, k) in r) for t in tools]
    print(f"| {preset} | {T} | " + " | ".join(cells) + " |")
for p, v in bw.items():
    print(f"\nread rate {p}: {min(v):.1f}-{max(v):.1f} GB/s")
