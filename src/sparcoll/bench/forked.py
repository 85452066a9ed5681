"""Local job processes forked from one fork server that has imported torch and sparcoll already.

A loopback job's every worker used to be a new interpreter importing torch: 1.7 s of CPU each, two to
four of them at once on the machine's cores, before the first step of every job (a `sparcoll plan` trial
runs one job per candidate, a `train --compare` one per mode). Forked from a server that did those
imports once, a worker starts in tens of milliseconds. The server is multiprocessing's fork server,
started on first use with OMP_NUM_THREADS=1 (each job process runs one torch thread), glibc's thread
cache off (allocator.startup_environment) and PRELOAD imported; tests fork their ranks from it too
(tests/ranks.py). PRELOAD has torch._dynamo, which DistributedDataParallel's constructor imports (2 s a
worker, measured under the profiler: ncf tiny on 4 workers, `--compare ddp,sparcoll,hook`, 12.4 s
without it, 3.8-4.4 s with it). As with multiprocessing's other start methods but fork, each child
imports the launching program's main module again: a script that launches jobs keeps its work under `if
__name__ == "__main__":` (the `sparcoll` command does).

A forked child runs `python -m MODULE ARGS` as a new interpreter would: in the environment and
current directory its launcher gives it (with PYTHONPATH and the directory in front of its import
path), stdout to a pipe or its log file, stderr to the log, and SIGKILL when the fork server dies
(which it does when the launcher does). `ForkedChild` offers the part of subprocess.Popen the
launcher uses, so launch.py treats both kinds alike. A child of an emulated host first enters that
host's network namespace (setns on /run/netns/NAME, what `ip netns exec` does for sockets; the fork
left it one thread, so every thread it starts is in the namespace too).
"""
from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import runpy
import signal
import subprocess
import sys
import threading
import time

from ..allocator import startup_environment

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "sparcoll", "sparcoll.communicator",
           "sparcoll.aggregator", "sparcoll.server", "sparcoll.torch", "sparcoll.bench.worker",
           "sparcoll.train.worker"]
PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000
_LOCK = threading.Lock()
_started = False


def fork_context():
    """The multiprocessing context of this process's fork server, started on first use with
    OMP_NUM_THREADS=1, glibc's tunables for keeping freed memory (allocator.startup_environment:
    read at start only, so the children have them from the server) and PRELOAD imported (the
    server's environment is this process's of that moment; a child then takes the one it is given)."""
    global _started
    ctx = mp.get_context("forkserver")
    with _LOCK:
        if not _started:
            server_env = startup_environment({**os.environ, "OMP_NUM_THREADS": "1"})
            saved = {name: os.environ.get(name) for name in server_env}
            os.environ.update(server_env)
            try:
                ctx.set_forkserver_preload(PRELOAD)
                forkserver.ensure_running()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            _started = True
    return ctx


class ForkedChild:
    """`python -m module *args` in a process of the fork server, with Popen's poll, wait, terminate,
    kill, returncode, pid and (when `pipe_stdout`) stdout, a pipe's read end."""

    def __init__(self, module: str, args: list[str], env: dict, log: str, pipe_stdout: bool,
                 netns: str | None = None):
        ctx = fork_context()
        read_end, write_end = ctx.Pipe(duplex=False) if pipe_stdout else (None, None)
        self._process = ctx.Process(target=_run_module, args=(module, list(args), dict(env), os.getcwd(), log,
                                                                write_end, netns), name=module)
        self._process.start()
        if write_end is not None:
            write_end.close()       # the child has its own copy: end of file once it exits
        self.stdout = read_end
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; subprocess.TimeoutExpired if the child still runs after `timeout` s."""
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def reap(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the child to exit (polling: a signal's KeyboardInterrupt
        cannot leave anything half done); whether it did."""
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True

    def _signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:      # exited meanwhile; the fork server collects it
                pass


def _run_module(module: str, args: list[str], env: dict, cwd: str, log: str, stdout,
                netns: str | None) -> None:
    """In the child: become `python -m module *args` started in `cwd` with `env`, in network
    namespace `netns` if given."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:                                            # the fork server died already
        os._exit(1)
    # Output to the log first: a failure below (the namespace removed by a launcher interrupted
    # meanwhile) goes there, not to the user's terminal after the launcher's "interrupted".
    logged = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(logged, 2)
    os.dup2(stdout.fileno() if stdout is not None else logged, 1)
    os.close(logged)
    if stdout is not None:
        stdout.close()
    if netns is not None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {netns}")
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd, *path]
    faulthandler.enable()       # a crash in native code (gloo, torch) leaves every thread's stack in the log
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

