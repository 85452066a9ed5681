"""sparcoll simulate: the discrete-event model against closed forms it must reduce to, the trends the
papers publish, the physical bound, and the command's output."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from sparcoll.bench import bounds
from sparcoll.bench.patterns import InputSpec
from sparcoll.simulate import calibrate, command, model
from sparcoll.simulate.costs import Costs
from sparcoll.simulate.model import Point, predict
from support import sparcoll_here

GBIT = 1e9
NUMEL = 16 << 20
#: A network and nothing else: no CPU costs, no latency, the full rate for payload.
WIRE_ONLY = Costs(scan_s_per_byte=0, add_s_per_byte=0, copy_s_per_byte=0, socket_s_per_byte=0,
                  coalesce_s_per_byte=0, message_s=0, collective_s=0, gloo_step_s=0, latency_s=0, goodput=1.0)
MEASURED = Costs.load()


def wire_seconds(nbytes: float, rate: float = GBIT) -> float:
    return nbytes * 8 / rate


def test_ring_on_the_wire_alone_is_its_closed_form():
    """2(n-1) steps, each a segment through the links (cut through: one hop's time)."""
    for n in (2, 4, 8):
        step = wire_seconds(NUMEL * 4 / n)
        assert predict(Point("ring", n, NUMEL, 1.0, GBIT), WIRE_ONLY) == pytest.approx(2 * (n - 1) * step)


def test_an_incast_is_limited_by_the_receivers_downlink():
    """Every rank's push to one server at once (the parameter server's first phase with 2 ranks is a
    pair; with 4, each server takes 3 shards in): ps moves 2(n-1)/n N per direction, the ring's bytes."""
    for n in (2, 4, 8):
        expected = wire_seconds(2 * (n - 1) / n * NUMEL * 4)
        assert predict(Point("ps", n, NUMEL, 1.0, GBIT), WIRE_ONLY) == pytest.approx(expected, rel=0.02)


def test_a_token_bucket_lets_a_burst_through_at_once():
    small = Point("sparse", 2, 1 << 16, 1.0, GBIT)          # 256 KiB, half of it crosses the link
    unshaped = predict(dataclasses.replace(small, rate_bps=None), WIRE_ONLY)
    assert predict(small, WIRE_ONLY) > unshaped + wire_seconds(64 << 10)
    assert predict(dataclasses.replace(small, burst_bytes=1 << 20), WIRE_ONLY) == pytest.approx(unshaped)


def test_latency_adds_per_step_of_the_ring():
    slow = dataclasses.replace(WIRE_ONLY, latency_s=1e-3)
    for n in (2, 8):
        extra = predict(Point("ring", n, NUMEL, 1.0, GBIT), slow) - predict(Point("ring", n, NUMEL, 1.0, GBIT), WIRE_ONLY)
        assert extra == pytest.approx(2 * (n - 1) * 1e-3)


@settings(max_examples=25, deadline=None)
@given(algo=st.sampled_from(["sparse", "ring", "ps", "agsparse"]), n=st.integers(2, 8),
       density=st.sampled_from([0.01, 0.1, 0.5, 1.0]), dedicated=st.booleans(),
       rate=st.sampled_from([2e8, GBIT, 10 * GBIT]))
def test_no_prediction_beats_the_physical_bound(algo, n, density, dedicated, rate):
    point = Point(algo, n, 1 << 20, density, rate, aggregators="dedicated" if dedicated else "colocated")
    bound = bounds.link_bytes(algo, workers=n, nbytes=point.nbytes, density=density, union_density=point.union,
                              nblocks=point.nblocks, aggregators=point.aggregators,
                              num_aggregators=point.shards)
    assert predict(point, MEASURED) >= bounds.seconds(bound, rate) / MEASURED.goodput * 0.999


def test_dense_ring_is_flat_in_n_while_its_latency_term_grows():
    times = {n: predict(Point("ring", n, NUMEL, 1.0, GBIT), MEASURED) for n in (8, 64, 256)}
    wire = {n: wire_seconds(2 * (n - 1) / n * NUMEL * 4, GBIT * MEASURED.goodput) for n in times}
    assert times[256] / times[8] < 1.5                      # flat: the bytes per link hardly change
    assert times[256] - wire[256] > 2 * (times[8] - wire[8])  # but the per-step overhead grows with n


def test_dedicated_aggregators_beat_the_ring_by_its_bytes_ratio_on_the_wire():
    """At 100% density a dedicated aggregator per worker puts N bytes on the busiest link against the
    ring's 2(n-1)/n N: two messages in flight per stream hide the round trips."""
    for n in (4, 8, 16):
        ring = predict(Point("ring", n, NUMEL, 1.0, GBIT), WIRE_ONLY)
        dedicated = predict(Point("sparse", n, NUMEL, 1.0, GBIT, aggregators="dedicated"), WIRE_ONLY)
        assert ring / dedicated == pytest.approx(2 * (n - 1) / n, rel=0.1)


def test_one_message_in_flight_exposes_the_round_trips_without_a_bucket():
    """With one message in flight each (worker, aggregator) stream waits a round trip per message,
    unless a token bucket lets the link catch up in bursts."""
    point = Point("sparse", 4, NUMEL, 1.0, GBIT, aggregators="dedicated", credits=1)
    assert predict(point, WIRE_ONLY) > 1.2 * predict(dataclasses.replace(point, burst_bytes=1 << 20), WIRE_ONLY)


def speedup(n: int, density: float, **options) -> float:
    return (predict(Point("ring", n, NUMEL, density, GBIT), MEASURED)
            / predict(Point("sparse", n, NUMEL, density, GBIT, **options), MEASURED))


def test_sparse_advantage_grows_with_n_while_the_union_stays_sparse():
    """Shared patterns, dedicated aggregators: sparcoll's busiest link carries d N at any n, the ring's
    2(n-1)/n N."""
    shared = {n: speedup(n, 0.01, aggregators="dedicated", overlap=1.0) for n in (2, 4, 16)}
    assert shared[2] < shared[4] < shared[16]


def test_sparse_advantage_falls_as_independent_patterns_fill_the_union():
    at_10 = {n: speedup(n, 0.1) for n in (2, 8, 64, 256)}
    assert at_10[2] > at_10[8] > at_10[64]          # the union: 19%, 57%, 99.9%
    union = 1 - 0.9 ** 64
    assert at_10[64] == pytest.approx(2 / (0.1 + union), rel=0.1)   # no more than the bytes' ratio


def test_grouped_simulation_agrees_with_the_exact_one(monkeypatch):
    """Beyond MAX_GROUPS hosts, symmetric hosts are simulated in lockstep groups."""
    cases = [("sparse", 0.01, GBIT), ("sparse", 0.1, 10 * GBIT), ("sparse", 1.0, GBIT), ("ps", 1.0, GBIT)]
    grouped = [predict(Point(algo, 32, 1 << 20, density, rate), MEASURED) for algo, density, rate in cases]
    monkeypatch.setattr(model, "MAX_GROUPS", 32)
    exact = [predict(Point(algo, 32, 1 << 20, density, rate), MEASURED) for algo, density, rate in cases]
    for case, g, e in zip(cases, grouped, exact):
        assert g == pytest.approx(e, rel=0.1), case


def test_a_worker_count_no_grouping_fits_is_simulated_host_by_host_or_refused(monkeypatch):
    """17 and 34 workers have no divisor from MIN_GROUPS to MAX_GROUPS: simulated as 1 and 2 groups,
    they were priced 28% and 14% above the exact simulation; now they are simulated host by host up
    to MOST_EXACT, and a larger such count, or more hosts sharing cores, is refused."""
    counts = (17, 34)
    as_given = [predict(Point(algo, n, 1 << 20, 0.1, 10 * GBIT), MEASURED) for n in counts for algo in ("sparse", "ps")]
    monkeypatch.setattr(model, "MAX_GROUPS", 64)
    exact = [predict(Point(algo, n, 1 << 20, 0.1, 10 * GBIT), MEASURED) for n in counts for algo in ("sparse", "ps")]
    assert as_given == pytest.approx(exact, rel=0.02)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="none divides 67; try 64 or 72"):
        Point("sparse", 67, 1 << 20, 0.1, GBIT)
    with pytest.raises(ValueError, match="65 hosts sharing 2 cores"):
        Point("sparse", 65, 1 << 20, 0.1, GBIT, cores=2)
    with pytest.raises(ValueError, match="none divides 67"):
        Point("sparse", 128, 1 << 20, 0.1, GBIT, aggregators="dedicated", num_aggregators=67)


