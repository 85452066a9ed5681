"""Run one benchmark job: the worker processes (one per host) and any dedicated aggregators, on loopback
or on an EmulatedNetwork, streaming rank 0's events back to the caller. Workers are started directly, or
(launcher "torchrun") by a torchrun agent per emulated host with c10d rendezvous, as users launch
multi-host jobs, so the two can be compared on the same links. Workers and aggregators are forked
from a fork server that has imported torch (forked.py), inside their host's namespace on an emulated
network; torchrun's agents are new interpreters.

Every child is stopped on every way out (success, error, timeout, Ctrl-C): terminated, then killed. Each
child also gets SIGKILL from the kernel if the launcher dies without cleaning up (PR_SET_PDEATHSIG, kept
across the `ip netns exec` exec). A job fails as soon as a child exits with an error, rank 0 reports an
error, or no event arrives for `timeout` seconds; the failure names the culprit and shows its log's tail.

`run_jobs` runs a command's jobs under a progress bar (rich) on stderr: redrawn in place on a terminal;
elsewhere (CI logs, pipes) a line for a new kind of step at most every LOG_EVERY_S seconds, and one at
the end, so logs stay short.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from sparcoll.allocator import startup_environment
from sparcoll.bench.events import decode
from sparcoll.bench.forked import ForkedChild
from sparcoll.bench.memory import meminfo
from sparcoll.bench.netem import EmulatedNetwork, NetemError

# In a namespace of our own nothing else listens, so fixed ports cannot collide there.
NETNS_MASTER_PORT = 29500
NETNS_AGGREGATOR_PORT = 29600
NETNS_RDZV_PORT = 29400
EXIT_GRACE = 30.0   # seconds the workers get to exit after rank 0 said it is done
LOG_TAIL = 20       # lines of a child's log shown in a failure
TAIL_BYTES = 1 << 20      # ... read from the end of each log, at most
LOG_WIDTH = 200     # columns of a progress line off a terminal (rich assumes 80 there)
LOG_EVERY_S = 5.0   # off a terminal, a progress line at most this often (a step each: a line per step)


#: Threads of a job, measured on loopback with colocated aggregators: a worker ran 14, 18 and 22 threads
#: with 2, 3 and 4 workers. Each connection between a worker and an aggregator takes a sender and a
#: receiver at each end; the rest is each process's own (gloo's, torch's, sparcoll's engine ...).
THREADS_PER_CONNECTION = 4
THREADS_PER_PROCESS = 10


def job_threads(workers: int, dedicated_aggregators: int) -> int:
    """About how many threads a job runs, all of them on this machine (loopback or emulated hosts)."""
    connections = workers * (dedicated_aggregators or workers - 1)
    return THREADS_PER_CONNECTION * connections + THREADS_PER_PROCESS * (workers + dedicated_aggregators)


def thread_limit() -> tuple[int, str] | None:
    """The most threads this machine lets one user run, and where that limit is set (None: none known).
    `ulimit -u` does not hold for root (the kernel exempts it), kernel.threads-max for everyone."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        limits.append((soft, "ulimit -u"))
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            limits.append((int(f.read()), "kernel.threads-max"))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def check_job_threads(workers: int, dedicated: bool, num_aggregators: int | None) -> None:
    """A ValueError if a job of `workers` would need more threads than this machine allows (`dedicated`:
    with `num_aggregators` aggregators of their own, None: as many as workers): 300 workers on loopback
    failed part way with "can't start new thread"."""
    def threads(n: int) -> int:
        return job_threads(n, (num_aggregators or n) if dedicated else 0)

    limit = thread_limit()
    if limit is None or threads(workers) <= limit[0]:
        return
    most = next((n for n in range(workers - 1, 1, -1) if threads(n) <= limit[0]), None)
    aggregators = f" and {(num_aggregators or workers)} dedicated aggregators" if dedicated else ""
    raise ValueError(f"--workers {workers}: a job of {workers} workers{aggregators} runs all its processes on this "
                     f"machine, about {threads(workers):,} threads ({THREADS_PER_CONNECTION} per connection between "
                     f"a worker and an aggregator, {THREADS_PER_PROCESS} per process); this machine lets a user run "
                     f"{limit[0]:,} ({limit[1]})" + ("" if most is None else f": at most {most} workers here"))


