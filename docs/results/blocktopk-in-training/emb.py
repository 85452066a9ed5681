import json, sys
for f in sys.argv[1:]:
    m = json.load(open(f))["fits"]
    s = "blocktopk:0.01"
    print(f, "in backward: wall %.2f cpu %.2f ms | alone: wall %.2f cpu %.2f ms" % (
        m["compress_own"][s]["embedding.weight"] * 1e3, m["compress_cpu_own"][s]["embedding.weight"] * 1e3,
        m["compress_alone_own"][s]["embedding.weight"] * 1e3, m["compress_cpu_alone_own"][s]["embedding.weight"] * 1e3),
        " mlp.0.weight in backward cpu %.3f" % (m["compress_cpu_own"][s]["mlp.0.weight"] * 1e3))
