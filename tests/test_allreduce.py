"""sparcoll.allreduce across real processes over TCP on loopback, against independent dense references."""
import threading
import time

import pytest
import torch

import scenarios
from ranks import run_ranks
from scenarios import check_outcome
from support import join_all

TIMEOUT = 240


@pytest.mark.parametrize("world", [2, 4])
def test_colocated_every_dtype_op_shape_density(world):
    cases = scenarios.correctness_cases(world)
    outcomes = run_ranks(scenarios.run_correctness, world, timeout=TIMEOUT, cases=cases)
    check_outcome(outcomes, cases)
    assert all(o["stats"].collectives == len(cases) for o in outcomes)


def test_colocated_small_blocks_many_messages_and_streams():
    cases = scenarios.correctness_cases(2)[::3]
    outcomes = run_ranks(scenarios.run_correctness, 2, timeout=TIMEOUT, cases=cases, block_size=7,
                         streams=3, message_blocks=5, credits=2)
    check_outcome(outcomes, cases)


def test_dedicated_aggregators_via_environment(dedicated_processes):
    cases = scenarios.correctness_cases(2)[::2]
    outcomes = run_ranks(scenarios.run_correctness, 2, timeout=TIMEOUT, cases=cases,
                         env={"SPARCOLL_AGGREGATORS": ",".join(dedicated_processes)})
    check_outcome(outcomes, cases)


def test_dedicated_aggregator_serves_two_jobs_at_once(dedicated_processes):
    cases = scenarios.correctness_cases(2)[1::4]
    results, errors = {}, []

    def job(name, world):
        try:
            results[name] = run_ranks(scenarios.run_correctness, world, timeout=TIMEOUT,
                                      cases=cases, aggregators=dedicated_processes)
        except BaseException as exc:   # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(n, w), daemon=True) for n, w in (("a", 2), ("b", 3))]
    for t in threads:
        t.start()
    join_all(threads, TIMEOUT + 30)
    assert not errors, errors
    assert set(results) == {"a", "b"}, sorted(results)
    for outcomes in results.values():
        check_outcome(outcomes, cases)


