import collections, re, sys
lines = open(sys.argv[1]).read().splitlines()
incl, selfc, total = collections.Counter(), collections.Counter(), 0
for l in lines:
    if not l.strip(): continue
    stack, n = l.rsplit(" ", 1); n = int(n); total += n
    frames = [f for f in stack.split(";")]
    names = []
    for f in frames:
        m = re.match(r"(.*) \((.*):(\d+)\)", f)
        names.append(f"{m.group(1)} ({m.group(2).split('site-packages/')[-1].split('main/')[-1]})" if m else f)
    selfc[names[-1]] += n
    for nm in set(names):
        incl[nm] += n
print("total samples", total)
print("\n# inclusive, vllm_mixprec functions")
for nm, c in incl.most_common(400):
    if "vllm_mixprec" in nm:
        print(f"{100*c/total:5.1f}%  {nm}")
print("\n# self")
for nm, c in selfc.most_common(25):
    print(f"{100*c/total:5.1f}%  {nm}")
