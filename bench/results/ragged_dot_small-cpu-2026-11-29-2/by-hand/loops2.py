# loops2.py DISASSEMBLY REGEX: per function matching REGEX, its innermost loops holding vdpbf16ps
# or an FMA, and the vector-register accesses to the stack in them (objdump -d --no-show-raw-insn -C).
import re, sys
funcs = {}; cur = None
for line in open(sys.argv[1]):
    m = re.match(r'^([0-9a-f]+) <(.*)>:$', line)
    if m: cur = m.group(2); funcs[cur] = []; continue
    m = re.match(r'^\s+([0-9a-f]+):\t(.*)$', line)
    if m and cur: funcs[cur].append((int(m.group(1), 16), m.group(2)))
pat = sys.argv[2]
for name, ins in funcs.items():
    if not re.search(pat, name): continue
    loops = []
    for i, (addr, text) in enumerate(ins):
        m = re.match(r'j\w+\s+([0-9a-f]+)', text)
        if not m: continue
        tgt = int(m.group(1), 16)
        if tgt >= addr: continue
        body = [t for a, t in ins if tgt <= a <= addr]
        if not any('vdpbf16ps' in t or 'vfmadd' in t for t in body): continue
        # innermost: contains no other dpbf16-loop's back branch inside
        loops.append((tgt, addr, body))
    inner = [l for l in loops if not any(o is not l and l[0] <= o[0] and o[1] <= l[1] and (o[0], o[1]) != (l[0], l[1]) for o in loops)]
    for tgt, addr, body in inner:
        st = sum(1 for t in body if re.search(r'[xyz]mm', t) and 'rsp)' in t)
        dp = sum(1 for t in body if 'vdpbf16ps' in t or 'vfmadd' in t)
        short = re.sub(r'\(unsigned short const\*.*|\(float const\*.*', '', name).replace('moekit::detail::', '').replace('stream::(anonymous namespace)::', '').replace('(stream::(anonymous namespace)::From)', 'F')
        print(f'{st:3d} stack / {dp:3d} fma / {len(body):4d} ins: {short[:100]}')
