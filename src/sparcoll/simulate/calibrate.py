"""Measure on this machine what the simulator's costs are: `sparcoll simulate --calibrate OUT`.

Each per-byte cost is the best of a few runs of the operation sparcoll or gloo performs (the scan, an
add, a gather, TCP through loopback). Costs not visible in isolation are fitted to runs of the real thing
with 2 workers on loopback, where no link limits it:
- `message_s`: sparcoll forced onto its sparse path with 16-block messages (1024 messages per worker
  for 4M floats), its per-message cost the one at which the model predicts the measured time;
- `collective_s`: the same at 1% density, where each worker sends one message per aggregator;
- `gloo_step_s`: gloo's ring on 1K floats, per step beyond the latency;
- `coalesce_s_per_byte`: gloo's sparse allreduce of 4M floats at 100%, whose sum and coalesce cost far
  more inside gloo's path than torch's sum and coalesce alone.
A fit that reaches the end of its search range is logged: the model then prices less than measured.
The link's goodput is measured through an emulated link (root only; else the value given).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import torch

from ..bench.netem import EmulatedNetwork, NetemUnavailable
from ..blocks import nonzero_mask
from . import model
from .costs import Costs

NUMEL = 4 << 20          # floats per measured operation (16 MiB)
BLOCK = 256
SOCKET_BYTES = 256 << 20
PINGS = 2000
BENCH_TIMEOUT = 300.0    # seconds for each loopback run
GOODPUT_RATE = "1gbit"
GOODPUT_BYTES = 48 << 20
FIT_MESSAGE_BLOCKS = 16


def best_seconds(operation: Callable[[], object], repeat: int = 10) -> float:
    operation()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        operation()
        times.append(time.perf_counter() - start)
    return min(times)


def scan_cost() -> float:
    rows = torch.randn(NUMEL).view(-1, BLOCK)
    return best_seconds(lambda: nonzero_mask(rows)) / (NUMEL * 4)


def add_cost() -> float:
    a, b = torch.randn(NUMEL), torch.randn(NUMEL)
    return best_seconds(lambda: a.add_(b)) / (NUMEL * 4)


def copy_cost() -> float:
    rows = torch.randn(NUMEL).view(-1, BLOCK)
    picked = torch.arange(0, rows.shape[0], 2)
    out = torch.empty(len(picked), BLOCK)
    return best_seconds(lambda: torch.index_select(rows, 0, picked, out=out)) / (out.numel() * 4)


def socket_costs() -> tuple[float, float]:
    """(CPU seconds per byte through a loopback TCP connection, both ends; one-way latency)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=30)
        peer, _ = server.accept()
        peer.settimeout(30)
    chunk = bytes(1 << 20)
    failures: list[BaseException] = []

    def send_all() -> None:
        try:
            for _ in range(SOCKET_BYTES // len(chunk)):
                client.sendall(chunk)
            for _ in range(PINGS):
                client.sendall(b"x")
                client.recv(1)
        except BaseException as exc:   # reported by the measuring thread below
            failures.append(exc)

    buffer = bytearray(1 << 20)
    with client, peer:
        sender = threading.Thread(target=send_all, daemon=True)
        cpu = time.process_time()
        sender.start()
        received = 0
        while received < SOCKET_BYTES:
            got = peer.recv_into(buffer, min(len(buffer), SOCKET_BYTES - received))
            if not got:
                raise ConnectionError("loopback connection closed while measuring")
            received += got
        cpu = time.process_time() - cpu
        start = time.perf_counter()
        for _ in range(PINGS):
            peer.recv(1)
            peer.sendall(b"y")
        latency = (time.perf_counter() - start) / PINGS / 2
        sender.join(timeout=30)
    if failures:
        raise failures[0]
    return cpu / SOCKET_BYTES, latency


RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0)); server.settimeout(60)
print(server.getsockname()[1], flush=True)
conn, _ = server.accept(); conn.settimeout(60)
buf = bytearray(1 << 20); got = conn.recv_into(buf); start = time.perf_counter()
total = 0
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    total += n
print(total, time.perf_counter() - start, flush=True)
"""
SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3]) // len(chunk)):
    conn.sendall(chunk)
conn.close()
"""


def goodput(rate: str = GOODPUT_RATE) -> float:
    """Payload bit/s of one TCP flow through an emulated link of `rate`, over the rate."""
    with EmulatedNetwork(2, rate, prefix="sparcoll-calib") as net:
        receiver = net.popen(1, [sys.executable, "-c", RECEIVER, net.addresses[1]],
                             stdout=subprocess.PIPE, text=True)
        port = receiver.stdout.readline().strip()
        sender = net.popen(0, [sys.executable, "-c", SENDER, net.addresses[1], port, str(GOODPUT_BYTES)])
        sender.wait(timeout=120)
        out, _ = receiver.communicate(timeout=120)
        total, seconds = out.split()
        return int(total) * 8 / float(seconds) / net.rate_bps


