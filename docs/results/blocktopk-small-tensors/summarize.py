"""One run of ab.sh: its step (the slowest rank's, mean over the timed steps) and, over every rank's
steps after the 5th, the training thread's CPU a step and its compressions' (those of tensors under 64K
elements apart). Reads RUN.json and cpu/RUN.cpu.<rank>[.gz]."""
import gzip, json, os, statistics as st, sys

run = sys.argv[1]
step = json.load(open(run + ".json"))["runs"][0]["step_s"] * 1000
cpu = os.path.join(os.path.dirname(run), "cpu", os.path.basename(run) + ".cpu")
compress, small, thread = [], [], []
for r in range(4):
    path = f"{cpu}.{r}"
    lines = open(path) if os.path.exists(path) else gzip.open(path + ".gz", "rt")
    for line in lines:
        x = json.loads(line)
        if x["step"] < 5:
            continue
        compress.append(sum(c for _, c in x["compress"]))
        small.append(sum(c for n, c in x["compress"] if n < 65536))
        thread.append(x["cpu_forward"] + x["cpu_backward"] + x["cpu_optimizer"])
print(f"{os.path.basename(run)}: step {step:.1f} ms; training thread CPU {1000 * st.mean(thread):.1f} ms a step, "
      f"compression {1000 * st.mean(compress):.2f} (tensors under 64K: {1000 * st.mean(small):.2f})")
