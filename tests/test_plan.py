"""The planner's core (sparcoll.plan): the option tree's pruning, the timeline simulator against
hand-computed timelines, the decision against brute force (seeded random instances), the exact
offload search against brute force, and what the profile reads of a model (its gradients' kinds,
its backward timeline)."""
import itertools
import math
import mmap
import random
import threading
import time
from dataclasses import replace

import numpy as np

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparcoll.bench.launch import BenchError
from sparcoll.bench.memory import FAULTING_PAGES, meminfo
from sparcoll.compress import make
from sparcoll.plan import decide, trial
from sparcoll.plan.options import (ALLGATHER, ALL_COMPRESSORS, COLLECTIVES, DEDICATED, PS, RING, SFB, SPARSE,
                                   JobFacts, Option, TensorFacts, options, why_invalid)
from sparcoll.plan.profile import backward_timeline, facts
from sparcoll.plan import timeline
from sparcoll.plan.timeline import Cost, Simulation, Step, advance, simulate
from pause import Pause

# What may carry each compressor scheme's payload, written out independently of the rules.
FITS = {"allreduce": {RING}, "powersgd": {RING}, "sparse": {SPARSE, DEDICATED}, "allgather": {ALLGATHER}}


def runnable(t: TensorFacts, job: JobFacts, o: Option) -> bool:
    compressed = o.compressor != "none"
    if o.collective == SFB and (not t.linear or compressed):
        return False
    if o.collective in (SPARSE, DEDICATED) and not job.communicator:
        return False
    if o.collective == DEDICATED and not job.dedicated:
        return False
    if o.offload and (not compressed or make(o.compressor).scheme == "powersgd" or not job.offload_core):
        return False
    if t.coo and (o.collective == PS or o.offload or (compressed and not make(o.compressor).entries)):
        return False
    if not compressed:
        return o.collective != ALLGATHER
    return o.collective in FITS[make(o.compressor).scheme] and o.collective != PS


tensor_facts = st.builds(TensorFacts, name=st.just("t"), numel=st.integers(1, 10**8), linear=st.booleans(),
                  coo=st.booleans())
jobs = st.builds(JobFacts, dedicated=st.booleans(), communicator=st.booleans(), offload_core=st.booleans())


@settings(max_examples=60, deadline=None)
@given(tensor_facts, jobs)
def test_no_invalid_combination_survives_and_no_valid_one_is_lost(tensor, job):
    valid = set(options(tensor, job, ALL_COMPRESSORS))
    for compressor in ALL_COMPRESSORS:
        for collective in COLLECTIVES:
            for offload in (False, True):
                option = Option(compressor, collective, offload)
                assert (option in valid) == runnable(tensor, job, option), option
                assert (why_invalid(tensor, job, option) is None) == (option in valid)
    assert Option() in valid                       # the ring, uncompressed, always runs


def test_by_default_the_planner_chooses_among_compressors_that_kept_the_loss():
    """The planner chooses by speed: its default candidates leave out the compressors that fell more
    than 5% behind DDP's loss in the convergence runs; `--compressors all` brings them back."""
    from sparcoll.plan.command import _compressors
    from sparcoll.plan.options import COMPRESSORS, HURT_CONVERGENCE
    assert set(COMPRESSORS) | set(HURT_CONVERGENCE) == set(ALL_COMPRESSORS)
    assert not set(COMPRESSORS) & {"randomk:0.01", "topk:0.01", "dgc:0.01", "terngrad"}
    assert {"none", "blocktopk:0.01", "powersgd:4"} <= set(COMPRESSORS)
    assert _compressors("all") == list(ALL_COMPRESSORS) and _compressors("none,fp16") == ["none", "fp16"]


def test_the_planners_compressors_always_include_no_compression_and_a_bad_spec_stops_before_the_profile(capsys):
    """`--compressors blocktopk:0.01` once failed after the profile's minutes with "min() arg is an empty
    sequence" (no uncompressed option to start each tensor from); a misspelled spec, with a traceback."""
    import argparse

    from sparcoll.plan.command import _compressors, add_arguments
    assert _compressors("blocktopk:0.01") == ["none", "blocktopk:0.01"]
    assert _compressors(" fp16, none ,fp16") == ["none", "fp16"]
    assert _compressors("topk:0.01,ef=off,fp16") == ["none", "topk:0.01,ef=off", "fp16"]     # as train's --compress
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for bad, says in (("blocktopk:x", "bad RATIO 'x'"), ("fp16,topq:0.1", "unknown compressor 'topq'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--compressors", bad])
        assert says in capsys.readouterr().err


def test_a_pruned_option_says_why():
    assert "linear" in why_invalid(TensorFacts("b", 10), JobFacts(), Option(collective=SFB))
    assert "gathered" in why_invalid(TensorFacts("w", 10), JobFacts(), Option("topk:0.01", RING))
    assert "offload" in why_invalid(TensorFacts("w", 10), JobFacts(), Option(offload=True))


def test_a_gap_hides_a_tensor():
    # tensor 0 ready at 0 sends for 0.5 s and is done long before tensor 1 is ready at 1.0
    step = Step((0.0, 1.0), 1.0)
    timeline = simulate(step, [Cost(comm=0.5), Cost(comm=0.5)])
    assert timeline.comm_start == [0.0, 1.0] and timeline.comm_end == [0.5, 1.5]
    assert timeline.iteration == 1.5
    assert Simulation(step, [Cost(comm=0.5), Cost(comm=0.5)]).with_cost(0, Cost()) == 1.5


def test_the_channel_serializes():
    timeline = simulate(Step((0.0, 0.1), 0.2, optimizer=0.05), [Cost(comm=1.0), Cost(comm=1.0, decompress=0.25)])
    assert timeline.comm_start == [0.0, 1.0] and timeline.comm_end == [1.0, 2.25]
    assert timeline.iteration == 2.3


def test_the_step_is_no_shorter_than_the_workers_cpu_allows():
    """The timeline alone: tensor 0 on the channel 0-0.01, tensor 1 0.01-0.02, backward done at
    0.02, the optimizer 0.005 after: F 0.025. The workers' CPU: 0.03 s of the step's own and 0.01 of
    the tensors' on half a core each, 0.08 s, of which F is what follows the 0.01 s forward: 0.07.
    With 2 cores each the CPU takes 0.02 s and the timeline sets F; cores unknown, no bound."""
    costs = [Cost(comm=0.01, cpu=0.004), Cost(comm=0.01, cpu=0.006)]
    step = Step((0.0, 0.01), 0.02, optimizer=0.005, cpu=0.03, cores=0.5, forward=0.01)
    assert simulate(step, costs).iteration == pytest.approx(0.07)
    assert simulate(replace(step, cores=2.0), costs).iteration == pytest.approx(0.025)
    assert simulate(replace(step, cores=0.0), costs).iteration == pytest.approx(0.025)
    # what the decision searches with prices operations alone: the CPU is simulate's
    assert Simulation(step, costs).iteration == pytest.approx(0.025)


def test_the_cores_stand_idle_while_every_worker_waits_after_backward():
    """Tensor 1 compressed on the training thread for 5 ms once ready at 10 ms: backward ends at 25
    ms, its collective runs 15-35 ms and decompresses until 45; of its 9 ms of CPU, 4 are beyond the
    compression, spread over those 30 ms: 2.67 of them after backward, which keep the half core of
    each worker busy for 5.33 ms. So for 20 - 5.33 = 14.67 ms the cores stand idle and do not serve
    the CPU bound (0.086 s of CPU over half a core, less the 10 ms forward: 76 ms): F 90.67 ms.
    Offloaded, backward ends at 20 ms and the lane's compression (10-15 ms) is before it: idle
    25 - 2 x 4 x 25 / 30 = 18.33 ms, F 94.33."""
    step = Step((0.0, 0.01), 0.02, optimizer=0.005, cpu=0.03, cores=0.5, forward=0.01)
    second = Cost(compress=0.005, comm=0.02, decompress=0.01, cpu=0.009, compress_cpu=0.005)
    costs = [Cost(comm=0.01, cpu=0.004), second]
    assert simulate(step, costs).iteration == pytest.approx(0.076 + 0.02 - 2 * 0.004 * 2 / 3)
    assert simulate(step, [costs[0], replace(second, offload=True)]).iteration == pytest.approx(
        0.076 + 0.025 - 2 * 0.004 * 25 / 30)
    assert simulate(step, costs).idle == pytest.approx(0.02 - 2 * 0.004 * 2 / 3)
    # with a core each the timeline sets F: the collective's end and the optimizer; a worker's
    # collectives keep only its own core busy, however many it has (a core each: 17.33 ms idle)
    assert simulate(replace(step, cores=2.0), costs).iteration == pytest.approx(0.05)
    assert simulate(replace(step, cores=2.0), costs).idle == pytest.approx(0.02 - 0.004 * 2 / 3)