#: Signals that end a process which crashed in native code (its log then holds faulthandler's stacks).
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})


class BenchError(RuntimeError):
    """The benchmark job failed (wrong result, crashed or hung child); the message says where.
    `crashed` names the job's processes that had ended by a CRASH_SIGNALS signal when it failed, and
    the signal ("worker 1 (signal SIGABRT)")."""
    crashed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Job:
    workers: int
    network: str               # "none" (loopback) or a tc rate such as "1gbit"
    dedicated_aggregators: int  # 0: none started
    config: dict               # the workers' configuration (see worker.py), minus the network parts
    timeout: float             # seconds without an event before the job is declared hung
    worker: str = "sparcoll.bench.worker"   # the module each worker process runs with the config
    env: dict = field(default_factory=dict)  # extra environment of the workers
    launcher: str = "direct"   # "direct": we start every worker; "torchrun": an agent per host does
    link_burst: int | None = None  # the links' token bucket in bytes (None: netem's default for the rate)


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen | ForkedChild
    log: str


def die_with_parent() -> None:
    """For a child's preexec_fn: the kernel kills the child when its parent dies, even by SIGKILL,
    when no clean-up of the parent's can run."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held together while probing, so distinct)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _reap(proc: subprocess.Popen | ForkedChild, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `proc` to exit and collect it, by its pid rather than
    Popen.wait: SIGTERM becomes a KeyboardInterrupt (cli.py), and one raised inside Popen.poll()
    can leave the Popen's internal lock taken, after which Popen never collects the process (a
    terminated bench then waited out its kill and exited 1; seen once in CI)."""
    if isinstance(proc, ForkedChild):
        return proc.reap(timeout)
    end = time.monotonic() + timeout
    while proc.returncode is None:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:       # Popen collected it meanwhile
            return True
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= end:
            return False
        else:
            time.sleep(0.01)
    return True


