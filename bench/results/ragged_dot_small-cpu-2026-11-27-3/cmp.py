import re,sys
def rows(f):
    out={}
    for l in open(f):
        m=re.match(r'\s+(\d+)\s+(fwd|dlhs|drhs)\s+all\s+\d+\s+([\d.]+)\s.*?([\d.]+)%\s+(\w+)\s*$',l)
        if m: out[(int(m.group(1)),m.group(2))]=(float(m.group(3)),float(m.group(4)),m.group(5))
    return out
a=rows(sys.argv[1]); b=rows(sys.argv[2])
print("| tokens | pass | old ms (share of floor, ran) | new ms (share of floor, ran) | new / old rate |")
print("| --- | --- | --- | --- | --- |")
for k in sorted(a):
    if k in b:
        o,n=a[k],b[k]
        print(f"| {k[0]} | {k[1]} | {o[0]:.2f} ({o[1]:.1f}%, {o[2]}) | {n[0]:.2f} ({n[1]:.1f}%, {n[2]}) | {o[0]/n[0]:.2f}x |")