def test_an_offloaded_lane_overlaps_and_on_thread_compression_delays_backward():
    costs = [Cost(compress=0.5, comm=0.2, offload=True), Cost(compress=0.5, comm=0.2)]
    timeline = simulate(Step((0.0, 0.3), 1.0, optimizer=0.1), costs)
    assert timeline.payload_ready == [0.5, 0.8]      # lane 0-0.5; the thread compresses 0.3-0.8
    assert timeline.comm_start == [0.5, 0.8] and timeline.comm_end == [0.7, 1.0]
    assert timeline.backward_end == 1.5              # backward pushed by the on-thread 0.5 s
    assert timeline.iteration == 1.6
    # offloaded behind a busy lane: tensor 1 waits for the lane, backward is not delayed
    both = simulate(Step((0.0, 0.3), 1.0), [costs[0], Cost(compress=0.5, comm=0.2, offload=True)])
    assert both.payload_ready == [0.5, 1.0] and both.iteration == 1.2


def test_a_ring_collective_on_gloos_lane_holds_the_channel_only_for_its_share_of_the_link():
    """DataParallel starts an uncompressed ring collective on gloo and goes on: the next tensor's
    collective waits only for the ring's `hold` (the link), gloo runs its collectives one at a time,
    and the step waits for gloo's last."""
    step = Step((0.0, 0.1), 0.2)
    beside = simulate(step, [Cost(comm=1.0, hold=0.25), Cost(comm=0.5)])
    assert beside.comm_start == [0.0, 0.25] and beside.comm_end == [1.0, 0.75]
    assert beside.iteration == 1.0
    assert simulate(step, [Cost(comm=1.0), Cost(comm=0.5)]).iteration == 1.5      # on the channel
    two = simulate(step, [Cost(comm=1.0, hold=0.25), Cost(comm=0.5, hold=0.1)])
    assert two.comm_start == [0.0, 1.0] and two.comm_end == [1.0, 1.5]            # gloo serializes
    for costs in ([Cost(comm=1.0, hold=0.25), Cost(comm=0.5)],
                  [Cost(comm=1.0, hold=0.25), Cost(comm=0.5, hold=0.1)]):
        assert Simulation(step, costs).iteration == simulate(step, costs).iteration
    # under load: 0.2 s of backward work at half rate overlaps the ring's first 0.4 s, in which it
    # advances at half its rate (1.0 alone, 2.0 loaded): 1.2 s in all, its hold stretched alike to
    # 0.3 s, for which backward runs at half rate (0.15 s of work), the rest after: backward ends at
    # 0.35; tensor 1's 0.1 s of work is done at 0.2 and waits for the hold
    loaded = simulate(step, [Cost(comm=1.0, hold=0.25, loaded=2.0, slowdown=2.0), Cost(comm=0.5)])
    assert loaded.comm_start == pytest.approx([0.0, 0.3]) and loaded.comm_end == pytest.approx([1.2, 0.8])
    assert loaded.backward_end == pytest.approx(0.35) and loaded.iteration == pytest.approx(1.2)


def test_collectives_and_backward_slow_each_other_down_hand_computed():
    """Backward has 0.3 s of work; tensor 0 (ready at 0.1) communicates under load for 0.2 s while
    backward runs at half its rate, so tensor 1's 0.2 s of work is ready at 0.3; its communication
    (0.15 s under load, backward at 1/1.5) ends exactly with backward, at 0.45; tensor 2, ready at
    backward's end, starts after it and takes its time alone."""
    step = Step((0.1, 0.2, 0.3), 0.3, optimizer=0.01)
    costs = [Cost(comm=0.1, loaded=0.2, slowdown=2.0), Cost(comm=0.05, loaded=0.15, slowdown=1.5),
             Cost(comm=0.02, loaded=0.5, slowdown=3.0)]
    timeline = simulate(step, costs)
    assert timeline.payload_ready == pytest.approx([0.1, 0.3, 0.45])
    assert timeline.comm_start == pytest.approx([0.1, 0.3, 0.45])
    assert timeline.comm_end == pytest.approx([0.3, 0.45, 0.47])
    assert timeline.backward_end == pytest.approx(0.45) and timeline.iteration == pytest.approx(0.48)
    # on-thread compression is backward's work too: slowed alike, and it pushes what follows
    pushed = simulate(step, [Cost(comm=0.1, loaded=0.2, slowdown=2.0), Cost(compress=0.05, comm=0.01)])
    # 0.25 s of work: 0.2 done at 0.3 (at half rate from 0.1), the rest at full rate after the interval
    assert pushed.payload_ready[1] == pytest.approx(0.35) and pushed.backward_end == pytest.approx(0.45)
    # backward ends during a communication: 0.1 s of work at half rate overlaps its first 0.2 s, in
    # which it advances at 1/3 of its rate (0.1 s alone, 0.3 s loaded); the rest at full rate
    partly = simulate(Step((0.0,), 0.1), [Cost(comm=0.1, loaded=0.3, slowdown=2.0)])
    assert partly.backward_end == pytest.approx(0.2)
    assert partly.comm_end[0] == pytest.approx(0.2 + (0.1 - 0.2 / 3)) and partly.iteration == partly.comm_end[0]
    # with workers sharing cores, the CPU bound prices contention: each operation takes its time alone
    shared = simulate(replace(step, cores=0.5), costs)
    assert shared.comm_start == pytest.approx([0.1, 0.2, 0.3]) and shared.comm_end == pytest.approx([0.2, 0.25, 0.32])
    assert shared.backward_end == pytest.approx(0.3) and shared.iteration == pytest.approx(0.33)


def test_without_contention_measured_the_timeline_is_the_searches_max_plus_one():
    """simulate() walks backward's work through the channel's busy intervals; Simulation moves the
    lanes' state by maxima and sums. With no contention they are the same model."""
    rng = random.Random(15)
    for _ in range(40):
        step, tensors = instance(rng, rng.randint(1, 12), 3, offload=True)
        costs = [rng.choice(list(t.costs.values())) for t in tensors]
        got, lanes = simulate(step, costs), Simulation(step, costs)
        ends = [state[2] if cost.hold is None else state[3] for state, cost in zip(lanes.states[1:], costs)]
        assert got.comm_end == pytest.approx(ends, abs=1e-12)
        assert got.backward_end == pytest.approx(step.backward_end + lanes.states[-1][0], abs=1e-12)
        assert got.iteration == pytest.approx(lanes.iteration, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(1, 4)), max_size=8),
       st.floats(0, 10))
def test_backwards_work_and_time_are_inverse_along_the_busy_channel(gaps, work):
    busy, t = timeline._Busy(), 0.0
    for gap, length, slowdown in gaps:
        busy.add(t + gap, t + gap + length, slowdown)
        t += gap + length
    at = busy.time_of(work)
    assert at >= work - 1e-9 and busy.work_at(at) == pytest.approx(work, abs=1e-9)
    assert at <= work * max([1.0] + [g[2] for g in gaps]) + 1e-9


def test_a_changed_cost_gives_the_iteration_time_of_a_full_simulation():
    """Simulation.with_cost reads F off per-tensor terms; simulate() walks the whole changed
    timeline: they agree, for every tensor and option of random strategies, across updates."""
    rng = random.Random(13)
    for _ in range(40):
        step, tensors = instance(rng, rng.randint(1, 12), rng.randint(1, 4), offload=True)
        strategy = [rng.choice(list(t.costs)) for t in tensors]
        sim = Simulation(step, [t.costs[o] for t, o in zip(tensors, strategy)])
        for _ in range(3):
            for i, t in enumerate(tensors):
                for option, cost in t.costs.items():
                    changed = [tensors[j].costs[o] for j, o in enumerate(strategy)]
                    changed[i] = cost
                    assert sim.with_cost(i, cost) == pytest.approx(simulate(step, changed).iteration,
                                                                   rel=1e-12, abs=1e-12)
            i = rng.randrange(len(tensors))
            strategy[i] = rng.choice(list(tensors[i].costs))
            sim.set(i, tensors[i].costs[strategy[i]])
            assert sim.iteration == simulate(step, [tensors[j].costs[o] for j, o in enumerate(strategy)]).iteration


