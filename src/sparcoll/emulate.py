"""`sparcoll emulate`: run your own torch.distributed script with each rank on a host of its own,
behind a shaped link (network namespaces on one bridge, as `sparcoll bench` builds them; needs root
and iproute2), to see on one machine what a slow network does to your training and what sparcoll
wins there.

    sudo sparcoll emulate --hosts 4 --network 1gbit train.py --epochs 1

Each rank runs `python SCRIPT ARGS` with the environment torchrun gives a job of one process per host
(RANK, WORLD_SIZE, LOCAL_RANK 0, MASTER_ADDR the first host's address, ...), GLOO_SOCKET_IFNAME set to
the hosts' interface so that gloo takes the shaped link, and OMP_NUM_THREADS 1 unless set: the hosts
share this machine's cores. Their output comes here line by line, each line after "[rank R] " (the
ranks share this terminal; lines written at once by two ranks would otherwise run together; a
progress bar's redraws come as lines of their own). When a
rank fails, the others are stopped (as torchrun does) and the exit code is the first failing rank's;
every process is stopped and every namespace removed on the way out, Ctrl-C and --timeout included;
if this command is killed outright (SIGKILL), the kernel ends the ranks, and the next run removes
the namespaces it left.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import selectors
import subprocess
import sys
import time

from .allocator import startup_environment
from .bench.launch import NETNS_MASTER_PORT, die_with_parent
from .bench.netem import (MAX_HOSTS, EmulatedNetwork, add_link_burst_argument, check_link_burst,
                          cleanup_stale, netem_available)
from .bench.netns import NetemError

POLL = 0.1              # seconds between looks at the ranks
DRAIN = 5.0             # seconds the output of ranks that ended may take to arrive whole
LINE_END = re.compile(rb"(\r\n|\r|\n)")   # a carriage return ends a line too: a progress bar (tqdm)
                                            # redraws its line after one, and would show only at its end
LONGEST_LINE = 1 << 16  # bytes of a line held back for its end, at most: the rest is passed on as is
READ_BYTES = 1 << 16    # read from a rank's pipe at a time
DRAIN_BYTES = 4 << 20   # read from each pipe at the end, at most: a rank still running may write without end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=4,
                        help=f"emulated hosts, one rank each (default 4, at most {MAX_HOSTS})")
    parser.add_argument("--network", default="1gbit", type=lambda text: text.strip().lower(),
                        help="the links' rate: 1gbit, 10gbit, 100mbit ... or none, unshaped "
                             "(default 1gbit)")
    add_link_burst_argument(parser)
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds the whole job may take before every rank is stopped "
                             "(default 3600)")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def rank_environment(rank: int, world: int, master: str, interface: str) -> dict[str, str]:
    """What torchrun sets for a job of one process per host, plus the interface gloo must use and
    glibc's tunables for a process that keeps freed memory (allocator.startup_environment)."""
    env = {**startup_environment(os.environ), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "ROLE_RANK": str(rank),
           "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master, "MASTER_PORT": str(NETNS_MASTER_PORT),
           "GLOO_SOCKET_IFNAME": interface}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _refuse(problem: str) -> int:
    print(f"sparcoll emulate: {problem}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.hosts <= MAX_HOSTS:
        return _refuse(f"--hosts {args.hosts}: between 1 and {MAX_HOSTS}")
    if not os.path.isfile(args.script):
        return _refuse(f"no script {args.script!r}")
    if not 0 < args.timeout < math.inf:     # (nan stopped every rank at once, "after the timeout")
        return _refuse(f"--timeout {args.timeout:g} must be a positive number of seconds")
    available, reason = netem_available()
    if not available:
        return _refuse(f"cannot build an emulated network here: {reason}")
    try:
        check_link_burst(args.link_burst, args.network)
        network = EmulatedNetwork(args.hosts, None if args.network == "none" else args.network,
                                  burst_bytes=args.link_burst)
    except ValueError as exc:
        return _refuse(str(exc))
    try:
        for name in cleanup_stale():    # of an earlier run that was killed outright
            print(f"sparcoll emulate: removed namespace {name} left by a process that died", file=sys.stderr)
        with network as net, Relay() as relay:
            procs = []
            for i in range(args.hosts):
                procs.append(net.popen(i, [sys.executable, args.script, *args.args],
                                       env=rank_environment(i, args.hosts, net.addresses[0], net.interface),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       preexec_fn=die_with_parent))
                relay.add(i, procs[-1])
            return _wait(procs, relay, time.monotonic() + args.timeout)
    except NetemError as exc:       # the network could not be built (or removed): what ip said
        print(f"sparcoll emulate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:       # Ctrl-C or SIGTERM: the ranks and the network are gone by now
        print("sparcoll emulate: interrupted", file=sys.stderr)
        return 130


class Relay:
    """The ranks' output, a whole line at a time (ended by a newline or a carriage return, or
    LONGEST_LINE bytes), each after "[rank R] ", to this process's stdout and stderr as the rank
    wrote it."""

    def __init__(self):
        self._selector = selectors.DefaultSelector()
        self._partial: dict[int, bytes] = {}

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc) -> None:
        """What is left in the pipes (a failed rank's last words; at most DRAIN_BYTES of each, since
        a rank still running may write without end), then no more."""
        for key in list(self._selector.get_map().values()):
            for _ in range(DRAIN_BYTES // READ_BYTES):
                if not self._read(key):
                    break
            if key.fd in self._partial:     # not ended by the reads
                self._end(key)
        self._selector.close()

    def add(self, rank: int, proc: subprocess.Popen) -> None:
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe, selectors.EVENT_READ, (f"[rank {rank}] ", out))
            self._partial[pipe.fileno()] = b""

    @property
    def open(self) -> bool:
        return bool(self._selector.get_map())

    def pump(self, timeout: float) -> None:
        """Pass on what arrived within `timeout` seconds."""
        for key, _ in self._selector.select(timeout):
            self._read(key)

    def _read(self, key) -> bool:
        """Pass on the whole lines of what one pipe holds; False once it holds nothing (or ended)."""
        try:
            chunk = os.read(key.fd, READ_BYTES)
        except BlockingIOError:
            return False
        if not chunk:
            self._end(key)
            return False
        data = self._partial[key.fd] + chunk
        held = data.endswith(b"\r")        # its "\n" may come in the next read
        *parts, rest = LINE_END.split(data[:-1] if held else data)
        # (line, its end) pairs; nothing for the empty "line" before a progress bar's carriage return
        lines = [line for line, end in zip(parts[::2], parts[1::2]) if line or end != b"\r"]
        while len(rest) > LONGEST_LINE:
            lines.append(rest[:LONGEST_LINE])
            rest = rest[LONGEST_LINE:]
        self._partial[key.fd] = rest + b"\r" if held else rest
        self._write(key, lines)
        return True

    def _end(self, key) -> None:
        rest = self._partial.pop(key.fd, b"").removesuffix(b"\r")
        self._write(key, [rest] if rest else [])
        self._selector.unregister(key.fileobj)
        key.fileobj.close()

    @staticmethod
    def _write(key, lines: list[bytes]) -> None:
        prefix, out = key.data
        if lines:
            out.write("".join(f"{prefix}{line.decode(errors='replace')}\n" for line in lines))
            out.flush()


def _wait(procs: list[subprocess.Popen], relay: Relay, deadline: float) -> int:
    """Every rank's end, their output passed on meanwhile: 0 when all succeed, else the first
    failing rank's code (1 for a signal or the deadline), once the others are stopped (by the
    network's teardown)."""
    while time.monotonic() < deadline:
        relay.pump(POLL)
        codes = [p.poll() for p in procs]
        failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is not None:
            code = codes[failed]
            how = f"died of signal {-code}" if code < 0 else f"exited with code {code}"
            print(f"sparcoll emulate: rank {failed} {how}; stopping the others", file=sys.stderr)
            return code if code > 0 else 1
        if all(code == 0 for code in codes):
            drained = time.monotonic() + DRAIN
            while relay.open and time.monotonic() < drained:
                relay.pump(POLL)
            return 0
    running = [rank for rank, p in enumerate(procs) if p.poll() is None]
    print(f"sparcoll emulate: ranks {running} still running after the timeout; stopping them",
          file=sys.stderr)
    return 1
