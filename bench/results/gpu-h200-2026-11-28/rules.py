"""kAuto's sm90 rules for the forward and input gradient, and for the weight gradient, scored on this H200's three runs of each
schedule by name beside kAuto (schedules/: the H100's rule ran as kAuto; check/schedules/: the
first H200 rule, "A"; final/schedules-24576/: the rule in the code, "B"). A rule's score on a shape
is its pick's time over the best schedule's, every time taken against the same kAuto run; kAuto's
own pick counts 1. Run in this folder: python3 rules.py"""
import collections
import glob
import json
import math

NAMES = {"sm90": "coop128", "sm90-pingpong": "pingpong", "sm90-cooperative-256": "coop256"}


def load(folder):
    rows = collections.defaultdict(dict)
    for path in glob.glob(f"{folder}/schedules-*.json"):
        for r in json.load(open(path)):
            key = (r["preset"], r["tokens"], r["pass"])
            rows[key][NAMES[r["impl"]]] = r["ms"] / r["baseline_ms"]
            if r["pass"] == "drhs":
                rows[key]["shape"] = (r["m"], r["E"])
                continue
            kc, n = (r["K"], r["n"]) if r["pass"] == "fwd" else (r["n"], r["K"])
            rows[key]["shape"] = (r["m"] // r["E"], r["E"], kc, n, r["pass"] == "fwd")
    return rows


def h100(r, groups, kc, n, b_row_major):
    fill = r * groups >= 16384
    return (r >= 1024 and fill) or (kc >= 7168 and n <= 2048 and r >= 256)


def rule_a(r, groups, kc, n, b_row_major):
    if r * groups < 16384:
        return False
    if b_row_major:
        return (r * kc >= 1 << 22 and n < 8192) or r >= 8192
    return r >= 4096 and kc > 2048


def rule_b(r, groups, kc, n, b_row_major):  # cu::sm90_rows_on_cooperative256 on an H200
    if r * groups < 16384:
        return False
    if b_row_major:
        return (r >= 1024 and n < 8192) or r >= 6144
    return r >= 4096 and kc > 2048


RULES = {"H100's": h100, "A": rule_a, "B (in the code)": rule_b}
RUNS = [("schedules", h100), ("check/schedules", rule_a), ("final/schedules-24576", rule_b)]
print(f"{'rule':16}{'run (kAuto then)':24}{'pass':>9}{'geomean':>9}{'worst':>7}  worst shape")
for name, rule in RULES.items():
    for folder, ran in RUNS:
        rows = load(folder)
        for passes in (("fwd",), ("dlhs",), ("fwd", "dlhs")):
            scores = []
            for key, v in sorted(rows.items()):
                if key[2] not in passes:
                    continue
                t = {s: v[s] for s in NAMES.values()}
                t["coop256" if ran(*v["shape"]) else "pingpong"] = 1.0
                pick = "coop256" if rule(*v["shape"]) else "pingpong"
                scores.append((t[pick] / min(t.values()), key))
            g = math.exp(sum(math.log(s) for s, _ in scores) / len(scores))
            w = max(scores)
            print(f"{name:16}{folder:24}{'+'.join(passes):>9}{g:9.3f}{w[0]:7.3f}  {w[1][0]} {w[1][1]}")


# The weight gradient: kAuto ran cooperative 256x128 in all three runs.
def drhs_pingpong(m, groups):  # cu::sm90_contraction_on_pingpong on an H200
    return groups <= 32 and m < 65536


print(f"\n{'weight gradient':16}{'run':24}{'geomean':>9}{'worst':>7}  worst shape")
for name, rule in (("cooperative 256", lambda m, groups: False), ("the code's", drhs_pingpong)):
    for folder, _ in RUNS:
        scores = []
        for key, v in sorted(load(folder).items()):
            if key[2] != "drhs":
                continue
            t = {s: v[s] for s in NAMES.values()}
            t["coop256"] = 1.0
            pick = "pingpong" if rule(*v["shape"]) else "coop256"
            scores.append((t[pick] / min(t.values()), key))
        g = math.exp(sum(math.log(s) for s, _ in scores) / len(scores))
        w = max(scores)
        print(f"{name:16}{folder:24}{g:9.3f}{w[0]:7.3f}  {w[1][0]} {w[1][1]}")