def instance(rng: random.Random, n: int, kinds: int, offload: bool = False):
    """n tensors of `kinds` kinds (equal size and costs within a kind), each with a raw option, a
    cheaper-to-send compressed one and (with `offload`) its offloaded variant."""
    ready = sorted(rng.uniform(0, 1) for _ in range(n))
    step = Step(tuple(ready), ready[-1] + rng.uniform(0, 0.5), rng.uniform(0, 0.1))
    kinds_costs = []
    for _ in range(kinds):
        size = rng.choice([1, 2, 4, 8])
        raw, ring = Cost(comm=rng.uniform(0, 0.4) * size), Cost(comm=rng.uniform(0, 0.4) * size)
        if rng.random() < 0.5:          # on gloo's lane, holding the channel for part of its time
            ring = Cost(comm=ring.comm, hold=ring.comm * rng.uniform(0, 1))
        compressed = Cost(rng.uniform(0, 0.3) * size, rng.uniform(0, 0.1) * size, rng.uniform(0, 0.05))
        kinds_costs.append((size, raw, ring, compressed))
    tensors = []
    for i in range(n):
        size, raw, ring, c = kinds_costs[rng.randrange(kinds)]
        costs = {Option(collective=SPARSE): raw, Option(): ring, Option("fp16"): c}
        if offload:
            costs[Option("fp16", offload=True)] = Cost(c.compress * rng.uniform(1, 1.5), c.comm,
                                                      c.decompress, True)
        tensors.append(decide.Choices(f"t{i}", size, costs))
    return step, tensors


def f_of(step, tensors, strategy) -> float:
    return Simulation(step, [t.costs[o] for t, o in zip(tensors, strategy)]).iteration


def test_the_decision_equals_brute_force():
    """plan() on random instances of up to 8 tensors with 3 options each: the best F, exactly (its
    frontier search keeps every undominated state there, the beam never truncates). ByteComp's greedy
    alone is not: it stays on the right side of brute force but missed by up to 59% here (the reason
    plan() also runs the frontier search)."""
    rng = random.Random(11)
    greedy_worst = 0.0
    for _ in range(150):
        step, tensors = instance(rng, rng.randint(1, 8), rng.randint(1, 4))
        best = decide.brute_force(step, tensors)[1]
        got = f_of(step, tensors, decide.plan(step, tensors))
        greedy = f_of(step, tensors, decide.greedy(step, tensors))
        assert got == pytest.approx(best, rel=1e-12, abs=0) and greedy >= best - 1e-12
        greedy_worst = max(greedy_worst, greedy / best - 1)
    assert greedy_worst > 0.03          # the instances are hard enough to tell the two apart


def test_offload_search_equals_brute_force():
    rng = random.Random(12)
    for _ in range(60):
        step, tensors = instance(rng, rng.randint(1, 12), rng.randint(1, 4), offload=True)
        chosen = [rng.choice([Option(), Option("fp16")]) for _ in tensors]
        got = decide.offload_search(step, tensors, chosen)
        assert [o.compressor for o in got] == [o.compressor for o in chosen]
        assert f_of(step, tensors, got) == pytest.approx(decide.brute_force_offload(step, tensors, chosen),
                                                         rel=0, abs=1e-12)


def test_the_frontier_moves_every_state_as_the_simulator_does():
    """The frontier search's vectorized step against timeline.advance, state by state and cost by
    cost: on-thread, offloaded and plain costs, with SFB's `sooner`, from states where each lane leads."""
    rng = random.Random(14)
    for _ in range(30):
        step = Step(tuple(sorted(rng.uniform(0, 1) for _ in range(3))), 1.0)
        lanes = np.array([[rng.uniform(0, 0.3)] + [rng.uniform(0, 1.5) for _ in range(3)] for _ in range(5)])
        costs = [Cost(rng.choice([0.0, rng.uniform(0, 0.2)]), rng.uniform(0, 0.5), rng.uniform(0, 0.05),
                      rng.random() < 0.5, rng.choice([0.0, rng.uniform(0, 0.3)])) for _ in range(3)]
        costs.append(Cost(comm=rng.uniform(0, 0.5), hold=rng.uniform(0, 0.2)))     # on gloo's lane
        i = rng.randrange(3)
        got = decide._advance_all(step.ready[i], lanes, costs)
        want = [advance(step, tuple(state), i, cost)[0] for state in lanes.tolist() for cost in costs]
        assert got.tolist() == [list(w) for w in want]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 3).map(float)] * 4), min_size=1, max_size=40),
       st.integers(1, 50))
def test_the_frontier_keeps_exactly_the_undominated_lane_states(lanes, beam):
    """Against the definition, with many ties: a state is dropped iff another is at most it in every
    lane (of equal states one is kept); beyond `beam`, the kept are the smallest by the bound."""
    array = np.array(lanes)
    pareto = {a for a in lanes
              if not any(all(x <= y for x, y in zip(b, a)) and b != a for b in lanes)}
    kept = [lanes[k] for k in decide._undominated(array, array.sum(axis=1), beam)]
    assert len(kept) == len(set(kept)) == min(beam, len(pareto))
    assert set(kept) <= pareto
    dropped = pareto - set(kept)
    if dropped:
        assert max(map(sum, kept)) <= min(map(sum, dropped))


def test_the_plan_never_loses_to_every_tensor_uncompressed():
    rng = random.Random(13)
    for _ in range(40):
        step, tensors = instance(rng, rng.randint(1, 30), 3, offload=True)
        plain = [decide.uncompressed(t) for t in tensors]
        assert f_of(step, tensors, decide.plan(step, tensors)) <= f_of(step, tensors, plain) + 1e-12


def test_a_compressor_on_the_dense_gradients_only_leaves_the_sparse_ones_uncompressed():
    from sparcoll.plan.command import dense_only_of, uniform
    ring, sparse, topk = Option(), Option(collective=SPARSE), Option("topk:0.01", ALLGATHER)
    mlp = decide.Choices("mlp", 1000, {ring: Cost(comm=0.005), topk: Cost(0.001, 0.001)})
    table = decide.Choices("table", 10**6, {ring: Cost(comm=0.020), sparse: Cost(comm=0.004),
                                            topk: Cost(0.001, 0.002)})
    plain_table = decide.Choices("table", 10**6, {ring: Cost(comm=0.020), sparse: Cost(comm=0.004)})
    tensors, coo = [mlp, table, mlp], [False, True, False]
    uniforms = {"topk:0.01": uniform(tensors, "topk:0.01", None)}
    assert uniforms["topk:0.01"] == [topk, topk, topk]          # the table too: top-k takes its rows
    # the table keeps its cheapest uncompressed collective (the sparse AllReduce, not the ring)
    assert dense_only_of(tensors, coo, ["none", "topk:0.01"], uniforms) == {"topk:0.01": [topk, sparse, topk]}
    # nothing beyond the uniform strategy: no sparse gradient, or none the compressor could take
    assert dense_only_of(tensors, [False] * 3, ["topk:0.01"], uniforms) == {}
    alike = [mlp, plain_table, mlp]
    assert dense_only_of(alike, coo, ["topk:0.01"], {"topk:0.01": uniform(alike, "topk:0.01", None)}) == {}
    # a compressor no dense gradient can take has no such strategy
    assert dense_only_of([table], [True], ["topk:0.01"], {"topk:0.01": [topk]}) == {}


