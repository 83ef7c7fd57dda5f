"""Candidate rules for when kAuto runs the forward and input gradient on pingpong 64x256 on an H200,
scored on check/schedules-sm90-pingpong-64x256-*.json (its time over kAuto's, both in one loop):
each rule's mean and geometric mean of the time over today's kAuto (1.0 where the rule keeps
kAuto's choice) and its worst shape, over the 60 forward and input-gradient shapes; 'best' takes
the faster of the two at every shape. Then each shape under the rule taken (B, in
src/cuda/grouped_gemm_cuda.h: cu::sm90_row_schedule). r = rows per group, out = output width
(n in the forward, K in the input gradient). Run in this folder: python3 rules.py > rules.txt"""
import glob
import json
import math

shapes = []
for path in glob.glob("check/schedules-sm90-pingpong-64x256-*.json"):
    for r in json.load(open(path)):
        if r["pass"] != "drhs":
            shapes.append(dict(preset=r["preset"], tokens=r["tokens"], pass_=r["pass"],
                               r=r["m"] // r["E"], out=r["n"] if r["pass"] == "fwd" else r["K"],
                               rel=r["ms"] / r["baseline_ms"]))
rules = {
    "A: out % 256 == 0 and r <= 1024": lambda q: q["out"] % 256 == 0 and q["r"] <= 1024,
    "B: A, or r <= 256 (taken)": lambda q: (q["out"] % 256 == 0 and q["r"] <= 1024) or q["r"] <= 256,
    "C: out % 256 == 0 and r < 1024": lambda q: q["out"] % 256 == 0 and q["r"] < 1024,
    "D: B, the input gradient to r <= 512": lambda q: (q["out"] % 256 == 0 and q["r"] <= (
        1024 if q["pass_"] == "fwd" else 512)) or q["r"] <= 256,
    "E: out % 256 == 0 and r <= 4096": lambda q: q["out"] % 256 == 0 and q["r"] <= 4096,
    "best": None,
}
for name, rule in rules.items():
    v = [min(1, q["rel"]) if rule is None else (q["rel"] if rule(q) else 1.0) for q in shapes]
    geo = math.exp(sum(map(math.log, v)) / len(v))
    print(f"{name:40} mean {sum(v) / len(v):.3f}  geo {geo:.3f}  worst {max(v):.3f}  ({len(v)} shapes)")
print()
print(f"{'preset':17}{'pass':>5}{'tokens':>7}{'r':>6}{'out':>6}  64x256/kAuto  rule B runs")
taken = rules["B: A, or r <= 256 (taken)"]
for q in sorted(shapes, key=lambda q: (q["preset"], q["pass_"], q["tokens"])):
    print(f"{q['preset']:17}{q['pass_']:>5}{q['tokens']:>7}{q['r']:>6}{q['out']:>6}  {q['rel']:12.3f}"
          f"  {'64x256' if taken(q) else 'as before'}")
