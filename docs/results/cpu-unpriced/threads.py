"""CPU seconds per second of each thread of process PID over S seconds (from /proc/PID/task), each
named by py-spy's dump (its thread name and top frame). Usage: threads.py PID S"""
import os, sys, time, subprocess, re
pid = sys.argv[1]
def snap():
    out = {}
    for tid in os.listdir(f'/proc/{pid}/task'):
        try: s = open(f'/proc/{pid}/task/{tid}/stat').read()
        except OSError: continue
        f = s.rsplit(')', 1)[1].split()
        out[tid] = int(f[11]) + int(f[12])
    return out
dump = subprocess.run([os.environ.get('SPY', '/tmp/spyenv/bin') + '/py-spy', 'dump', '--pid', pid], capture_output=True, text=True).stdout
names = {}
for m in re.finditer(r'Thread (\S+) \((\w+)\): "([^"]*)"\n((?:\s+.*\n){0,3})', dump):
    names[m.group(1)] = m.group(3) + ' | ' + m.group(4).strip().split('\n')[-1].strip()[:90]
a = snap(); t0 = time.time(); time.sleep(float(sys.argv[2])); b = snap(); dt = time.time() - t0
tot = 0
for tid in sorted(b, key=lambda t: -(b[t] - a.get(t, 0))):
    d = (b[tid] - a.get(tid, 0)) / os.sysconf('SC_CLK_TCK') / dt
    tot += d
    if d > 0.002: print(f'{d:6.3f} {tid} {names.get(tid, names.get(hex(int(tid)), "?"))}')
print('total', round(tot, 3))
