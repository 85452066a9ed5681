"""The table of docs/reliability.md's injected-exception section: each case of test_injected.py run
once, printed with what each rank raised and how fast.   .venv/bin/python tests/injected_report.py"""
import threading
import time

import pytest
import torch.distributed as dist

import test_injected as harness
from sparcoll.communicator import Communicator
from support import error_chain, on_threads


def run_case(step: str, victim: int) -> str:
    monkeypatch, store = pytest.MonkeyPatch(), dist.HashStore()
    before = set(threading.enumerate())
    comms = {}
    on_threads(lambda r: comms.__setitem__(r, Communicator(
        dist.PrefixStore("x/", store), r, 2, timeout=harness.TIMEOUT, message_blocks=64)), 2)
    inputs = {r: harness.sparse_input(r) for r in range(2)}
    on_threads(lambda r: comms[r].allreduce(inputs[r].clone()), 2)
    harness.inject(monkeypatch, step, comms[victim], inputs[victim])
    out = {}

    def run(rank):
        t = time.monotonic()
        try:
            comms[rank].allreduce(inputs[rank])
            out[rank] = "no error"
        except Exception as exc:
            cause = " (cause: Injected)" if "Injected" in error_chain(exc) else ""
            out[rank] = f"{type(exc).__name__} in {time.monotonic() - t:.2f} s{cause}"
    try:
        on_threads(run, 2, timeout=3 * harness.TIMEOUT)
    finally:
        t = time.monotonic()
        for comm in comms.values():
            comm.close()
        close_s = time.monotonic() - t
        monkeypatch.undo()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = len(set(threading.enumerate()) - before)
    return f"| {step} | {victim} | {out[victim]} | {out[1 - victim]} | {close_s:.2f} s | {left} |"


if __name__ == "__main__":
    for step in harness.STEPS:
        for victim in (0, 1):
            print(run_case(step, victim))
