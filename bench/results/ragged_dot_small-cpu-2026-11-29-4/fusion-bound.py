# The layer's forward time outside its two grouped matmuls (layer - gmm_up - gmm_down: the
# activation, router, permutation, unpermute and, where a preset has one, the shared expert), per
# preset and token count, from a `moekit bench layer` table (default: the last session's sweep).
#   python3 fusion-bound.py [../ragged_dot_small-cpu-2026-11-29-3/layer-all.txt]
import re
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "../ragged_dot_small-cpu-2026-11-29-3/layer-all.txt"
cur, vals = None, {}
for line in open(path):
    m = re.match(r"^(\S+)\s+T=(\d+)\s+bf16", line)
    if m:
        cur, vals = (m.group(1), int(m.group(2))), {}
        continue
    f = line.split()
    if cur and f and f[0] in ("gmm_up", "gmm_down", "activation", "shared", "layer"):
        vals[f[0]] = float(f[1])
        if f[0] == "layer":
            rest = vals["layer"] - vals["gmm_up"] - vals["gmm_down"]
            print(f"{cur[0]:<17} T={cur[1]:<3} layer {vals['layer']:7.2f} ms  activation "
                  f"{vals['activation']:.2f}  shared {vals.get('shared', 0):.2f}  outside the two "
                  f"matmuls {rest:.2f} ms = {100 * rest / vals['layer']:.1f}%")
