"""Merge N profiles (the same code and model) by the median of every measured number, and print the
plan's predictions from the merged one: what profiling N times would give. Run here with
PYTHONPATH=<project>/src: `python merge.py p-old-0.json more/p-h-1.json ...` (merged.txt)."""
import json, statistics, sys
from sparcoll.plan.command import make_plan
from sparcoll.plan.profiler import fit

def med(values):
    first = values[0]
    if isinstance(first, bool) or isinstance(first, str) or first is None:
        return first
    if isinstance(first, (int, float)):
        return statistics.median(values) if isinstance(first, float) else first
    if isinstance(first, list):
        if first and isinstance(first[0], (int, float)) and not isinstance(first[0], bool) and all(len(v) == len(first) for v in values):
            return [med([v[i] for v in values]) for i in range(len(first))]
        return first
    if isinstance(first, dict):
        return {k: med([v[k] for v in values]) for k in first}
    return first

def merge(profiles):
    out = dict(profiles[0])
    if len({tuple(p['model']['order']) for p in profiles}) > 1:
        print('orders differ', file=sys.stderr)
    out['model'] = med([p['model'] for p in profiles])
    key = lambda e: (e['kind'], e['what'], e['x'], e.get('tensor'), e.get('numel'))
    groups = {}
    for p in profiles:
        for e in p['points']:
            groups.setdefault(key(e), []).append(e)
    out['points'] = [{**es[0], 'seconds': statistics.median(x['seconds'] for x in es)} for es in groups.values()]
    out['fits'] = fit(out['points'])
    return out

def predictions(profile):
    plan = make_plan(profile, list(profile['compressors']))
    u = plan['uniform']
    return plan['predicted_step_s'] * 1e3, plan.get('cpu_bound_s', 0) * 1e3, u['blocktopk:0.01'] * 1e3, u['sparse'] * 1e3, u['efsignsgd'] * 1e3

if __name__ == '__main__':
    files = sys.argv[1:]
    merged = merge([json.load(open(f)) for f in files])
    print('merged', ' '.join(files), 'plan %.1f bound %.1f blocktopk %.1f sparse %.1f efsignsgd %.1f' % predictions(merged))
