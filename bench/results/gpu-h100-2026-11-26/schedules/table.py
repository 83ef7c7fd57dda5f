# Prints schedules/table.txt: each row pass and the weight gradient, the three sm90 schedules' ms and the best (run in this folder).
import json,glob,collections
rows=collections.defaultdict(dict)
for impl in ['sm90','sm90-pingpong','sm90-cooperative-256']:
    for f in glob.glob(f'{impl}-*.json'):
        if impl=='sm90' and (f.startswith('sm90-pingpong') or f.startswith('sm90-cooperative')): continue
        for r in json.load(open(f)):
            if r['shards']!=1: continue
            k=(r['preset'],r['tokens'],r['pass'])
            rows[k][impl]=r['ms']; rows[k].setdefault('auto',[]).append(r['baseline_ms']); rows[k]['dense']=r['dense_ms']
            rows[k]['shape']=(r['m'],r['E'],r['K'],r['n'])
print(f"{'preset':17} {'T':>6} {'pass':5} {'m':>7} {'K':>5} {'n':>6} {'auto':>6} {'coop128':>7} {'pingp':>6} {'coop256':>7}  best  auto/best  auto%dense best%dense")
for k in sorted(rows):
    d=rows[k]; a=sorted(d['auto'])[1]
    c={'coop128':d['sm90'],'pingpong':d['sm90-pingpong'],'coop256':d['sm90-cooperative-256']}
    b=min(c,key=c.get)
    m,E,K,n=d['shape']
    print(f"{k[0]:17} {k[1]:6} {k[2]:5} {m:7} {K:5} {n:6} {a:6.3f} {c['coop128']:7.3f} {c['pingpong']:6.3f} {c['coop256']:7.3f}  {b:8} {a/c[b]:5.2f} {100*d['dense']/a:6.1f} {100*d['dense']/c[b]:6.1f}")
