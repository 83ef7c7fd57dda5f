# The share-of-the-floor tables of sweep.txt: python3 table.py sweep.txt
import re,sys
rows={}
cur=None
for line in open(sys.argv[1]):
    m=re.match(r"## (\S+) ffn (\S+) (\S+)", line)
    if m: cur=(m.group(1),m.group(2),m.group(3)); rows[cur]={}; continue
    f=line.split()
    if cur and len(f)>14 and f[1] in ("fwd","dlhs"):
        rows[cur][int(f[0])]=(f[12], f[14])
for pas in ("fwd","dlhs"):
    toks=sorted({t for k,v in rows.items() if k[2]==pas for t in v})
    print(f"\n{pas}: share of the floor (speedup over kAuto on the weights unpacked, same loop)\n")
    print("| | "+" | ".join(map(str,toks))+" |")
    print("| --- |"+" --- |"*len(toks))
    for k,v in rows.items():
        if k[2]!=pas: continue
        print(f"| {k[0]} {k[1]} | "+" | ".join(f"{v[t][0]} ({v[t][1]})" if t in v else "" for t in toks)+" |")