def _stop(children: list[_Child]) -> None:
    running = [c.proc for c in children if c.proc.returncode is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + 3.0
    for p in running:
        if not _reap(p, max(0.0, deadline - time.monotonic())):
            p.kill()
            _reap(p, 5.0)
    for c in children:
        if c.proc.stdout:
            c.proc.stdout.close()


def _tails(children: list[_Child]) -> str:
    parts = []
    for c in children:
        try:
            with open(c.log, "rb") as f:     # its end only: a child may have flooded it
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
                lines = f.read().decode(errors="replace").splitlines()[-LOG_TAIL:]
        except FileNotFoundError:       # a forked child that died before it opened its log
            lines = ["(no output: it ended before it started its log)"]
        code = c.proc.poll()
        ended = "" if code is None else f"; it ended with {_describe_exit(code)}"
        if lines or ended:
            parts.append(f"--- {c.name} (last lines of its output{ended}) ---\n" + "\n".join(lines))
    return "\n".join(parts)


def _crash_signal(code: int | None) -> bool:
    return code is not None and code < 0 and -code in CRASH_SIGNALS


def _describe_exit(code: int) -> str:
    """How a child ended, as a failure shows it (before the launcher stops the others: a SIGKILL
    then came from outside, most often the kernel's out-of-memory killer, which the child cannot
    report itself)."""
    if code == -signal.SIGKILL:
        return ("signal SIGKILL, which sparcoll had not sent: most often the kernel's out-of-memory "
                f"killer (`dmesg` says; this host has {_memory_gib()} of memory for all the job's processes)")
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def _memory_gib() -> str:
    """The host's total memory, as "23.4 GiB" ("an unknown amount" without /proc/meminfo)."""
    total = meminfo("MemTotal")
    return "an unknown amount" if total is None else f"{total / 2 ** 30:.1f} GiB"


#: torchrun's agents give the workers rank, world size and the Store's address; restarts need their own
#: Store per attempt with torch 2.13 (docs/cluster.md).
TORCHRUN_ENV = {"RANK": None, "WORLD_SIZE": None, "MASTER_ADDR": None, "MASTER_PORT": None,
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_agent(hosts: list[str], host: int, nnodes: int, module: str, config: str) -> list[str]:
    """The torchrun command (python's arguments, "-m" and on) of emulated host `host`, one worker per
    host, as users launch multi-host jobs: c10d rendezvous on host 0, whose agent hosts it (is_host),
    every agent advertising its own address (--local-addr; the machine's hostname resolves outside
    the namespaces). Node ranks follow the agents' addresses, so rank 0, whose events the launcher
    follows, runs on host 0."""
    argv = ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{NETNS_RDZV_PORT}",
            "--local-addr", hosts[host], "--monitor-interval", "0.5"]
    if host == 0:
        argv += ["--rdzv-conf", "is_host=true"]
    return argv + ["-m", module, config]


def run_job(job: Job, on_event: Callable[[dict], None]) -> None:
    """Run `job`, passing every event of rank 0 but the last ("done") to `on_event`; raise BenchError."""
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="sparcoll-bench-") as tmp, contextlib.ExitStack() as stack:
        total = job.workers + job.dedicated_aggregators
        if job.launcher == "torchrun" and job.network == "none":
            raise BenchError("the torchrun launcher runs one agent per emulated host: it needs --network")
        port_file = None
        if job.network == "none":
            hosts = ["127.0.0.1"] * total
            agg_ports = free_ports(job.dedicated_aggregators)
            master_port, port_file = 0, os.path.join(tmp, "master-port")    # rank 0 picks it (worker.py)
            interface, counted_interface = "lo", None  # loopback counters mix every process's traffic
            net = None
        else:
            net = stack.enter_context(EmulatedNetwork(total, job.network, burst_bytes=job.link_burst))
            hosts = net.addresses
            master_port, agg_ports = NETNS_MASTER_PORT, [NETNS_AGGREGATOR_PORT] * job.dedicated_aggregators
            interface = counted_interface = net.interface

        def spawn(host: int, command: list[str], env: dict, log: str, pipe_stdout: bool):
            """`python -m ...` (`command`, "-m" and on) forked into `host`'s namespace; a torchrun
            agent (only on an emulated network) a new interpreter there."""
            if job.launcher != "torchrun":
                module, *args = command[1:]
                return ForkedChild(module, args, env, log, pipe_stdout,
                                   netns=None if net is None else net.namespaces[host])
            with open(log, "wb") as f:
                return net.popen(host, [sys.executable, *command], env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE if pipe_stdout else f, stderr=f,
                                 preexec_fn=die_with_parent)
        stack.callback(_stop, children)  # runs before the network is torn down

        env = {**startup_environment(os.environ), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": interface,
               "SPARCOLL_SECRET": secrets.token_hex(16), "MASTER_ADDR": hosts[0],
               "MASTER_PORT": str(master_port), "WORLD_SIZE": str(job.workers),
               "SPARCOLL_MASTER_PORT_FILE": port_file}

        def start(name: str, host: int, command: list[str], extra_env: dict, pipe_stdout: bool = False):
            """Start `python -m ...` (`command`, "-m" and on) on `host`."""
            log = os.path.join(tmp, f"{name.replace(' ', '')}.log")
            child_env = {k: v for k, v in {**env, **extra_env}.items() if v is not None}
            proc = spawn(host, command, child_env, log, pipe_stdout)
            children.append(_Child(name, proc, log))
            return proc

        aggregators = [f"{hosts[job.workers + a]}:{agg_ports[a]}" for a in range(job.dedicated_aggregators)]
        for a, address in enumerate(aggregators):
            host, port = address.rsplit(":", 1)
            start(f"aggregator {a}", job.workers + a,
                  ["-m", "sparcoll", "aggregator", "--host", host, "--port", port], {})

        config = os.path.join(tmp, "config.json")
        with open(config, "w") as f:
            json.dump({**job.config, "interface": counted_interface, "aggregators": aggregators or None}, f)
        if job.launcher == "torchrun":
            workers = [start(f"torchrun agent {host}", host, torchrun_agent(hosts, host, job.workers, job.worker, config),
                             {**job.env, **TORCHRUN_ENV}, pipe_stdout=host == 0)
                       for host in range(job.workers)]
        else:
            workers = [start(f"worker {rank}", rank, ["-m", job.worker, config],
                             {**job.env, "RANK": str(rank)}, pipe_stdout=rank == 0)
                       for rank in range(job.workers)]
        try:
            _follow(workers[0], children, job, on_event)
        except BenchError as failure:
            ended = [(c.name, c.proc.poll()) for c in children]
            failure.crashed = tuple(f"{name} ({_describe_exit(code)})" for name, code in ended if _crash_signal(code))
            raise
        _await_workers(children[job.dedicated_aggregators:])


