"""`sparcoll emulate`: a user's own script with each rank on an emulated host of its own. Its ranks
reduce through sparcoll and gloo across the hosts' addresses; a failing rank, or the deadline, stops
the rest and leaves no process or namespace behind. Needs root and iproute2 (skipped otherwise),
except for the refusal of bad options."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparcoll.bench.netem import netem_available
from sparcoll.bench.netns import list_netns

_AVAILABLE, _REASON = netem_available()
needs_netem = pytest.mark.skipif(not _AVAILABLE, reason=f"emulated network unavailable: {_REASON}")
TIMEOUT = 120

REDUCE = """
    import json, os, socket, torch, torch.distributed as dist
    import sparcoll
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = sparcoll.init()
    blocks = torch.zeros(1 << 16)
    blocks[rank * 256:(rank + 1) * 256] = rank + 1.0      # one block a rank: the sparse path
    comm.allreduce(blocks)
    dense = torch.full((1000,), rank + 1.0)
    dist.all_reduce(dense)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ["MASTER_ADDR"], 9))
        address = probe.getsockname()[0]
    print(json.dumps({"rank": rank, "world": world, "address": address,
                      "blocks": blocks[:1024:256].tolist(), "dense": dense.unique().tolist(),
                      "threads": os.environ["OMP_NUM_THREADS"]}), flush=True)
    comm.close()
    dist.destroy_process_group()