def test_the_trial_trains_the_lossless_uniform_strategy_predicted_best_whatever_its_rank(monkeypatch):
    from sparcoll.plan import command
    monkeypatch.setattr(command, "make_plan", lambda profile, compressors, dimensions=(), fixed=None,
                        fused_by="greedy", dense_only=False: (fixed, tuple(dimensions), fused_by, dense_only))
    plan = {"uniform": {"fp16": 1.0, "onebit": 1.1, "qsgd:16": 1.2, "topk:0.01": 1.3, "sparse": 1.4,
                        "ring": 1.5, "ps": 2.0}, "dense_only": {"onebit": 0.95, "fp16": 0.9}}
    others = command.trial_others(plan, {}, ["none"], "greedy")
    assert others == {"without compression": (None, ("compression",), "greedy", False),
                      "without collective": (None, ("collective",), "greedy", False),
                      "without offload": (None, ("offload",), "greedy", False),
                      "uniform fp16": ("fp16", (), "greedy", False),
                      "uniform onebit": ("onebit", (), "greedy", False),
                      "uniform qsgd:16": ("qsgd:16", (), "greedy", False),
                      "uniform sparse": ("sparse", (), "greedy", False),       # 5th, but the best lossless
                      "planned, whole fusion": (None, (), "whole", False),
                      "uniform fp16, whole fusion": ("fp16", (), "whole", False),
                      "fp16 for dense gradients": ("fp16", (), "greedy", True)}
    plan["uniform"]["ring"] = 1.05             # a lossless one among the three best: no fourth
    uniforms = {k for k in command.trial_others(plan, {}, ["none"], "greedy") if k.startswith("uniform ")}
    assert uniforms == {"uniform fp16", "uniform ring", "uniform onebit", "uniform fp16, whole fusion"}


def plan_of(*strategies: str, units: tuple[int, ...] | None = None) -> dict:
    """A plan of one tensor per strategy, each its own unit unless `units` says which each shares."""
    return {"tensors": [{"name": f"t{i}", "strategy": s, "placement": "thread", "unit": i if units is None else units[i]}
                        for i, s in enumerate(strategies)]}


def test_a_trial_runs_each_distinct_strategy_once_the_plan_first():
    """Distinct: a tensor's strategy, placement or unit differs (units that share a collective run
    differently from the same units apart)."""
    plan = plan_of("ring", "topk:0.01")
    others = {"without compression": plan_of("ring", "ring"), "without collective": plan_of("ring", "topk:0.01"),
              "uniform ring": plan_of("ring", "ring"), "uniform topk:0.01": plan_of("topk:0.01", "topk:0.01"),
              "uniform ring, whole fusion": plan_of("ring", "ring", units=(0, 0)),
              "uniform topk:0.01, whole fusion": plan_of("topk:0.01", "topk:0.01", units=(0, 1))}
    got = trial.candidates(plan, others)
    assert list(got) == ["planned", "without compression", "uniform topk:0.01", "uniform ring, whole fusion"]
    assert got["planned"] is plan


def test_a_trial_keeps_the_fastest_unless_the_model_clearly_ranks_those_level_with_it():
    """Beyond the margin the measurement decides; within it, the model where it puts one candidate
    more than the margin ahead of the others, else the fastest measured of those the model sees level."""
    margin = trial.MARGIN
    predicted = {"planned": 0.8, "uniform sfb": 0.9, "uniform ring": 0.95, "without compression": 0.85}
    assert trial.choose({"planned": 1.0, "uniform sfb": 1.0 / (1 + margin / 2), "uniform ring": 3.0},
                        predicted=predicted) == "planned"                     # the model puts it 12% ahead
    assert trial.choose({"planned": 1.0, "uniform sfb": 0.8, "without compression": 0.9},
                        predicted=predicted) == "uniform sfb"                 # clearly faster
    assert trial.choose({"planned": 0.5, "uniform sfb": 0.8}, predicted=predicted) == "planned"
    assert trial.choose({"uniform sfb": 0.8, "uniform ring": 0.9}, predicted=predicted) == "uniform sfb"
    level = {"planned": 1.2, "uniform topk": 1.0, "without collective": 1.0 + margin / 2}
    ranks = {"planned": 0.8, "uniform topk": 0.95, "without collective": 0.9}
    assert trial.choose(level, predicted=ranks) == "without collective"
    assert trial.choose({**level, "without collective": 1.0 + 2 * margin}, predicted=ranks) == "uniform topk"
    # the model sees them level too (ncf with sparse embeddings: 29.8 against 30.2 ms predicted): measured
    tie = {"planned": 0.0321, "uniform sparse": 0.0319}
    assert trial.choose(tie, predicted={"planned": 0.0298, "uniform sparse": 0.0302}) == "uniform sparse"
    assert trial.choose(tie, predicted={"planned": 0.0253, "uniform sparse": 0.0268}) == "planned"
    # of three the model sees one clearly behind: the fastest measured of the two it sees level
    three = {"planned": 1.0, "uniform sparse": 1.01, "uniform ring": 0.99}
    assert trial.choose(three, predicted={"planned": 1.0, "uniform sparse": 1.01, "uniform ring": 1.5}) == "planned"
    assert trial.choose(three) == "uniform ring"                               # no predictions: measured


def test_a_trial_keeps_a_lossless_candidate_level_with_the_fastest():
    """Within the margin the candidates are level: a lossless one is kept over a lossy plan, and of
    lossless ones the model's or the measurement's choice; beyond the margin speed decides."""
    margin = trial.MARGIN
    near = 1.0 * (1 + margin / 2)
    step_s = {"planned": 1.0, "without compression": near, "uniform sfb": near * 1.001, "uniform topk": 0.99}
    predicted = {"planned": 0.5, "without compression": 0.6, "uniform sfb": 0.6, "uniform topk": 0.7}
    assert trial.choose(step_s, {"without compression", "uniform sfb"}, predicted=predicted) == "without compression"
    assert trial.choose(step_s, {"planned", "uniform sfb"}, predicted=predicted) == "planned"
    assert trial.choose(step_s, predicted=predicted) == "planned"
    assert trial.choose({**step_s, "without compression": 1.1}, {"without compression"},
                        predicted=predicted) == "planned"
    assert trial.choose({"planned": 1.0, "uniform topk": 0.8, "uniform sfb": 0.81}, {"uniform sfb"},
                        predicted=predicted) == "uniform sfb"
    assert trial.lossless({"tensors": [{"strategy": "ring"}, {"strategy": "sfb"}, {"strategy": "sparse"}]})
    assert not trial.lossless({"tensors": [{"strategy": "ps"}, {"strategy": "fp16"}]})


def test_a_candidate_whose_trial_fails_is_left_out_and_the_others_still_run(monkeypatch):
    """A fake launcher: each candidate reports steps of its own duration, one fails midway (and is
    not run again in the later passes), DDP's reference runs in every pass."""
    durations = {"planned": 0.3, "uniform sfb": None, "uniform ring": 0.5, trial.DDP: 0.8}
    launched = []

    def launch(config, workers, network, timeout, on_event):
        name = trial.DDP if config["comm"] == "ddp" else config["strategy"]["name"]
        launched.append(name)
        seconds = durations[name]
        for step in range(config["steps"]):
            if seconds is None and step == 1:
                raise BenchError("worker 2 exited with status 1")
            on_event({"event": "step", "step_s": 9.0 if step == 0 else (seconds or 1.0), "comm_s": 0.2})
            on_event({"event": "trace"})
    monkeypatch.setattr(trial, "launch", launch)
    advanced = []
    plans = {n: {"name": n} for n in durations if n != trial.DDP}
    step_s, failed, reference, passes = trial.measure({}, plans, 4, "none", 3, 1, 10.0, advanced.append, 3)
    assert step_s == pytest.approx({"planned": 0.3, "uniform ring": 0.5})      # the warm-up left out
    assert passes == {"planned": [pytest.approx(0.3)] * 2, "uniform ring": [pytest.approx(0.5)] * 2}
    assert reference == {"step_s": pytest.approx(0.8), "comm_share": pytest.approx(0.25)}
    assert list(failed) == ["uniform sfb"] and "status 1" in failed["uniform sfb"]
    assert launched == ["planned", "uniform sfb", "uniform ring", trial.DDP, trial.DDP, "uniform ring", "planned"]
    assert len(advanced) == trial.PASSES * 4 * 4                               # the progress bar completes
    durations.update({"planned": None, "uniform ring": None, trial.DDP: None})
    with pytest.raises(BenchError, match="every candidate"):
        trial.measure({}, plans, 4, "none", 3, 1, 10.0, advanced.append)
    durations.update({"planned": 0.3})
    step_s, failed, reference, _ = trial.measure({}, plans, 4, "none", 3, 1, 10.0, advanced.append, 3)
    assert list(step_s) == ["planned"] and "status 1" in reference["failed"] and trial.DDP not in failed
    launched.clear()
    durations.update({"uniform ring": 0.5, trial.DDP: 0.8})
    step_s, _, _, passes = trial.measure({}, plans, 4, "none", 3, 1, 10.0, advanced.append, 3, passes=1)
    assert launched == ["planned", "uniform sfb", "uniform ring", trial.DDP]    # one pass, in order
    assert passes == {"planned": [pytest.approx(0.3)], "uniform ring": [pytest.approx(0.5)]}


