import glob, re, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob("docs/results/coo-rows-as-blocks/*-r?.txt")):
    w, net, tree, r = re.match(r".*/(\w+)-(\w+)-(old|new)-r(\d)\.txt", f).groups()
    text = open(f).read()
    get = lambda mode: [float(x) for x in re.search(rf"^{mode}\s+\S+\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M).groups()]
    p, d = get("poseidon"), get("ddp")
    rows[w, net, tree].append((int(r), p[0], d[0], d[0] / p[0], d[2] / d[0]))
for key, vals in sorted(rows.items()):
    vals.sort()
    print(*key, "DataParallel ms", [v[1] for v in vals], "DDP ms", [v[2] for v in vals],
          "x DDP", [round(v[3], 2) for v in vals], "DDP comm share", f"{min(v[4] for v in vals):.0%}-{max(v[4] for v in vals):.0%}")
