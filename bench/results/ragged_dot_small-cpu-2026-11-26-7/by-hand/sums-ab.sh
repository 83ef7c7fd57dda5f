#!/bin/bash
# usage: ab.sh "rows..." "accs..." rounds K n E
rows=$1; accs=$2; rounds=$3; K=${4:-7168}; n=${5:-2048}; E=${6:-16}
for i in $(seq $rounds); do for r in $rows; do for a in $accs; do
  echo "$r $a $(ACCKB=$a REPS=5 NOPROBE=1 ${SC:-/tmp/bh/sc} $K $n $r $E 1 6 | tail -1 | awk '{print $11}')"
done; done; done | python3 -c "
import sys,statistics as st,collections
d=collections.defaultdict(list)
for l in sys.stdin:
  r,a,t=l.split(); d[(int(r),int(a))].append(float(t))
for k in sorted(d): print('rows %d acc %d: median %.2f ms  (%s)  GF %.0f'%(k[0],k[1],st.median(d[k]),' '.join('%.1f'%x for x in d[k]), 2*k[0]*$K*$n*$E/st.median(d[k])/1e6))
"
