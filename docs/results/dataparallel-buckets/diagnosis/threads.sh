#!/bin/bash
# usage: threads.sh MODE -> per-thread CPU (ms per step) of one worker over 10 s
mode=$1
cd /work/main
.venv/bin/python -m sparcoll train --workload deeplight --workers 4 --network none --steps 500 --workload-option sparse_embeddings=true --compare $mode > /tmp/thr-$mode.txt 2>&1 &
sleep 10
fs=$(pgrep -f "forkserver import main" | head -1)
w=$(pgrep -P $fs | sort -n | sed -n 2p)
snap() { for t in /proc/$w/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat)"; done; }
snap > /tmp/a.txt; sleep 10; snap > /tmp/b.txt
wait
python3 - "$mode" <<'PY'
import sys,collections
a={l.split()[0]:(l.split()[1],int(l.split()[2])) for l in open('/tmp/a.txt')}
c=collections.Counter()
for l in open('/tmp/b.txt'):
    t,n,v=l.split(); 
    if t in a: c[n]+=int(v)-a[t][1]
tot=sum(c.values())
print(sys.argv[1], 'total CPU s over 10 s:', tot/100)
for n,v in c.most_common(12):
    if v: print('  %-24s %6.2f s'%(n,v/100))
PY
