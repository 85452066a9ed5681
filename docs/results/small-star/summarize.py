"""Ranges over the runs in this directory: sparcoll / gloo (median, mean, async) and sparcoll's own microseconds.
    cd docs/results/small-no-polling && python3 summarize.py > summary.txt"""
import glob, collections, sys
res = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob("*-r*.txt")):
    key = f.rsplit("-r", 1)[0]
    for line in open(f):
        c = [x.strip() for x in line.split("|")]
        if len(c) > 10 and c[1].isdigit():
            g = [float(x) for x in c[2].split("/")]; s = [float(x) for x in c[3].split("/")]
            res[key][int(c[1])].append((float(c[5]), float(c[6]), float(c[10]), s[0], s[2], float(c[8])))
for key in sorted(res):
    print(key, len(next(iter(res[key].values()))), "runs: sparcoll/gloo median | mean | async ;  sparcoll us median | mean | async")
    for n, v in sorted(res[key].items()):
        r = lambda i, p=2: f"{min(x[i] for x in v):.{p}f}-{max(x[i] for x in v):.{p}f}"
        print(f"  {n:6d} {r(0)} | {r(1)} | {r(2)} ;  {r(3,0)} | {r(4,0)} | {r(5,0)}")
