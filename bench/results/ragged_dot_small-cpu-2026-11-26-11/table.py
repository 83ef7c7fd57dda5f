"""sweep.txt's share of the floor per token count, pass and dtype: each tool's rounds side by side."""
import re
import sys
from collections import defaultdict

rows = defaultdict(dict)  # (dtype, pass, T) -> {(tool, round): share}
key = None
for line in open(sys.argv[1]):
    m = re.match(r"== round (\d+) (\w+) (\w+)", line)
    if m:
        key = (m.group(3), m.group(2), int(m.group(1)))
        continue
    m = re.match(r"\s+(\d+)\s+(fwd|dlhs)\s+all\s+.*\s([\d.]+)%\s+\w+$", line)
    if m and key:
        rows[(key[0], m.group(2), int(m.group(1)))][(key[1], key[2])] = float(m.group(3))
print("| dtype | pass | tokens | old, rounds 1-2 | new, rounds 1-2 |")
print("| --- | --- | --- | --- | --- |")
for (dtype, p, T), r in sorted(rows.items(), key=lambda x: (x[0][0], x[0][1] != "fwd", x[0][2])):
    cells = [", ".join(f"{r[(t, k)]:.1f}" for k in (1, 2) if (t, k) in r) for t in ("old", "new")]
    print(f"| {dtype} | {p} | {T} | " + " | ".join(cells) + " |")