def test_shared_cores_slow_a_cpu_bound_point_down():
    point = Point("sparse", 8, NUMEL, 1.0, None)
    own = predict(point, MEASURED)
    assert predict(dataclasses.replace(point, cores=2), MEASURED) > 1.5 * own
    assert predict(dataclasses.replace(point, cores=1), MEASURED) > predict(dataclasses.replace(point, cores=2), MEASURED)


def test_message_blocks_follow_sparcolls_policy():
    assert model.message_blocks(Point("sparse", 4, NUMEL, 1.0, GBIT), MEASURED) == 256   # 4 ms of a 1 Gbit/s link
    assert model.message_blocks(Point("sparse", 4, NUMEL, 0.01, GBIT), MEASURED) == 2048  # too little read


def test_union_density_matches_the_bench_inputs():
    """The model's union against the union of `sparcoll bench`'s generated patterns."""
    for workers, density, overlap in ((4, 0.1, 0.0), (8, 0.05, 0.5), (3, 0.2, 1.0)):
        spec = InputSpec(numel=1 << 20, block_size=256, workers=workers, density=density, overlap=overlap, seed=1)
        point = Point("sparse", workers, 1 << 20, density, GBIT, overlap=overlap)
        assert point.union == pytest.approx(spec.union_density(), abs=0.01)