def test_few_long_runs_go_in_place_and_scattered_blocks_through_one_buffer():
    """A message of a few long runs of blocks is sent from and received into the tensor's memory
    (one view a run); one of many short runs goes through one buffer (a gather, a scatter), where
    a view a run would cost more than the copy (worker.run_limit). Both sum exactly."""
    nblocks = 2048                                      # 2 ranges of 1024 blocks of 1 KiB
    long_runs = [b for b in range(nblocks) if b // 128 % 2 == 0]  # runs of 128 KiB, 2 a message
    scattered = list(range(0, nblocks, 128))                      # 8 runs of one block a range
    outcomes = run_ranks(scenarios.run_layouts, 2, timeout=TIMEOUT, nblocks=nblocks,
                         layouts={"long": long_runs, "scattered": scattered})
    for outcome in outcomes:
        long_ok, long_in_place, long_buffered = outcome["long"]
        scattered_ok, scattered_in_place, scattered_buffered = outcome["scattered"]
        assert long_ok and scattered_ok, outcome
        # remote messages: this rank's contribution out, the peer's aggregator's result in
        assert long_in_place >= 2 and long_buffered == 0, outcome
        assert scattered_in_place == 0 and scattered_buffered >= 2, outcome


def test_random_float_sums_within_float_tolerance():
    errors = run_ranks(scenarios.run_float_sums, 4, timeout=TIMEOUT, numel=300_001)
    assert max(errors) <= 4 - 1


def test_nan_inf_and_negative_zero():
    for outcome in run_ranks(scenarios.run_special_values, 2, timeout=TIMEOUT):
        assert outcome["special"]
        assert outcome["negative_zero_blocks_sent"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire_match_the_formula(world):
    reports = run_ranks(scenarios.run_byte_accounting, world, timeout=TIMEOUT,
                        densities=[0.01, 0.1, 1.0], numel=1 << 20, message_blocks=64)
    for rank, report in enumerate(reports):
        for row in report:
            assert row["sent"] == row["expected_sent"], (rank, row)
            assert row["received_data"] == row["expected_received_data"], \
                (rank, sorted(row.items()))
            assert row["agg_received"] == row["expected_agg_received"], (rank, row)
            assert row["agg_sent_data"] == row["expected_agg_sent_data"], (rank, row)
            # Metadata beyond the fixed per-message header: 4 index bytes per 1 KiB block (0.4%).
            payload = row["remote_blocks"] * 1024
            metadata = row["sent"] - payload - 56 * row["messages_sent"]
            assert 0 <= metadata <= 0.02 * payload, (rank, row)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_reused_right_after_return_leaves_peers_exact(world):
    for rank, exact in enumerate(run_ranks(scenarios.run_overwrite_after_return, world,
                                           timeout=TIMEOUT, rounds=6, numel=1 << 20)):
        assert all(exact), (rank, exact)


def test_bad_input_raises_on_every_rank_quickly():
    outcomes = run_ranks(scenarios.run_bad_inputs, 2, timeout=TIMEOUT)
    for rank, outcome in enumerate(outcomes):
        for name, (kind, text, elapsed) in outcome.items():
            assert not kind.startswith(("UNEXPECTED", "NO ERROR")), (rank, name, kind, text)
            assert elapsed < 10, (rank, name, elapsed)
            if name.endswith("/then"):
                assert kind == "PoisonedError", (rank, name, kind)
    r0, r1 = outcomes
    assert r0["int64_on_rank0"][0] == "TypeError" and "torch.int64" in r0["int64_on_rank0"][1]
    assert "torch.int64" in r1["int64_on_rank0"][1]
    for rank in (r0, r1):
        assert rank["complex_everywhere"][0] == "TypeError"
        assert rank["bool_everywhere"][0] == "TypeError"
        assert rank["numel_mismatch"][0] == "MismatchError" and "numel" in rank["numel_mismatch"][1]
        assert rank["dtype_mismatch"][0] == "MismatchError" and "dtype" in rank["dtype_mismatch"][1]
    assert r1["meta_device_on_rank1"][0] == "ValueError" and "meta" in r1["meta_device_on_rank1"][1]
    assert "meta" in r0["meta_device_on_rank1"][1]
    assert r0["sparse_on_rank0"][0] == "TypeError"
    assert r0["op_max_on_rank0"][0] == "ValueError" and "max" in r0["op_max_on_rank0"][1]
    assert "max" in r1["op_max_on_rank0"][1]


def test_interrupted_blocking_allreduce_fails_the_peers_at_once():
    r0, r1 = run_ranks(scenarios.run_interrupted, 2, timeout=TIMEOUT)
    assert r0["interrupted"][0] == "KeyboardInterrupt" and r0["interrupted"][2] < 5, r0
    kind, text, elapsed = r1["interrupted"]
    assert kind != "NO ERROR" and "interrupted" in text and elapsed < 5, r1
    assert r0["then"][0] == "PoisonedError" and r1["then"][0] == "PoisonedError", (r0, r1)


def test_blocking_allreduce_inside_a_done_callback_with_work_queued():
    r0, r1 = run_ranks(scenarios.run_blocking_call_in_done_callback, 2, timeout=TIMEOUT)
    assert r0["thread"] == "sparcoll-engine", r0
    for outcome in (r0, r1):
        assert (outcome["first"], outcome["second"], outcome.get("inner")) == (2.0, 4.0, 3.0), outcome


def test_a_callback_added_while_the_earlier_ones_run_runs_after_them():
    """sparse.allreduce_coo copies the sum into the caller's tensor in a Work's first done-callback;
    the torch future the caller waits on completes in one added later, which the caller's thread ran
    at once when the Work had finished, even while the engine thread was still copying: on 2 ranks
    all_reduce of a COO tensor once returned the rank's own input."""
    from sparcoll.engine import Work

    work = Work(torch.zeros(1), 0, time.monotonic() + 30)
    copying, release, order = threading.Event(), threading.Event(), []

    def copy(done):
        copying.set()
        release.wait(10)
        order.append("copied")
    work.add_done_callback(copy)
    finishing = threading.Thread(target=work._finish, args=(None,), daemon=True)
    finishing.start()
    assert copying.wait(10)
    work.add_done_callback(lambda done: order.append("completed"))
    assert not work.is_completed()          # wait() returns once the copy is in, not before
    release.set()
    assert work.wait(10) is work.tensor and order == ["copied", "completed"]
    finishing.join(10)
    work.add_done_callback(lambda done: order.append("at once"))      # all ran: a new one runs here
    assert order[-1] == "at once"


def test_a_done_callback_that_raises_fails_the_work_for_the_callbacks_after_it():
    """A copy of the sum into the caller's tensor that raised was logged and the collective still
    completed as a success: the caller read its own input as the sum."""
    from sparcoll import SparcollError
    from sparcoll.engine import Work

    work, seen = Work(torch.zeros(1), 7, time.monotonic() + 30), []
    work.add_done_callback(lambda done: 1 / 0)
    work.add_done_callback(lambda done: seen.append(done.exception()))
    work._finish(None)
    assert isinstance(seen[0], SparcollError) and isinstance(seen[0].__cause__, ZeroDivisionError)
    with pytest.raises(SparcollError, match="allreduce 7: a done-callback raised ZeroDivisionError"):
        work.wait(1)


UNREACHABLE_TIMEOUT = 2.0


def _unreachable(rank, world, address):
    import sparcoll
    start = time.monotonic()
    try:
        sparcoll.init(aggregators=[address], timeout=UNREACHABLE_TIMEOUT)
    except sparcoll.CollectiveTimeout as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_unreachable_dedicated_aggregator_fails_within_timeout():
    import socket
    with socket.socket() as s:     # bound, never listening: connections are refused, and no other
        s.bind(("127.0.0.1", 0))   # socket (the rank's own, another test's) can take the port meanwhile
        address = "127.0.0.1:%d" % s.getsockname()[1]
        (text, elapsed), = run_ranks(_unreachable, 1, timeout=60, address=address)
    # Its own 2 s deadline, not the 60 s default: a bound loose enough for a loaded machine.
    assert address in text and elapsed < 10 * UNREACHABLE_TIMEOUT, (text, elapsed)


def test_sparse_coo_allreduce_without_densifying():
    cases = [("aligned-rows", (1000, 16), 40, "sum"), ("unaligned-rows", (333, 7), 25, "avg"),
             ("wide-rows", (50, 600), 5, "sum"), ("no-entries", (100, 4), 0, "sum"),
             ("big-table", (1_000_000, 32), 64, "sum"), ("one-wide", (5000, 1), 60, "sum"),
             ("narrow-rows", (4000, 4), 30, "avg")]
    for rank, outcome in enumerate(run_ranks(scenarios.run_coo, 3, timeout=TIMEOUT, cases=cases)):
        for name, shape, _, _ in cases:
            row = outcome[name]
            assert row["exact"] and row["layout"] == "torch.sparse_coo", (rank, name, row)
            assert row["shape"] == shape
            # the rows listed are rows some rank stored (a block of narrow rows carries untouched
            # ones as zeros), and every row whose sum holds something
            assert row["rows_nobody_stored"] == 0 and row["rows_missing"] == 0, (rank, name, row)
            # Only blocks that this rank's entries touch leave it (a table of 32M elements
            # would be 125000 blocks dense).
            assert row["blocks_sent"] <= row["max_blocks"], (rank, name, row)


def test_message_size_fits_the_measured_link_rate():
    from sparcoll.message_size import MESSAGE_SECONDS, fit_message_blocks
    kib = 1024
    # A 1 Gbit/s link (at most 125 MB/s) gets 256 KiB messages, loopback-like rates the limit.
    assert fit_message_blocks(110e6, kib, 2048) == 256
    assert fit_message_blocks(800e6, kib, 2048) == 2048
    assert fit_message_blocks(1e3, kib, 2048) == 256        # never below limit / 8
    assert fit_message_blocks(1e3, 4, 4) == 1
    previous = 0
    for rate in [10 ** (e / 4) for e in range(16, 44)]:       # 10 kB/s .. 10 GB/s
        size = fit_message_blocks(rate, kib, 2048)
        assert size & (size - 1) == 0 and 256 <= size <= 2048 and size >= previous
        assert size == 256 or size * kib <= rate * MESSAGE_SECONDS   # no message over its time
        previous = size