def bench_median(algo: str, numel: str, density: float = 1.0, env: dict | None = None, repeat: int = 7) -> float:
    """Median seconds of `algo` (dense input) over 2 workers on loopback, by `sparcoll bench`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        try:
            subprocess.run([sys.executable, "-m", "sparcoll", "bench", "--network", "none", "--workers", "2",
                            "--numel", numel, "--density", str(density), "--algos", algo, "--repeat", str(repeat),
                            "--warmup", "2", "--json", path],
                           env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=BENCH_TIMEOUT)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"sparcoll bench of {algo} failed: {exc.stderr[-2000:]}") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"sparcoll bench of {algo} did not finish within {BENCH_TIMEOUT:g} s") from None
        with open(path) as f:
            records = json.load(f)
    return next(r["median_s"] for r in records if r["algo"] == algo and r["input"] == "dense")


def fit(measured: float, predict: Callable[[float], float], high: float) -> float:
    """The x in [0, high] at which the increasing `predict` equals `measured` (bisection)."""
    low = 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) < measured else (low, mid)
    return (low + high) / 2


def fit_cost(costs: Costs, name: str, point: model.Point, measured: float, high: float,
             log: Callable[[str], None]) -> Costs:
    """`costs` with `name` set so that the model predicts `measured` for `point` (logged where even
    `high` predicts less)."""
    value = fit(measured, lambda x: model.predict(point, dataclasses.replace(costs, **{name: x})), high)
    if value > 0.999 * high:
        log(f"{name}: even {high:g} predicts less than the measured {measured * 1e3:.1f} ms; kept at {high:g}")
    return dataclasses.replace(costs, **{name: value})


def calibrate(default_goodput: float, cores: int, log: Callable[[str], None] = print) -> Costs:
    """Every cost, measured here. `cores`: this machine's, shared by the loopback runs' processes."""
    socket_s, latency = socket_costs()
    try:
        link = goodput()
    except NetemUnavailable as exc:
        log(f"goodput not measured ({exc}); using {default_goodput}")
        link = default_goodput
    costs = Costs(scan_s_per_byte=scan_cost(), add_s_per_byte=add_cost(), copy_s_per_byte=copy_cost(),
                  socket_s_per_byte=socket_s, coalesce_s_per_byte=0.0, message_s=0.0,
                  collective_s=0.0, gloo_step_s=0.0, latency_s=latency, goodput=link)
    log(f"measured: {costs}")
    ring_tiny = bench_median("ring", "1K", repeat=50)
    costs = dataclasses.replace(costs, gloo_step_s=max(0.0, ring_tiny / 2 - latency))

    def loopback(algo: str, density: float, **options) -> model.Point:
        return model.Point(algo, 2, 4 << 20, density, None, cores=cores, **options)

    many = loopback("sparse", 1.0, message_blocks=FIT_MESSAGE_BLOCKS)
    sparse = loopback("sparse", 0.01)
    many_s = bench_median("sparse", "4M", env={"SPARCOLL_MESSAGE_BLOCKS": str(FIT_MESSAGE_BLOCKS)})
    sparse_s = bench_median("sparse", "4M", density=0.01)
    for _ in range(3):    # both runs depend on both costs; each is mostly one of them
        costs = fit_cost(costs, "message_s", many, many_s, high=0.01, log=log)
        costs = fit_cost(costs, "collective_s", sparse, sparse_s, high=0.1, log=log)
    agsparse_s = bench_median("agsparse", "4M")
    costs = fit_cost(costs, "coalesce_s_per_byte", loopback("agsparse", 1.0), agsparse_s, high=1e-7, log=log)
    check_s = bench_median("sparse", "4M")
    predicted = model.predict(loopback("sparse", 1.0), costs)
    note = (f"measured by `sparcoll simulate --calibrate` on {os.cpu_count()} cores, torch {torch.__version__}, "
            f"2 workers on loopback: ring 1K floats {ring_tiny * 1e3:.3f} ms (gloo_step_s); sparse 4M floats "
            f"in {FIT_MESSAGE_BLOCKS}-block messages {many_s * 1e3:.1f} ms and at 1% {sparse_s * 1e3:.1f} ms "
            f"(message_s, collective_s fitted); agsparse 4M {agsparse_s * 1e3:.1f} ms (coalesce_s_per_byte "
            f"fitted); check, sparse 4M at 100%: measured {check_s * 1e3:.1f} ms, predicted {predicted * 1e3:.1f} ms")
    log(note)
    return dataclasses.replace(costs, note=note)


def calibrate_median(rounds: int, default_goodput: float, cores: int,
                     log: Callable[[str], None] = print) -> Costs:
    """The median of each cost over `rounds` calibrations: single runs on a shared machine differ by
    up to 5x in a per-byte cost (measured: a gather 18-97 ps/byte in three runs)."""
    runs = [calibrate(default_goodput, cores, log) for _ in range(rounds)]
    values = {f.name: statistics.median(getattr(run, f.name) for run in runs)
              for f in dataclasses.fields(Costs) if f.name != "note"}
    note = f"the median of each cost over {rounds} runs of: " + "; ".join(run.note for run in runs)
    return Costs(**values, note=note)
