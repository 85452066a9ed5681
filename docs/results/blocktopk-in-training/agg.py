import sys, glob, collections, statistics as st
rows = collections.defaultdict(list)
for f in glob.glob(sys.argv[1] + "/*.tsv"):
    for line in open(f):
        th, spec, n, wall, cpu, t = line.split("\t")
        rows[(spec, int(n), th.split("_")[0])].append((float(wall) * 1e3, float(cpu) * 1e3))
for k in sorted(rows, key=lambda k: -k[1]):
    v = rows[k]
    pass
    w = [a for a, _ in v]; c = [b for _, b in v]
    print(k, len(v), "wall med %.2f  cpu med %.2f mean %.2f  (p10 %.2f p90 %.2f)" % (st.median(w), st.median(c), st.mean(c),
          sorted(c)[len(c)//10], sorted(c)[len(c)*9//10]))