def _follow(rank0: subprocess.Popen, children: list[_Child], job: Job, on_event: Callable[[dict], None]) -> None:
    """Read rank 0's events until "done"; fail on an error event, a failed child or a silence."""
    fd, pending, last = rank0.stdout.fileno(), b"", time.monotonic()
    while True:
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 1 << 16)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                event = decode(line)
                if event is None:
                    continue
                last = time.monotonic()
                if event["event"] == "error":
                    time.sleep(1.0)  # let the other ranks write their side of the story
                    raise BenchError(f"the job failed: {event['message']}\n{_tails(children)}")
                if event["event"] == "done":
                    return
                on_event(event)
            if not chunk:
                raise BenchError(f"worker 0 exited ({_describe_exit(rank0.wait(5))}) before finishing\n"
                                 f"{_tails(children)}")
        for c in children:
            code = c.proc.poll()
            if code is not None and (code != 0 or c.name.startswith("aggregator")):
                raise BenchError(f"{c.name} exited with {_describe_exit(code)}\n{_tails(children)}")
        if time.monotonic() - last > job.timeout:
            raise BenchError(f"no progress for {job.timeout:g} s: the job looks hung\n{_tails(children)}")


def _await_workers(workers: list[_Child]) -> None:
    """Workers exit after "done". A crash at exit (a rare SIGABRT of gloo in this torch build) is
    reported but does not void results the workers already checked and reported."""
    deadline = time.monotonic() + EXIT_GRACE
    for c in workers:
        try:
            code = c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"warning: {c.name} did not exit within {EXIT_GRACE:g} s of finishing; killed",
                  file=sys.stderr)
            continue
        if code != 0:
            print(f"warning: {c.name} exited with {_describe_exit(code)} after reporting its results",
                  file=sys.stderr)


@contextlib.contextmanager
def _progress_bar(steps: int):
    """A progress bar of `steps` steps on stderr; yields advance(what), which counts one finished step
    of `what`. It redraws only when a step finishes (no refresh thread: the processes being timed
    share the machine's cores). Off a terminal nothing is redrawn: a line is printed for a new `what`
    at most every LOG_EVERY_S seconds (the first at once), and at the end. advance(what, more) also
    adds `more` steps to the total (a job that learns how much work it has only once started)."""
    console = Console(stderr=True, emoji=False)   # "poseidon:ring: step 3" is no emoji code
    if not console.is_terminal:
        console.width = LOG_WIDTH   # a log line is not cut to a screen's width
    # On a terminal the description takes what the other columns leave and is cut to fit one line.
    description = Column(ratio=1, no_wrap=True, overflow="ellipsis")
    columns = (BarColumn(bar_width=30), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}", table_column=description, markup=False))
    with Progress(*columns, console=console, auto_refresh=False, expand=console.is_terminal,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=steps)
        (state,) = bar.tasks
        printed = [-math.inf]      # when the last line was, off a terminal

        def advance(what: str, more: int = 0) -> None:
            new = what != state.description
            bar.update(task, total=state.total + more, advance=1, description=what, refresh=True)
            due = new and time.monotonic() - printed[0] >= LOG_EVERY_S
            if not console.is_terminal and (due or state.finished):
                printed[0] = time.monotonic()
                console.print(bar.get_renderable())
        yield advance


def run_jobs(command: str, steps: int, body: Callable[[Callable[[str], None]], None]) -> int:
    """Run body(advance) (which runs jobs and calls advance(what) per finished step) under a progress
    bar of `steps` steps; the exit status of `sparcoll <command>`: 0, or 1 with the reason printed when
    a job failed, or 130 when interrupted (the launcher has already stopped every child and removed
    the network)."""
    with _progress_bar(steps) as advance:
        try:
            body(advance)
        except (BenchError, NetemError) as exc:
            status, message = 1, str(exc)
        except KeyboardInterrupt:
            status, message = 130, "interrupted"
        else:
            status, message = 0, ""
    if status:
        print(f"sparcoll {command}: {message}", file=sys.stderr)
    return status
