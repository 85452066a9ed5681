#!/bin/bash
# good (0) if sparcoll's 1-float 4-rank median is below 0.94x gloo's, bad (1) otherwise; 125 = skip
cd /tmp/bisect
out=$(OMP_NUM_THREADS=1 PYTHONPATH=/tmp/bisect/src timeout 120 /work/main/.venv/bin/torchrun --standalone --nproc-per-node 4 /tmp/small/tiny4.py 2>/dev/null | grep "^s")
[ -z "$out" ] && exit 125
ratio=$(echo "$out" | python3 -c "import sys,re; v=[tuple(map(float,m)) for m in re.findall(r's(\d+)/g(\d+)', sys.stdin.read())]; print(sum(a for a,b in v)/sum(b for a,b in v))")
echo "$(git rev-parse --short HEAD) $out ratio $ratio" >> /tmp/small/bisect.log
python3 -c "import sys; sys.exit(0 if $ratio < 0.94 else 1)"
