#!/usr/bin/env bash
# Two whole vgg profiles, one after the other, 4 workers at 1 Gbit/s, each worker's largest RSS sampled every 2 s
# (peaks.txt); run from /work/main (its .venv), the code under test from a worktree:
#   docs/results/profile-memory/two_vgg_profiles.sh OUT_DIR WORKTREE_SRC
# The profiles were then moved to OUT_DIR/p1/, p2/ as vgg-profile.json.
set -u
out=$1 src=$2
for r in 1 2; do
  ( OMP_NUM_THREADS=1 PYTHONPATH=$src timeout 1800 .venv/bin/python -m sparcoll plan --workload vgg --workers 4 --network 1gbit \
      --profile $out/vgg-profile-$r.json --trial 0 --json $out/vgg-plan-$r.json > $out/vgg-plan-$r.txt 2> $out/vgg-plan-$r.err; echo "rc=$?" > $out/rc-$r ) &
  peak=0
  while [ ! -f $out/rc-$r ]; do
    m=$(ps -eo rss,cmd | grep -F "forkserver import main" | grep -v grep | awk 'BEGIN{m=0} {if ($1>m) m=$1} END{print int(m/1024)}')
    [ "$m" -gt "$peak" ] && peak=$m
    sleep 2
  done
  echo "profile $r: $(cat $out/rc-$r), largest worker RSS $peak MB (sampled every 2 s)" >> $out/peaks.txt
  rm -f $out/rc-$r
  grep -v "━" $out/vgg-plan-$r.err | grep -v "^\s*$" > $out/vgg-plan-$r.err.tmp; mv $out/vgg-plan-$r.err.tmp $out/vgg-plan-$r.err
done
