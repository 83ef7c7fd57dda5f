#!/bin/bash
# usage: tab.sh "rows..." rounds K n E : the dot form (transposed rhs), old vs new binary
rows=$1; rounds=$2; K=${3:-2048}; n=${4:-7168}; E=${5:-16}
for i in $(seq $rounds); do for r in $rows; do for b in old new; do
  echo "$r $b $(REPS=5 NOPROBE=1 ${SC_DIR:-/tmp/bh}/sc_$b $K $n $r $E 1 6 1 | tail -1 | awk '{print $11}')"
done; done; done | python3 -c "
import sys,statistics as st,collections
d=collections.defaultdict(list)
for l in sys.stdin:
  r,a,t=l.split(); d[(int(r),a)].append(float(t))
for k in sorted(d): print('rows %d %s: median %.2f ms  (%s)  GF %.0f'%(k[0],k[1],st.median(d[k]),' '.join('%.1f'%x for x in d[k]), 2*k[0]*$K*$n*$E/st.median(d[k])/1e6))
"