def test_a_machine_slowing_down_during_the_trial_favours_no_candidate(monkeypatch):
    """Three equal candidates on a machine whose every launch runs 10% slower than the one before:
    measured once each, in order, the first would win by 20%; in passes of alternating order each
    candidate's mean is the same."""
    launches = []

    def launch(config, workers, network, timeout, on_event):
        launches.append(config["strategy"]["name"])
        for _ in range(config["steps"]):
            on_event({"event": "step", "step_s": 0.1 * (1 + 0.1 * (len(launches) - 1)), "comm_s": 0.0})
    monkeypatch.setattr(trial, "launch", launch)
    monkeypatch.setattr(trial, "PASSES", 2)
    plans = {n: {"name": n} for n in ("planned", "uniform sfb", "uniform ring")}
    step_s, _, _, passes = trial.measure({}, plans, 4, "none", 3, 1, 10.0, lambda what: None)
    assert passes["planned"][0] < passes["uniform ring"][0] / 1.15              # the drift is there ...
    assert step_s == pytest.approx(dict.fromkeys(plans, step_s["planned"]))    # ... and cancels out


def test_a_candidate_of_short_steps_trains_longer(monkeypatch):
    """At least the steps asked for, and enough for trial.SECONDS by the predicted step, at most
    trial.MOST_STEPS; the fake launcher sees as many steps as measure asks for."""
    assert trial.steps_of({"predicted_step_s": 10.0}, 3) == 3
    assert trial.steps_of({"predicted_step_s": trial.SECONDS / 7.5}, 3) == 8
    assert trial.steps_of({"predicted_step_s": 1e-4}, 3) == trial.MOST_STEPS
    assert trial.steps_of({}, 3) == 3
    asked = {}

    def launch(config, workers, network, timeout, on_event):
        asked[config["strategy"]["name"]] = config["steps"]
        for _ in range(config["steps"]):
            on_event({"event": "step", "step_s": 0.01})
    plans = {"planned": {"name": "planned", "predicted_step_s": trial.SECONDS / 7.5},
             "uniform ring": {"name": "uniform ring", "predicted_step_s": 10.0}}
    monkeypatch.setattr(trial, "launch", launch)
    trial.measure({}, plans, 4, "none", 3, 1, 10.0, lambda what: None)
    assert asked == {"planned": 1 + 8, "uniform ring": 1 + 3}


def test_an_interleaved_trial_runs_every_candidate_in_one_job_and_leaves_out_fresh_memory(monkeypatch):
    """A fake launcher: a job of several modes reports a step of each in turn (mode index in each
    event), a slow patch of the machine makes every step of one part of the job 50% slower (whatever
    mode: it must favour none), one step of "uniform ring" took fresh memory (left out, or it would
    look slower than "planned"); DDP's reference runs in a job of its own after them."""
    durations = {"planned": 0.30, "uniform ring": 0.30, "uniform sfb": 0.45}
    launched = []

    def launch(config, workers, network, timeout, on_event):
        if config["comm"] == "ddp":
            launched.append(trial.DDP)
            for _ in range(config["steps"]):
                on_event({"event": "step", "step_s": 0.8, "comm_s": 0.4, "page_faults": 0})
            return
        names = [m["strategy"]["name"] for m in config["modes"]]
        launched.append(tuple(names))
        assert all(m["comm"] == trial.PLANNED for m in config["modes"])
        for step in range(config["steps"]):
            slow = 1.5 if 3 <= step < 6 else 1.0
            for index, name in enumerate(names):
                fresh = name == "uniform ring" and step == 4
                on_event({"event": "step", "mode": index, "step": step, "comm_s": 0.1,
                          "step_s": 9.0 if step == 0 else (1.0 if fresh else durations[name] * slow),
                          "page_faults": FAULTING_PAGES if fresh else 10})
    monkeypatch.setattr(trial, "launch", launch)
    advanced = []
    plans = {n: {"name": n, "predicted_step_s": 10.0} for n in durations}
    step_s, failed, reference, passes = trial.measure({}, plans, 4, "none", 8, 1, 10.0,
                                                      lambda what, more=0: advanced.append(more), 8,
                                                      interleave=True)
    assert launched == [tuple(plans), trial.DDP, trial.DDP, tuple(plans)]      # DDP apart, reversed
    assert step_s["planned"] == pytest.approx(step_s["uniform ring"])          # fresh memory left out
    assert step_s["uniform sfb"] == pytest.approx(1.5 * step_s["planned"])
    # the warm-up left out, and step 4 for every candidate: 5 steps as fast, 2 slow
    assert step_s["planned"] == pytest.approx(0.3 * (5 + 2 * 1.5) / 7)
    assert reference == {"step_s": pytest.approx(0.8), "comm_share": pytest.approx(0.5)} and failed == {}
    assert all(len(p) == trial.PASSES for p in passes.values())
    assert len(advanced) == trial.PASSES * (3 * 9 + 9) and not any(advanced)    # the bar completes


def test_an_interleaved_trial_that_fails_trains_every_candidate_apart(monkeypatch):
    """One candidate cannot run: the interleaved job fails, and the trial goes on in jobs of their
    own, where only that one is left out; the bar grows by the steps run again."""
    launched = []

    def launch(config, workers, network, timeout, on_event):
        modes = config.get("modes") or [config]
        names = [trial.DDP if m["comm"] == "ddp" else m["strategy"]["name"] for m in modes]
        launched.append(tuple(names))
        for step in range(config["steps"]):
            for index, name in enumerate(names):
                if name == "uniform sfb" and step == 1:
                    raise BenchError("worker 2 exited with status 1")
                on_event({"event": "step", "mode": index, "step_s": 0.3, "comm_s": 0.1})
    monkeypatch.setattr(trial, "launch", launch)
    grew = []
    plans = {n: {"name": n} for n in ("planned", "uniform sfb", "uniform ring")}
    step_s, failed, _, _ = trial.measure({}, plans, 4, "none", 3, 1, 10.0,
                                         lambda what, more=0: grew.append(more), 3, interleave=True)
    assert launched[0] == tuple(plans) and ("planned",) in launched[1:]
    assert list(step_s) == ["planned", "uniform ring"] and list(failed) == ["uniform sfb"]
    assert sum(grew) == trial.PASSES * (3 * 4 + 4)


def test_an_interleaved_trial_runs_where_every_candidates_model_fits_in_half_the_memory():
    gib = 1 << 30
    # deeplight (18.6M parameters), 7 candidates, 4 workers: 8.3 GB of 20 GiB available
    assert trial.fits_interleaved(18_600_000, 7, 4, available=20 * gib)
    # vgg (138M), 6 candidates, 4 workers: 53 GB
    assert not trial.fits_interleaved(138_000_000, 6, 4, available=20 * gib)
    assert not trial.fits_interleaved(1, 1, 1, available=0)               # memory unknown: apart
    assert meminfo("MemAvailable") > 0 and meminfo("MemTotal") >= meminfo("MemAvailable")    # Linux
    assert meminfo("NoSuchField") is None


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 30)
        self.out = nn.Linear(8, 30, bias=False)
        self.tied = nn.Linear(8, 30, bias=False)
        self.tied.weight = self.emb.weight

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        return self.fc(h) + self.out(h) + self.tied(h)


def test_facts_tell_linear_weights_and_sparse_embeddings():
    got = {f.name: f for f in facts(Mixed())}
    assert got["fc.weight"].linear and not got["fc.bias"].linear and got["out.weight"].linear
    assert got["emb.weight"].coo and not got["emb.weight"].linear     # tied: two owners, no SFB
    assert not got["norm.weight"].linear and not got["norm.weight"].coo
    assert "tied.weight" not in got                                     # the same tensor as emb's