"""

# rank 1 fails once every other rank has said who it is (at most 30 s); they would sleep far beyond
# the test's deadline
FAIL_ONE = """
    import os, sys, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 1:
        others = [os.path.join({directory!r}, f"pid{{r}}") for r in range(world) if r != 1]
        deadline = time.monotonic() + 30
        while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("failing on purpose", file=sys.stderr)
        sys.exit(3)
    mine = os.path.join({directory!r}, f"pid{{rank}}")
    with open(mine + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(mine + ".tmp", mine)      # whole when it appears
    time.sleep(600)
"""


def emulate(tmp_path, script: str, *options: str) -> tuple[subprocess.CompletedProcess, int, float]:
    """Run `script` under `sparcoll emulate OPTIONS`: its result, its pid and how long it took."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    start = time.monotonic()
    with subprocess.Popen([sys.executable, "-m", "sparcoll", "emulate", *options, str(path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.terminate()        # its clean-up runs on SIGTERM as on Ctrl-C
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"sparcoll emulate did not end within {TIMEOUT} s: {err[-2000:]}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return result, proc.pid, time.monotonic() - start


def namespaces_of(pid: int) -> list[str]:
    return [name for name in list_netns() if name.startswith(f"sparcoll-{pid}x")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sleeping_ranks(tmp_path, pids: list, stderr) -> subprocess.Popen:
    """`sparcoll emulate` of 2 ranks that sleep 600 s, once both have started (their pids put in
    `pids`, for stop_all)."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(FAIL_ONE.format(directory=str(tmp_path)).replace("rank == 1",
                                                                                     "rank == -1")))
    proc = subprocess.Popen([sys.executable, "-m", "sparcoll", "emulate", "--hosts", "2", "--network",
                             "none", str(path)], stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    files = [tmp_path / f"pid{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in files) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids += [int(f.read_text()) for f in files if f.exists()]
    if len(pids) < 2:
        stop_all(proc, pids)
        pytest.fail("the ranks did not start")
    return proc


def stop_all(proc, pids: list) -> None:
    """The command and its ranks ended, whatever the test left running."""
    if proc and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for p in filter(alive, pids):   # only if the test failed
        os.kill(p, signal.SIGKILL)


@needs_netem
def test_every_rank_runs_on_its_own_host_and_reduces_across_them(tmp_path):
    result, pid, _ = emulate(tmp_path, REDUCE, "--hosts", "3", "--network", "1gbit")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("] ", 1) for line in result.stdout.splitlines() if line.startswith("[rank ")]
    ranks = sorted((json.loads(text) for _, text in lines), key=lambda r: r["rank"])
    assert sorted(prefix for prefix, _ in lines) == ["[rank 0", "[rank 1", "[rank 2"], lines
    assert [r["rank"] for r in ranks] == [0, 1, 2] and {r["world"] for r in ranks} == {3}
    addresses = [r["address"] for r in ranks]
    assert len(set(addresses)) == 3 and all(a.startswith("10.77.") for a in addresses), addresses
    for r in ranks:
        assert r["blocks"] == [1.0, 2.0, 3.0, 0.0]      # every rank's block, summed through sparcoll
        assert r["dense"] == [6.0] and r["threads"] == "1"
    assert namespaces_of(pid) == []


@needs_netem
def test_a_failing_rank_stops_the_others_and_gives_its_exit_code(tmp_path):
    result, pid, took = emulate(tmp_path, FAIL_ONE.format(directory=str(tmp_path)), "--hosts", "3",
                                "--network", "none")
    assert result.returncode == 3 and "rank 1 exited with code 3" in result.stderr, result.stderr[-3000:]
    assert "[rank 1] failing on purpose" in result.stderr       # a failed rank's last words are kept
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 2)]
    assert not any(alive(p) for p in pids) and took < 60
    assert namespaces_of(pid) == []


@needs_netem
def test_the_timeout_stops_every_rank(tmp_path):
    script = FAIL_ONE.format(directory=str(tmp_path)).replace("rank == 1", "rank == -1")   # nobody fails
    result, pid, took = emulate(tmp_path, script, "--hosts", "2", "--network", "none", "--timeout", "8")
    assert result.returncode == 1 and "still running after the timeout" in result.stderr, result.stderr
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in (0, 1)]
    assert not any(alive(p) for p in pids) and 8 <= took < 60
    assert namespaces_of(pid) == []


@needs_netem
def test_ranks_end_with_the_command_when_it_is_killed_outright(tmp_path):
    """SIGKILL leaves the command no clean-up: the kernel ends its ranks (they would sleep 600 s),
    and the next run removes the namespaces it left."""
    proc, pids = [], []
    try:
        proc = sleeping_ranks(tmp_path, pids, subprocess.DEVNULL)
        left = namespaces_of(proc.pid)
        assert len(left) >= 2, left
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids)
    finally:
        stop_all(proc, pids)
    again, _, _ = emulate(tmp_path, "print('next run')", "--hosts", "1", "--network", "none")
    assert again.returncode == 0 and "[rank 0] next run" in again.stdout, again.stderr[-3000:]
    assert all(f"removed namespace {name}" in again.stderr for name in left), again.stderr[-3000:]
    assert namespaces_of(proc.pid) == []


@needs_netem
def test_sigterm_ends_the_ranks_and_the_network_with_one_line(tmp_path):
    """SIGTERM (as Ctrl-C) while the ranks run: they and their namespaces go, and the command says so
    in one line with exit status 130 (before: KeyboardInterrupt's traceback, and death by SIGINT)."""
    proc, pids = [], []
    try:
        proc = sleeping_ranks(tmp_path, pids, subprocess.PIPE)
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        stop_all(proc, pids)
    assert proc.returncode == 130 and "sparcoll emulate: interrupted" in err and "Traceback" not in err, err
    assert not any(alive(p) for p in pids) and namespaces_of(proc.pid) == []


def test_progress_bars_and_endless_lines_are_passed_on_while_the_rank_runs(capsys):
    """A rank's carriage returns end lines (a progress bar redraws after one) and a line longer than
    LONGEST_LINE is passed on in pieces: neither waits for a newline that may come only at the end."""
    from sparcoll.emulate import LONGEST_LINE, Relay
    script = ("import sys, time\n"
              "sys.stdout.write('\\r  0%|\\r 50%|\\r100%|'); sys.stdout.flush()\n"
              f"sys.stderr.write('x' * {LONGEST_LINE + 10}); sys.stderr.flush()\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Relay() as relay:
            relay.add(0, proc)
            out, err = "", ""
            deadline = time.monotonic() + 30
            while ("[rank 0]  50%|" not in out or "x" not in err) and time.monotonic() < deadline:
                relay.pump(0.1)
                captured = capsys.readouterr()
                out, err = out + captured.out, err + captured.err
            assert proc.poll() is None          # passed on while the rank still runs
            proc.kill()
            proc.wait(timeout=30)
        captured = capsys.readouterr()
        out, err = out + captured.out, err + captured.err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert out.splitlines() == ["[rank 0]   0%|", "[rank 0]  50%|", "[rank 0] 100%|"], out
    assert err.splitlines() == [f"[rank 0] {'x' * LONGEST_LINE}", "[rank 0] xxxxxxxxxx"], err[-200:]


@pytest.mark.parametrize("options, problem", [
    (["--hosts", "0"], "--hosts 0: between 1 and"),
    (["--timeout", "0"], "--timeout 0 must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout nan must be a positive number of seconds"),   # before: ran, stopped at once
])
def test_bad_options_are_refused_with_the_reason(tmp_path, options, problem):
    result, _, _ = emulate(tmp_path, "print('never')", *options)
    assert result.returncode == 2 and problem in result.stderr and "never" not in result.stdout