def test_bad_points_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown algorithm"):
        Point("allgather", 4, NUMEL, 1.0, GBIT)
    with pytest.raises(ValueError, match="at least 2"):
        Point("ring", 1, NUMEL, 1.0, GBIT)
    with pytest.raises(ValueError, match="simulates at most 16384"):     # 10^8 once ran without end
        Point("ring", 100_000_000, NUMEL, 1.0, GBIT)
    with pytest.raises(ValueError, match="density"):
        Point("ring", 4, NUMEL, 0.0, GBIT)
    with pytest.raises(ValueError, match="colocated or dedicated"):
        Point("sparse", 4, NUMEL, 1.0, GBIT, aggregators="remote")
    with pytest.raises(ValueError, match="overlap"):
        Point("sparse", 4, NUMEL, 0.1, GBIT, overlap=1.5)
    for block_size in (0, (1 << 16) + 1):
        with pytest.raises(ValueError, match=r"block size \d+ outside \[1, 65536\]"):
            Point("sparse", 4, NUMEL, 0.1, GBIT, block_size=block_size)


def test_large_blocks_travel_in_messages_as_sparcoll_sizes_them():
    """sparcoll's default most blocks per message shrinks for large blocks (a message's limit); the
    model takes the same default, not 2048 blocks of any size."""
    from sparcoll.options import default_message_blocks
    for block_size in (256, 8192, 1 << 16):
        point = Point("sparse", 4, 1 << 24, 0.01, None, block_size=block_size)
        assert model.message_blocks(point, MEASURED) == default_message_blocks(block_size)
    assert default_message_blocks(1 << 16) < 2048