def test_a_payload_ready_sooner_starts_sooner_and_spared_work_shortens_backward():
    # SFB on tensor 1: backward skips 0.2 s of work (its gradient would be ready at 0.4, backward
    # ends at 0.8) and the factors are ready 0.3 s before that gradient (0.1); they wait for tensor
    # 0's 0.25 s on the channel
    step = Step((0.1, 0.6), 1.0, optimizer=0.05)
    costs = [Cost(comm=0.25), Cost(compress=-0.2, comm=0.1, decompress=0.4, sooner=0.3)]
    timeline = simulate(step, costs)
    assert timeline.payload_ready == pytest.approx([0.1, 0.1])      # 0.6 - 0.2 spared - 0.3 sooner
    assert timeline.comm_start == pytest.approx([0.1, 0.35]) and timeline.comm_end == pytest.approx([0.35, 0.85])
    assert timeline.backward_end == pytest.approx(0.8) and timeline.iteration == pytest.approx(0.9)
    assert Simulation(step, [costs[0], Cost()]).with_cost(1, costs[1]) == pytest.approx(0.9)


def test_backward_timeline_follows_autograd_and_leaves_the_parameters_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Pause(0.05), nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 16)
    timeline = backward_timeline(model, lambda m: m(x).pow(2).mean(), iterations=3, seconds=0.0)
    assert set(timeline.order[:2]) == {"2.weight", "2.bias"}              # the output's layer first
    assert set(timeline.order[2:]) == {"0.weight", "0.bias"}
    ready = timeline.step.ready
    assert list(ready) == sorted(ready) and ready[0] >= 0
    assert ready[2] - ready[1] >= 0.05                                   # the pause shows
    assert timeline.step.backward_end >= ready[-1] and timeline.step.optimizer > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # SFB's factors are ready at each layer's output gradient: the last layer's at once, the first's
    # after the pause and before its own weight gradient
    arrived, at = timeline.output_gradient, dict(zip(timeline.order, ready))
    assert set(arrived) == {"0.weight", "2.weight"}
    assert 0 <= arrived["2.weight"] <= at["2.weight"]
    assert max(at["2.weight"], at["2.bias"]) + 0.05 <= arrived["0.weight"] <= at["0.weight"]


@pytest.mark.parametrize("faulting, warmups", [(3, 4), (100, 8)])
def test_the_backward_timeline_warms_up_until_an_iteration_touches_no_new_memory(faulting, warmups):
    """Iterations that touch 16 MB of new memory each (as a training step's allocator before it has
    settled) are warm-up, then one that touches none, at most MOST_WARMUP of them; the timed
    iterations follow."""
    from sparcoll.plan.profile import MOST_WARMUP
    model, x = nn.Linear(16, 4), torch.randn(8, 16)
    kept, calls = [], []

    def loss_of(m):
        calls.append(1)
        if len(kept) < faulting:     # a new mapping, written: new pages whatever malloc keeps
            kept.append(mmap.mmap(-1, 1 << 24))
            kept[-1].write(b"\1" * (1 << 24))
        return m(x).pow(2).mean()
    backward_timeline(model, loss_of, iterations=3, seconds=0.0)
    assert len(calls) == min(warmups, MOST_WARMUP) + 3


def slow_weight_linear(n_in: int, n_out: int, seconds: float) -> nn.Linear:
    """An nn.Linear (SFB serves only nn.Linear's own forward) whose weight gradient takes `seconds`
    more, in a hook of the weight's: a known cost for SFB to spare, gone when backward skips it."""
    layer = nn.Linear(n_in, n_out)
    layer.weight.register_hook(lambda grad: time.sleep(seconds))
    return layer


def test_what_sfb_spares_is_measured_in_backward_with_the_weight_gradients_skipped():
    """Backward again with the linear layers' weight gradients skipped (as SFB runs them): those
    weights get no gradient and want one again afterwards, the layers' output gradients still
    arrive, and each layer's spared share is its own weight gradient's time (0.1 s and 0.05 s)."""
    from sparcoll.plan.profiler import layer_backward, spared_in_backward
    model = nn.Sequential(slow_weight_linear(16, 16, 0.1), nn.ReLU(), slow_weight_linear(16, 4, 0.05))
    x = torch.randn(8, 16, requires_grad=True)
    loss_of = lambda m: m(x).pow(2).mean()     # noqa: E731
    full = backward_timeline(model, loss_of, iterations=5, seconds=0.0)
    skipping = backward_timeline(model, loss_of, iterations=5, seconds=0.0,
                                 skipped=frozenset({"0.weight", "2.weight"}))
    assert set(skipping.order) == {"0.bias", "2.bias"} and set(skipping.output_gradient) == {"0.weight", "2.weight"}
    assert all(p.requires_grad for p in model.parameters()) and model[0].weight.grad is None
    node = layer_backward(full)
    assert node["0.weight"] >= 0.1 and node["2.weight"] >= 0.05
    spared = spared_in_backward(full, skipping, node)
    assert 0.05 <= spared["0.weight"] and 0.025 <= spared["2.weight"], spared    # half their sleeps at least
    assert all(spared[name] <= node[name] for name in spared)


def test_spared_work_is_each_layers_share_of_backward_at_most_its_own_backward():
    """By hand: the later layer's output gradient comes 0.3 s sooner when skipping, backward ends
    0.5 s sooner; the first layer spared 0.3, the second 0.2 (its node caps a share that noise made
    larger than the layer's own backward, and noise never makes one negative)."""
    from sparcoll.plan.profile import BackwardProfile
    from sparcoll.plan.profiler import spared_in_backward

    def profile(arrived: dict, end: float) -> BackwardProfile:
        return BackwardProfile((), Step((), end), 0.0, arrived)
    full = profile({"out.weight": 0.1, "hidden.weight": 0.9}, 2.0)
    skipping = profile({"out.weight": 0.1, "hidden.weight": 0.6}, 1.5)
    assert spared_in_backward(full, skipping, {"out.weight": 0.4, "hidden.weight": 0.7}) == pytest.approx(
        {"out.weight": 0.3, "hidden.weight": 0.2})
    assert spared_in_backward(full, skipping, {"out.weight": 0.25, "hidden.weight": 0.1}) == pytest.approx(
        {"out.weight": 0.25, "hidden.weight": 0.1})
    slower = profile({"out.weight": 0.1, "hidden.weight": 0.95}, 1.5)
    assert spared_in_backward(full, slower, {"out.weight": 0.4, "hidden.weight": 0.7}) == pytest.approx(
        {"out.weight": 0.0, "hidden.weight": 0.55})


def test_what_looking_rows_up_sparse_spares_is_each_tables_own_shift_in_backward():
    """By hand, in the dense backward's order: the MLP's gradients arrive as before (a 0.001 s shift is
    noise, not the tables'), the first table 0.004 s sooner (0.003 of it its own), the second 0.006 s
    sooner (0.002 its own); a table whose own shift noise made negative spares nothing."""
    from sparcoll.plan.profile import BackwardProfile
    from sparcoll.plan.profiler import spared_in_order

    def profile(ready: dict) -> BackwardProfile:
        return BackwardProfile(tuple(ready), Step(tuple(ready.values()), 0.05), 0.0, {})
    dense = profile({"mlp.bias": 0.010, "mlp.weight": 0.012, "first.weight": 0.030, "second.weight": 0.040})
    looked_up = profile({"mlp.bias": 0.010, "mlp.weight": 0.011, "first.weight": 0.026, "second.weight": 0.034})
    assert spared_in_order(dense, looked_up, {"first.weight", "second.weight"}) == pytest.approx(
        {"first.weight": 0.003, "second.weight": 0.002})
    noisy = profile({"mlp.bias": 0.010, "mlp.weight": 0.011, "first.weight": 0.026, "second.weight": 0.037})
    assert spared_in_order(dense, noisy, {"first.weight", "second.weight"}) == pytest.approx(
        {"first.weight": 0.003, "second.weight": 0.0})
    assert spared_in_order(dense, looked_up, {"absent.weight"}) == {}


