"""Network namespaces owned by a benchmark run: running ``ip``/``tc``, who owns a namespace, and the
clean-up of namespaces whose owner died.

A run's namespaces are named ``<prefix>-<pid>x<hex>-<role>`` (role ``br`` or ``h<i>``): the owner's pid
is part of every name, and is also recorded with its start time under ``/run/sparcoll-netem/``, so
:func:`cleanup_stale` can remove what a SIGKILLed owner left behind without touching live runs (a
recycled pid does not keep garbage alive). ``netem.EmulatedNetwork`` builds the network itself.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Sequence

#: Timeout (seconds) of every ``ip``/``tc`` invocation.
COMMAND_TIMEOUT = 10.0
#: Where owner records are kept (one JSON file per run).
OWNER_DIR = "/run/sparcoll-netem"

_NETNS_DIR = "/run/netns"
_RUNID_RE = re.compile(r"^(\d+)x([0-9a-f]{6})$")
_ROLE_RE = re.compile(r"^(br|h\d+)$")


class NetemError(RuntimeError):
    """An emulated-network operation failed (includes the command and its stderr)."""


class NetemUnavailable(NetemError):
    """Emulated networks cannot be used here (not root, or iproute2 missing)."""


def netem_problems() -> list[str]:
    """What keeps an emulated network from being built here (none: it can be)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    problems = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        problems.append("not running as root")
    if missing:
        problems.append(f"{' and '.join(missing)} not found on PATH")
    return problems


def netem_available() -> tuple[bool, str]:
    """Whether :class:`EmulatedNetwork` can work here, and if not, why."""
    problems = netem_problems()
    if problems:
        return False, (
            "an emulated network needs root and iproute2 (ip, tc): "
            + "; ".join(problems)
            + ". Use --network none (plain loopback) instead."
        )
    return True, ""


def run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> str:
    """Run a command with a timeout; raise NetemError naming it and its stderr on failure."""
    argv = [str(a) for a in argv]
    try:
        cp = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
            # Own session: a Ctrl-C in the terminal interrupts us (and we clean up),
            # but does not kill an ip/tc command half-way.
            start_new_session=True,
        )
    except subprocess.CalledProcessError as e:
        raise NetemError(
            f"command failed (exit status {e.returncode}): {shlex.join(argv)}\n"
            f"stderr: {(e.stderr or '').strip() or '(empty)'}"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise NetemError(f"command timed out after {timeout:g} s: {shlex.join(argv)}") from e
    except FileNotFoundError as e:
        raise NetemUnavailable(
            f"cannot run {argv[0]!r}: an emulated network needs root and iproute2 (ip, tc). "
            "Use --network none (plain loopback) instead."
        ) from e
    return cp.stdout


def list_netns() -> list[str]:
    out = run(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_NETNS_DIR, name))


def delete_netns(name: str) -> bool:
    """Delete one namespace by name; True if it is gone afterwards.  Never raises."""
    if not netns_exists(name):
        return True
    try:
        run(["ip", "netns", "delete", name])
    except Exception:
        pass
    return not netns_exists(name)


def kill_inside(name: str) -> list[int]:
    """SIGKILL every process in namespace ``name``; the pids signalled. Never raises."""
    try:
        pids = [int(pid) for pid in run(["ip", "netns", "pids", name]).split()]
    except (NetemError, ValueError):
        return []
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, None if /proc has no entry."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def proc_starttime(pid: int) -> int | None:
    st = _proc_stat(pid)
    return None if st is None else st[1]


def pid_alive(pid: int, starttime: int | None = None) -> bool:
    """Whether process ``pid`` (started at ``starttime``, if known) still runs."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    st = _proc_stat(pid)
    if st is None:
        return True  # kill(0) says it exists; /proc is not telling more
    state, actual = st
    if state in ("Z", "X"):
        return False  # zombie: it will never clean up
    if starttime is not None and actual != starttime:
        return False  # the pid was reused by another process
    return True


def owner_file(prefix: str, runid: str) -> str:
    return os.path.join(OWNER_DIR, f"{prefix}-{runid}.json")


def parse_name(name: str, prefix: str) -> tuple[str, int] | None:
    """(runid, owner pid) of a namespace name made by EmulatedNetwork with ``prefix``."""
    head = f"{prefix}-"
    if not name.startswith(head):
        return None
    runid, _, role = name[len(head) :].rpartition("-")
    m = _RUNID_RE.match(runid)
    if not m or not _ROLE_RE.match(role):
        return None
    return runid, int(m.group(1))


def cleanup_stale(prefix: str = "sparcoll") -> list[str]:
    """Delete leftover namespaces ``<prefix>-<pid>x<hex>-...`` whose owner process is dead.

    The owner pid is read from the name; if the owner record under
    ``/run/sparcoll-netem/`` exists, the pid's start time must also match (so a
    recycled pid does not keep garbage alive).  Namespaces of live owners and
    names that do not parse are never touched.  Returns the deleted names.
    """
    ok, reason = netem_available()
    if not ok:
        raise NetemUnavailable(reason)
    deleted: list[str] = []
    dead_runs: set[str] = set()
    alive_cache: dict[str, bool] = {}
    for name in list_netns():
        parsed = parse_name(name, prefix)
        if parsed is None:
            continue
        runid, pid = parsed
        if runid not in alive_cache:
            starttime = None
            try:
                with open(owner_file(prefix, runid)) as f:
                    record = json.load(f)
                if record.get("pid") == pid:
                    starttime = record.get("starttime")
            except (OSError, ValueError):
                pass
            alive_cache[runid] = pid_alive(pid, starttime)
        if alive_cache[runid]:
            continue
        dead_runs.add(runid)
        kill_inside(name)   # what outlived its launcher there: torchrun's workers, in sessions of their own
        if delete_netns(name):
            deleted.append(name)
    # Owner records of dead runs that have no namespace left.
    remaining = _safe_list_netns()
    try:
        records = os.listdir(OWNER_DIR)
    except OSError:
        records = []
    for fname in records:
        if not (fname.startswith(f"{prefix}-") and fname.endswith(".json")):
            continue
        runid = fname[len(prefix) + 1 : -len(".json")]
        m = _RUNID_RE.match(runid)
        if not m or any(n.startswith(f"{prefix}-{runid}-") for n in remaining):
            continue
        path = os.path.join(OWNER_DIR, fname)
        if runid not in dead_runs:
            try:
                with open(path) as f:
                    starttime = json.load(f).get("starttime")
            except (OSError, ValueError):
                starttime = None
            if pid_alive(int(m.group(1)), starttime):
                continue  # a live run that is still being set up, or has no namespace yet
        try:
            os.unlink(path)
        except OSError:
            pass
    return deleted


def _safe_list_netns() -> list[str]:
    try:
        return list_netns()
    except NetemError:
        return []


def interface_counters(name: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of interface `name` in this process's network namespace."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            iface, _, data = line.partition(":")
            if iface.strip() == name:
                fields = data.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"interface {name!r} not found in /proc/self/net/dev")
