#!/bin/bash
# The AVX2 inner loops the READMEs describe, from build/libmoekit.a (the landed build): each
# function's instructions from its first broadcast to its loop's branch back.
L=${L:-/work/main/build/libmoekit.a}
for f in "N_AVX2::(anonymous namespace)::FloatPanel<3, 4>(" "N_AVX2::(anonymous namespace)::FloatPanel<2, 4>(" \
         "N_AVX2::(anonymous namespace)::WidePanel<2, 4>(" "N_AVX2::AxpyF32<2, 4, float, false>("; do
  echo "== $f"
  objdump -d --no-show-raw-insn -C "$L" | awk -v pat="$f" '/^[0-9a-f]+ </ {p = index($0, pat) > 0} p' |
    awk '{$1 = ""; print}' | awk '/vbroadcastss|vpbroadcastd/ && !s {s = 1} s {print} s && /^ j(l|g|ne|b) / {exit}'
done