def test_the_trial_says_when_ddp_was_faster_than_every_candidate():
    """DDP on gloo is measured beside the trial's candidates; the table says when it won, so a user is
    never told to use a plan slower than what they have."""
    from sparcoll.plan.command import table
    unit = {"unit": 0, "name": "w", "numel": 10, "ready_s": 0.001, "option": "ring", "unit_comm_s": 0.002,
            "unit_decompress_s": 0.0}
    plan = {"tensors": [unit], "strategy": "planned", "without": [], "predicted_step_s": 0.05, "bound_s": 0.01,
            "units": 1, "decision_ms": 1.0, "uniform": {"ring": 0.05},
            "trial": {"steps": 3, "warmup": 1, "kept": "planned", "step_s": {"planned": 0.050, "uniform ring": 0.060},
                      "predicted_step_s": {"planned": 0.05, "uniform ring": 0.05}}}
    for ddp_s, keep_ddp in ((0.040, True), (0.049, False), (0.080, False)):
        plan["trial"]["ddp"] = {"steps": 3, "step_s": ddp_s, "comm_share": 0.5}
        text = table(plan)
        assert f"measured {1e3 * ddp_s:>10.1f} ms, 50% of it communicating" in text
        assert f"{ddp_s / 0.050:.3f}x as fast" in text
        assert ("keep DDP" in text) == keep_ddp
    plan["trial"]["ddp"] = {"steps": 3, "failed": "it reported 1 of 4 steps"}
    text = table(plan)
    assert "DDP on gloo (the reference)" in text and "failed: it reported 1 of 4 steps" in text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1 << 24), min_size=1, max_size=6))
def test_a_profile_times_each_curve_up_to_the_whole_gradient(numels):
    """Every kind's sizes are its full list's points below the model's whole gradient and then the
    whole gradient itself (the full list if the gradient is larger than all of it; its first two if
    it is not larger than the first): no unit the planner prices is larger, the largest is measured."""
    from sparcoll.plan import profiler
    sizes = profiler.Sizes.of({"tensors": {f"t{i}": {"numel": n} for i, n in enumerate(numels)}})
    total = sum(numels)
    for chosen, full, whole in ((sizes.collective_bytes, profiler.COLLECTIVE_BYTES, 4 * total),
                                (sizes.allgather_bytes, profiler.ALLGATHER_BYTES, 4 * total),
                                (sizes.sparse_numels, profiler.SPARSE_NUMELS, total),
                                (sizes.compressor_numels, profiler.COMPRESSOR_NUMELS, total)):
        assert len(chosen) >= 2 and list(chosen) == sorted(set(chosen))
        if whole > full[-1]:
            assert chosen == full
        elif whole <= full[0]:
            assert chosen == full[:2]
        else:
            assert chosen == tuple(p for p in full if p < whole) + (whole,)


def test_a_trial_job_run_again_after_a_crash_keeps_only_its_last_run(monkeypatch):
    """sparcoll train's launch runs plain DDP on sparse gradients again after a crash in native code,
    saying so with a "restart" event first: the steps before it are dropped, the bar's total grows."""
    def launch(config, workers, network, timeout, on_event):
        for seconds in (9.0, 9.0):
            on_event({"event": "step", "step_s": seconds, "comm_s": 0.1})
        on_event({"event": "restart", "crashed": ["worker 1"]})
        for step in range(config["steps"]):
            on_event({"event": "step", "step_s": 1.0 if step == 0 else 0.5, "comm_s": 0.1})
    monkeypatch.setattr(trial, "launch", launch)
    calls = []
    steps = trial.train({"comm": "ddp"}, trial.DDP, 2, "none", 3, 1, 10.0, lambda what, more=0: calls.append(more))
    assert [s["step_s"] for s in steps] == [0.5, 0.5, 0.5]          # the warm-up and the crashed run left out
    assert len(calls) == 2 + 1 + 4 and sum(calls) == 3              # the bar grows by the 2 dropped steps + 1


def test_a_slowdown_is_of_the_steps_work_while_the_collectives_ran():
    """Hand-computed: steps of 1.0 s of work alone took 1.5 s, 0.6 s of which beside the
    collectives; the other 0.9 s ran at their rate alone, so 0.1 s of work took those 0.6 s (6x).
    Covering every step, it is the steps' whole ratio; below 1 (noise) it is 1; beyond MOST_SLOWDOWN
    it is that."""
    from sparcoll.plan.profiler import MOST_SLOWDOWN, slowed
    assert slowed(0.6, 1.5, 1.0) == pytest.approx(6.0)
    assert slowed(1.5, 1.5, 1.0) == pytest.approx(1.5)
    assert slowed(0.5, 0.9, 1.0) == 1.0
    assert slowed(0.6, 2.0, 1.0) == MOST_SLOWDOWN
    assert slowed(0.0, 1.0, 1.0) == 1.0


def _under_load(rank: int, world: int) -> tuple:
    """profiler.under_load with a collective of 5 ms alone against steps of 300 ms: every rank runs
    as many (a different count would hang the all_reduce), enough to span a step. The span is long
    so that the steps' oversleep, which the slowdown magnifies, is small beside it."""
    import time
    import torch.distributed as dist
    from sparcoll.plan import profiler
    calls = []

    def run(_) -> None:
        calls.append(time.perf_counter())
        dist.all_reduce(torch.zeros(1))
        time.sleep(0.005)
    loaded, slowdown, _ = profiler.under_load(run, lambda: None, lambda: time.sleep(0.3), 0.3, 0.005,
                                              timeout=30)
    return len(calls), calls[-1] - calls[0], loaded, slowdown


def test_collectives_under_load_run_as_many_times_on_every_rank_and_span_a_step():
    from ranks import run_ranks
    outcome = run_ranks(_under_load, 2, timeout=60)
    assert [count for count, *_ in outcome] == [60, 60]        # ceil(300 ms / 5 ms)
    for count, spanned, loaded, slowdown in outcome:
        assert spanned >= 59 * 0.005 and loaded >= 0.005
        assert 1.0 <= slowdown < 2.0            # sleeping steps are not slowed down


def _spin(seconds: float) -> None:
    """Compute on this thread for `seconds` of its own CPU."""
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _under_load_cpu(rank: int, world: int) -> float:
    """profiler.under_load's CPU of a collective that computes 1 ms and waits 4, beside training steps
    that compute all the time: the collective's CPU, not the steps'."""
    import time
    import torch.distributed as dist
    from sparcoll.plan import profiler

    def run(_) -> None:
        dist.all_reduce(torch.zeros(1))
        _spin(0.001)
        time.sleep(0.004)
    return profiler.under_load(run, lambda: _spin(0.002), lambda: _spin(0.02), 0.05, 0.005, timeout=30)[2]


def test_a_collectives_cpu_under_load_leaves_out_the_training_threads():
    """The steps compute through every run (5 ms of their CPU a run, or more: the training thread's
    whole CPU in the runs' span), each run's input takes 2 ms to prepare, the collective 1 ms of its
    own and an allreduce of one float: only the collective's counts."""
    from ranks import run_ranks
    cpus = run_ranks(_under_load_cpu, 2, timeout=60)
    assert cpus[0] == cpus[1]       # the workers' mean, on every worker
    assert 0.001 <= cpus[0] < 0.003, cpus


def _timed_cpu(rank: int, world: int) -> tuple:
    """profiler.timed of a run that computes for 20 ms and of one that sleeps as long."""
    from sparcoll.plan import profiler

    return profiler.timed(lambda _: _spin(0.02)), profiler.timed(lambda _: time.sleep(0.02))


def test_a_timed_run_says_the_cpu_its_worker_spent_in_it():
    from ranks import run_ranks
    for busy, sleeping in run_ranks(_timed_cpu, 2, timeout=60):
        assert busy.seconds >= 0.02 and busy.cpu >= 0.02
        assert sleeping.seconds >= 0.02 and sleeping.cpu < 0.01


def test_the_profile_makes_its_batches_before_timing_anything(monkeypatch):
    """model_and_loss makes PROFILE_BATCHES batches at once and takes them in turn: the losses it
    gives draw no further batch (a batch's making is not in `sparcoll train`'s step either)."""
    from sparcoll.plan import profiler
    drawn = []

    class Workload:
        model = torch.nn.Linear(2, 1)

        def batches(self, batch_size, rank, world, seed):
            for i in itertools.count():
                drawn.append(i)
                yield torch.full((batch_size, 2), float(i))

        def loss(self, model, batch):
            return batch[0, 0]

    monkeypatch.setattr(profiler, "get_workload", lambda *args, **kwargs: Workload())
    model, loss_of = profiler.model_and_loss({"workload": "w", "options": {}, "seed": 0, "batch_size": 3}, 0, 2)
    assert len(drawn) == profiler.PROFILE_BATCHES
    losses = [loss_of(model).item() for _ in range(2 * profiler.PROFILE_BATCHES)]
    assert len(drawn) == profiler.PROFILE_BATCHES
    assert losses == [float(i % profiler.PROFILE_BATCHES) for i in range(2 * profiler.PROFILE_BATCHES)]


