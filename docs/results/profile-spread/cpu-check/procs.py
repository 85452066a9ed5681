"""Each process's CPU (user + system, in cores) over the next N seconds: python procs.py N."""
import os, time, sys
def snap():
    out = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            s = open(f'/proc/{pid}/stat').read(); cmd = open(f'/proc/{pid}/cmdline').read().replace('\0', ' ')[:100]
        except OSError: continue
        f = s.rsplit(')', 1)[1].split()
        out[pid] = (int(f[11]) + int(f[12]), cmd)
    return out
a = snap(); t = time.time(); time.sleep(float(sys.argv[1])); b = snap(); dt = time.time() - t
tot = 0
for pid, (c, cmd) in sorted(b.items(), key=lambda x: -(x[1][0] - a.get(x[0], (0,))[0])):
    d = (c - a.get(pid, (c,))[0]) / 100 / dt; tot += d
    if d > 0.005: print(f'{d:6.3f} {pid} {cmd}')
print('total', round(tot, 3))