def test_costs_round_trip_and_missing_fields(tmp_path):
    path = tmp_path / "costs.json"
    MEASURED.save(path)
    assert Costs.load(path) == MEASURED
    data = json.loads(path.read_text())
    del data["message_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="message_s"):
        Costs.load(path)


@pytest.mark.parametrize("name, value, message", [
    ("goodput", 0, r"goodput 0 outside \(0, 1\]"), ("goodput", 1.5, "goodput 1.5 outside"),
    ("latency_s", -1e-3, "latency_s must be finite and at least 0"),
    ("message_s", float("nan"), "message_s must be finite"),
    ("add_s_per_byte", float("inf"), "add_s_per_byte must be finite")])
def test_costs_that_no_link_or_cpu_could_have_are_refused(tmp_path, name, value, message):
    """Before, goodput 0 ended in a ZeroDivisionError, a negative latency in simpy's error, NaN in a
    table of nan with exit status 0."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**dataclasses.asdict(MEASURED), name: value}))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}"):
        Costs.load(path)


@pytest.mark.parametrize("content, message", [
    ('[{"algo": "ring", "predicted_s": 0.1}]', "holds a JSON list; expected a JSON object of costs"),
    ("algo,seconds\nring,0.1\n", r"not JSON \(Expecting value.*\); expected a JSON object of costs"),
    ('{"message_s": "fast"}', "calibration lacks"),
])
def test_costs_that_are_not_a_calibration_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {message}"):
        Costs.load(path)


def test_costs_that_are_not_numbers_are_refused_by_name(tmp_path):
    path = tmp_path / "costs.json"
    data = dataclasses.asdict(MEASURED) | {"latency_s": "1us", "goodput": None}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: goodput, latency_s must be numbers"):
        Costs.load(path)


def _run(*argv) -> int:
    parser = argparse.ArgumentParser(prog="sparcoll simulate")
    command.add_arguments(parser)
    return command.run(parser.parse_args(["--workers", "2", "--network", "1gbit", "--density", "1", *argv]))


@pytest.mark.parametrize("option", ["--json", "--plot", "--calibrate"])
def test_outputs_into_a_missing_directory_are_refused_before_any_work(option, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(command, "predict", lambda *a: pytest.fail("predicted before checking the output"))
    monkeypatch.setattr(calibrate, "calibrate_median", lambda *a, **k: pytest.fail("calibrated"))
    path = tmp_path / "missing" / "out"
    assert _run(option, str(path)) == 2
    assert f"{option} {path}: directory {path.parent} does not exist" in capsys.readouterr().err


def test_a_bench_json_given_as_costs_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([{"algo": "ring", "workers": 2, "time_s": 0.1}]))
    assert _run("--costs", str(path)) == 2
    assert f"{path}: holds a JSON list; expected a JSON object of costs" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--link-burst", "--numel"])
def test_a_zero_count_says_what_is_expected(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        _run(option, "0")
    assert exit_.value.code == 2
    assert f"{option}: invalid count '0': expected a positive integer" in capsys.readouterr().err


def test_fit_inverts_an_increasing_function():
    assert calibrate.fit(7.0, lambda x: 3 * x + 1, high=10) == pytest.approx(2.0, abs=1e-9)


def test_a_fit_that_reaches_the_end_of_its_range_says_so():
    point, logged = Point("sparse", 2, NUMEL, 1.0, None), []
    far = calibrate.fit_cost(MEASURED, "message_s", point, 1e6, high=1e-3, log=logged.append)
    assert far.message_s == pytest.approx(1e-3, rel=1e-3) and len(logged) == 1 and "message_s" in logged[0]
    near = calibrate.fit_cost(MEASURED, "message_s", point, predict(point, MEASURED), high=1e-3, log=logged.append)
    assert near.message_s == pytest.approx(MEASURED.message_s, rel=1e-3) and len(logged) == 1


def test_a_calibration_whose_bench_failed_ends_in_one_line(capfd, monkeypatch, tmp_path):
    def failing(*args, **kwargs):
        raise RuntimeError("sparcoll bench of ring did not finish within 600 s")
    monkeypatch.setattr(calibrate, "calibrate_median", failing)
    proc = sparcoll_here(capfd, ["simulate", "--calibrate", tmp_path / "costs.json"], 60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "sparcoll simulate: calibration failed: sparcoll bench of ring did not finish within 600 s"], proc.stderr


def test_socket_costs_are_measured():
    per_byte, latency = calibrate.socket_costs()
    assert 1e-12 < per_byte < 1e-8      # 0.1 to 1000 GB/s of CPU through loopback
    assert 1e-7 < latency < 1e-2


def test_command_writes_table_json_and_plot(tmp_path, capfd):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    proc = sparcoll_here(capfd, ["simulate", "--workers", "2,4", "--network", "1gbit,100gbit", "--numel", "1M",
                                 "--density", "0.01,1", "--aggregators", "colocated,dedicated", "--json", out,
                                 "--plot", png], 300)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())
    # 4 algorithms colocated, sparse dedicated: 5 per (network, density, workers)
    assert len(records) == 2 * 2 * 2 * 5
    for r in records:
        assert r["predicted_s"] > 0 and r["algo"] in model.ALGOS and r["workers"] in (2, 4)
        if r["algo"] == "ring":
            assert r["speedup_vs_ring"] == 1
    assert png.stat().st_size > 10_000
    assert "predicted ms" in proc.stdout


def test_command_passes_credits_and_the_link_burst_to_the_model():
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--workers", "4", "--network", "1gbit", "--density", "1", "--algos", "sparse,ring",
                              "--aggregators", "dedicated", "--credits", "1", "--link-burst", "1M"])
    point, _ = command.points(args)
    assert (point.credits, point.burst_bytes) == (1, 1 << 20)
    row = command.record(point, 0.5)
    assert (row["credits"], row["link_burst_bytes"]) == (1, 1 << 20)


def test_command_refuses_a_bad_layout(capfd):
    proc = sparcoll_here(capfd, ["simulate", "--workers", "2", "--aggregators", "remote"], 120)
    assert proc.returncode == 2 and "colocated or dedicated" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--workers", ","], "--workers: empty list"),
    (["--aggregators", "dedicated", "--algos", "ring"], "--aggregators dedicated: only sparcoll's algorithms"),
    (["--workers", "17,67"], "none divides 67")])
def test_command_refuses_lists_that_name_no_point_it_can_price(capfd, argv, message):
    """Before: an empty table (or a matplotlib traceback with --plot) and exit status 0."""
    proc = sparcoll_here(capfd, ["simulate", "--network", "1gbit", "--density", "0.1", *argv], 120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_command_takes_lists_written_with_spaces(capfd):
    proc = sparcoll_here(capfd, ["simulate", "--workers", "2, 4", "--network", "1gbit", "--density", "0.1",
                                 "--algos", "ring, sparse", "--aggregators", "colocated, dedicated"], 120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[1:4] for line in proc.stdout.splitlines() if line.startswith("   1gbit")]
    assert sorted(rows) == sorted([["ring", "-", "2"], ["ring", "-", "4"], ["sparse", "colocated", "2"],
                                   ["sparse", "colocated", "4"], ["sparse", "dedicated", "2"],
                                   ["sparse", "dedicated", "4"]]), proc.stdout


def test_auto_takes_the_ring_on_dense_data_unless_sparse_is_clearly_faster():
    point = Point("sparcoll", 4, NUMEL, 1.0, GBIT)
    ring = predict(dataclasses.replace(point, algo="ring"), MEASURED)
    sparse = predict(dataclasses.replace(point, algo="sparse"), MEASURED)
    assert predict(point, MEASURED) == (sparse if sparse < 0.9 * ring else ring)
    low = Point("sparcoll", 4, NUMEL, 0.01, GBIT)
    assert predict(low, MEASURED) == predict(dataclasses.replace(low, algo="sparse"), MEASURED)
    assert math.isfinite(predict(low, MEASURED))


def test_auto_takes_the_ring_path_for_tiny_tensors_and_times_small_ones_at_any_density():
    """As sparcoll.algorithm chooses: at most 1024 elements on the ring path whatever the density;
    at most 256K elements over the ranks, the sparse path at 1% only where it is clearly faster."""
    for numel in (256, 1024):
        tiny = Point("sparcoll", 4, numel, 0.01, 10 * GBIT)
        assert predict(tiny, MEASURED) == predict(dataclasses.replace(tiny, algo="ring"), MEASURED)
    small = Point("sparcoll", 4, 1 << 16, 0.01, 10 * GBIT)
    ring = predict(dataclasses.replace(small, algo="ring"), MEASURED)
    sparse = predict(dataclasses.replace(small, algo="sparse"), MEASURED)
    assert predict(small, MEASURED) == (sparse if sparse < 0.9 * ring else ring)


def test_a_mistyped_network_is_refused_by_the_parser_offering_none_too(capsys):
    from sparcoll.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--network", "1gbit,10gbt"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--network: invalid list '1gbit,10gbt': invalid rate '10gbt'" in err, err
    assert "or none (unshaped)" in err and "usage:" in err, err


def _parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparcoll simulate")
    command.add_arguments(parser)
    return parser.parse_args(["--workers", "2", "--network", "1gbit", "--density", "1", *argv])


def test_the_ring_stays_the_baseline_of_dedicated_aggregators():
    """With --aggregators dedicated alone the ring was dropped, and every "vs ring" with it."""
    args = _parse("--workers", "2,4", "--algos", "ring,sparse", "--aggregators", "dedicated")
    wanted = command.points(args)
    assert sorted((p.algo, p.aggregators, p.workers) for p in wanted) == [
        ("ring", "colocated", 2), ("ring", "colocated", 4), ("sparse", "dedicated", 2), ("sparse", "dedicated", 4)]
    records = [command.record(point, 0.1 if point.algo == "ring" else 0.05) for point in wanted]
    command.add_speedups(records)
    assert [r["speedup_vs_ring"] for r in records if r["algo"] == "sparse"] == [2.0, 2.0]
    assert {r["aggregators"] for r in records if r["algo"] == "ring"} == {None}
    both = command.points(_parse("--algos", "ring,sparse", "--aggregators", "dedicated,colocated"))
    assert sorted((p.algo, p.aggregators) for p in both) == [
        ("ring", "colocated"), ("sparse", "colocated"), ("sparse", "dedicated")]


def test_network_names_keep_their_unit():
    assert [command.network_name(rate) for rate in (1e3, 5e5, 1e9, 1e12, 1500.0, None)] == \
        ["1kbit", "500kbit", "1gbit", "1tbit", "1500bit", "none"]


def test_a_link_burst_applies_to_shaped_links_only():
    args = _parse("--network", "none,1gbit", "--link-burst", "1M", "--algos", "ring")
    assert [(p.rate_bps, p.burst_bytes) for p in command.points(args)] == [(None, None), (GBIT, 1 << 20)]


#: Options simulate shares with sparcoll bench, refused by both with the same words (before, simulate took
#: them all: a 1-byte bucket, a bucket on no link, aggregators it does not have, 1000 elements it
#: simulated as 768).
SHARED_REFUSALS = [
    (["--link-burst", "1"], "--link-burst 1: at least 65536 bytes (64K)"),
    (["--network", "none", "--link-burst", "1M"], "--link-burst shapes the emulated links: give --network"),
    (["--aggregators", "dedicated", "--num-aggregators", "0"], "--num-aggregators must be >= 1"),
    (["--num-aggregators", "3"], "--num-aggregators counts dedicated aggregators: give --aggregators dedicated"),
    (["--numel", "1000"], "--numel 1000 must be a multiple of --block-size 256"),
    (["--density", "0"], "--density values must be in (0, 1]"),
    (["--overlap", "2"], "--overlap must be in [0, 1]"),
]


@pytest.mark.parametrize("argv, message", SHARED_REFUSALS)
def test_options_shared_with_bench_are_refused_alike(argv, message, monkeypatch, capsys):
    from sparcoll.bench import command as bench
    monkeypatch.setattr(command, "predict", lambda *a: pytest.fail("predicted"))
    assert _run(*argv) == 2
    assert message in capsys.readouterr().err
    monkeypatch.setattr(bench, "run_jobs", lambda *a, **k: pytest.fail("the benchmark started"))
    parser = argparse.ArgumentParser(prog="sparcoll bench")
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--workers", "2", "--numel", "4096", *argv])) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2,2"], "argument --workers: invalid list '2,2': 2 given twice"),
    (["--network", "none,none"], "argument --network: invalid list 'none,none': none given twice"),
    (["--network", "1gbit,1000mbit"], "invalid list '1gbit,1000mbit': 1000mbit given twice (the same as 1gbit)"),
    (["--density", "1,1"], "argument --density: invalid list '1,1': 1 given twice"),
    (["--algos", "ring,ring"], "argument --algos: invalid list 'ring,ring': ring given twice"),
    (["--aggregators", "dedicated,dedicated"], "invalid list 'dedicated,dedicated': dedicated given twice"),
])
def test_a_value_given_twice_is_refused_not_simulated_twice(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--plot", "{tmp}/x.json"], r"--plot .*/x.json: matplotlib writes no .json figure; end the name with one of "
                                 r".*\.pdf.*\.png"),
    (["--plot", "{tmp}/noext"], r"--plot .*/noext: no extension to tell the figure's format"),
    (["--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"], r"--plot and --json both name .*/r.png: --plot would "
                                                         r"overwrite --json"),
    (["--costs", "{tmp}/mine.json", "--json", "{tmp}/mine.json"], r"--json and --costs both name .*/mine.json: "
                                                                  r"--json would overwrite --costs"),
    (["--costs", "{tmp}/mine.json", "--plot", "{tmp}/mine.json"], r"--plot and --costs both name .*/mine.json"),
])
def test_outputs_are_refused_before_any_work_where_they_would_be_lost(argv, message, tmp_path, monkeypatch, capsys):
    """An unsupported figure format failed with matplotlib's traceback after the work; an output over
    another output, or over the calibration read, replaced it."""
    MEASURED.save(tmp_path / "mine.json")
    monkeypatch.setattr(command, "predict", lambda *a: pytest.fail("predicted before checking the outputs"))
    assert _run(*[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert Costs.load(tmp_path / "mine.json") == MEASURED


def test_plot_formats_follow_the_extension(tmp_path):
    args = _parse("--algos", "ring", "--plot", str(tmp_path / "p.pdf"))
    records = [command.record(point, 0.1) for point in command.points(args)]
    command.plot(records, args.plot, "title")
    assert (tmp_path / "p.pdf").read_bytes()[:5] == b"%PDF-"


@pytest.mark.parametrize("content", [None, "not json"])
def test_calibrating_from_costs_that_cannot_be_read_is_refused_naming_them(content, tmp_path, monkeypatch, capsys):
    """Calibration takes the link's goodput from --costs where it cannot measure one; an unreadable file
    was skipped without a word and its goodput replaced by 0.96."""
    monkeypatch.setattr(calibrate, "calibrate_median", lambda *a, **k: pytest.fail("calibrated"))
    costs = tmp_path / "costs.json"
    if content is not None:
        costs.write_text(content)
    assert _run("--costs", str(costs), "--calibrate", str(tmp_path / "new.json")) == 2
    err = capsys.readouterr().err
    assert f"sparcoll simulate: --costs {costs}: " in err and "leave --costs out" in err, err
    assert not (tmp_path / "new.json").exists()