def test_the_profiles_step_is_the_mean_of_its_windows_each_kept():
    from sparcoll.plan.profiler import WINDOWED, averaged_windows
    first = {"order": ["b", "a"], "ready": [1.0, 3.0], "backward_end": 4.0, "optimizer": 1.0, "forward": 2.0,
             "cpu": 6.0, "tensors": {"a": {}, "b": {}}, "cores_per_worker": 0.5}
    later = [{"order": ["b", "a"], "ready": [2.0, 5.0], "backward_end": 7.0, "optimizer": 2.0, "forward": 4.0,
              "cpu": 9.0},
             {"order": ["b", "a"], "ready": [3.0, 4.0], "backward_end": 4.0, "optimizer": 3.0, "forward": 3.0,
              "cpu": 3.0}]
    model = averaged_windows(first, later)
    assert model["ready"] == [2.0, 4.0] and model["backward_end"] == 5.0 and model["optimizer"] == 2.0
    assert model["forward"] == 3.0 and model["cpu"] == 6.0
    assert model["tensors"] is first["tensors"] and model["cores_per_worker"] == 0.5 and model["order"] == ["b", "a"]
    assert model["windows"] == [{key: w[key] for key in WINDOWED} for w in (first, *later)]
    assert averaged_windows(first, [])["forward"] == 2.0
    with pytest.raises(RuntimeError, match="different orders"):
        averaged_windows(first, [{**later[0], "order": ["a", "b"]}])


def test_the_profiles_cpu_points_become_curves_grids_and_times_on_tensors():
    from sparcoll.plan.profiler import fit
    point = lambda kind, x, seconds, **more: {"event": "point", "kind": kind, "what": more.pop("what", "ring"),
                                              "x": x, "seconds": seconds, **more}    # noqa: E731
    fits = fit([point("cpu", 4096, 0.002), point("cpu", 65536, 0.001),            # made non-decreasing
                point("cpu", 400, 0.003, what="sparse", numel=1000),
                point("cpu", 4000, 0.004, what="sparse", numel=1000),
                point("compress_cpu", 1000, 0.001, what="fp16"), point("decompress_cpu", 1000, 0.0005, what="fp16"),
                point("compress_cpu", 1000, 0.02, what="fp16", tensor="w"), point("coo_cpu", 0, 0.03, tensor="e")])
    assert fits["cpu"]["ring"] == [[4096.0, 65536.0], [0.002, 0.002]]
    assert fits["grids"]["cpu"]["sparse"] == [[1000.0, [0.1, 1.0], [0.003, 0.004]]]
    assert fits["compress_cpu"]["fp16"] == [[1000.0], [0.001]]
    assert fits["decompress_cpu"]["fp16"] == [[1000.0], [0.0005]]
    assert fits["compress_cpu_own"] == {"fp16": {"w": 0.02}} and fits["coo_cpu_own"] == {"ring": {"e": 0.03}}


def _slowest_and_mean(rank: int, world: int) -> tuple:
    from sparcoll.plan.profiler import slowest_and_mean
    seconds, cpu = slowest_and_mean(torch.tensor([[1.0 + rank, 5.0 - rank], [10.0 * (rank + 1), 3.0]],
                                                 dtype=torch.float64))
    return seconds.tolist(), cpu.tolist()


def test_a_measurement_over_workers_is_the_slowest_time_and_the_mean_cpu():
    """Times: the slowest worker's (a step ends with it); CPU: the workers' mean (the cores serve all)."""
    from ranks import run_ranks
    assert run_ranks(_slowest_and_mean, 2, timeout=60) == [([2.0, 5.0], [15.0, 3.0])] * 2


def _compress_in_backward(rank: int, world: int) -> tuple:
    """profiler.compress_in_backward on a two-layer model: each compressor's calls, with whether
    autograd was running them (a graph task is current) and the shape of the gradient they saw."""
    from sparcoll.plan import profiler
    calls = []

    class Spy(profiler.Reducer):
        def compress(self, tensor, key=None):
            calls.append((str(self.spec), key, torch._C._current_graph_task_id() != -1, tuple(tensor.shape)))
            return super().compress(tensor, key=key)

    profiler.Reducer = Spy
    decompressed = []
    decompress_into = profiler.decompress_into

    def spy_decompress(compressor, payload, world, into):
        decompressed.append((str(compressor.spec), threading.current_thread().name, into.numel()))
        decompress_into(compressor, payload, world, into)
    profiler.decompress_into = spy_decompress
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256))
    # a weight laid out transposed (as channels_last lays out a convolution's): its gradient is not flat
    model[0].weight = nn.Parameter(model[0].weight.detach().t().contiguous().t())
    first = [True]

    def loss_of(m):
        # the first compressor's untimed step lasts 0.1 s longer on rank 1 only: the ranks must agree
        # on how many steps fit in IN_BACKWARD_SECONDS, or their barriers and reductions mismatch
        if rank == 1 and first[0]:
            time.sleep(0.1)
        first[0] = False
        return m(torch.randn(8, 64)).square().sum()
    profiler.IN_BACKWARD_SECONDS = 0.5
    names = ["0.weight", "2.weight"]
    specs = ["fp16", "powersgd:4", "topk:0.01"]
    timed = list(profiler.compress_in_backward(specs, world, model, loss_of, names, timeout=30))
    model.zero_grad()
    loss_of(model).backward()               # the hooks are gone: no more calls
    return timed, calls, {name: tuple(p.shape) for name, p in model.named_parameters()}, decompressed


def test_compressors_are_timed_in_backward_on_the_gradient_where_a_plan_runs_them():
    """Each compressor but PowerSGD, on each named gradient, in autograd's hook, every payload then
    decompressed on another thread; the hooks gone after."""
    from ranks import run_ranks
    from sparcoll.plan.profiler import IN_BACKWARD_STEPS, MOST_IN_BACKWARD_STEPS
    names = ("0.weight", "2.weight")
    outcome = run_ranks(_compress_in_backward, 2, timeout=60)
    (timed, *_), (timed_peer, *_) = outcome
    assert timed == timed_peer                      # the slowest worker's, the same on every rank
    assert [(spec, name) for spec, name, *_ in timed] == [
        ("fp16", "0.weight"), ("fp16", "2.weight"), ("topk:0.01", "0.weight"), ("topk:0.01", "2.weight")]
    # the CPU of the thread that compressed (the training thread) and of the one that decompressed:
    # some, and no more than the slowest worker's time (one thread each)
    assert all(0 < cpu <= seconds + 1e-3 for *_, compress, decompress in timed
               for seconds, cpu in (compress, decompress))
    for _, calls, shapes, decompressed in outcome:
        # each payload decompressed on a thread of its own, as the synchronization thread does
        assert sorted(decompressed) == sorted((spec, "sparcoll-profile-channel_0", math.prod(shape))
                                              for spec, _, _, shape in calls)
        # PowerSGD cannot compress apart; per compressor an untimed step, then as many as fit in
        # 0.5 s: fp16's at most 5 after rank 1's 0.1 s, topk's as many on both ranks
        steps = {spec: sum(s == spec for s, *_ in calls) // 2 for spec in ("fp16", "topk:0.01")}
        assert 1 + IN_BACKWARD_STEPS <= steps["fp16"] <= 1 + 5
        assert 1 + IN_BACKWARD_STEPS <= steps["topk:0.01"] <= 1 + MOST_IN_BACKWARD_STEPS
        assert all(in_backward for _, _, in_backward, _ in calls)
        assert {(key, shape) for _, key, _, shape in calls} == {(name, shapes[name]) for name in names}
        assert [spec for spec, *_ in calls] == (["fp16"] * (2 * steps["fp16"])
                                                + ["topk:0.01"] * (2 * steps["topk:0.01"]))
    assert len(outcome[0][1]) == len(outcome[1][1])     # every rank ran as many steps
