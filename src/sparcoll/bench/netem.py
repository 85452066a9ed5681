"""An emulated network of N hosts on one Linux machine, for benchmarks.

Topology::

    <prefix>-<runid>-h0 : eth0 10.77.X.1/24 ==veth== h0 ┐
    <prefix>-<runid>-h1 : eth0 10.77.X.2/24 ==veth== h1 ├─ br0 (in <prefix>-<runid>-br)
    ...                                                 ┘

Every host is a network namespace with one veth interface (``eth0``); the other
end of each veth is a port of a Linux bridge that lives in its own namespace, so
the root namespace gets no interface, address or route.  All addresses are in
one private /24 that is only visible inside the namespaces of this run (the
third octet is derived from the run id; as every run has its own bridge
namespace, two concurrent runs could not collide even with the same /24).

Bandwidth shaping
-----------------
Each host link is shaped with a token bucket filter (``tbf``) in BOTH
directions: on the host's ``eth0`` egress (the uplink) and on the bridge-side
port's egress (the downlink).  Shaping only the uplinks would model a network
whose switch ports have infinite capacity towards the hosts: in a 2-to-1 incast
two senders at "1 Gbit/s" each delivered 1.9 Gbit/s into a single "1 Gbit/s"
receiver.  With the downlink shaped too, a host can neither send nor receive
faster than its link rate, as with a real NIC behind a switch.

``tbf`` parameters: ``rate R burst B latency 50ms`` with
``B = max(8 ms worth of R, 128 KiB)``.  At 1 Gbit/s this is 1 MB, the value that
measured 0.96 Gbit/s for one TCP flow; it scales linearly with the rate so the
bucket always covers several timer ticks, and never goes below two maximal
(64 KiB) GSO packets that veth hands to the qdisc, so tbf does not have to
re-segment them.  ``latency 50ms`` bounds the queue (limit = R * 50 ms + B).

What cannot be emulated here
----------------------------
The kernel on the project's machines has ``tbf`` and ``htb`` but no ``netem``
(nor ``fq``, ``fq_codel``, ``sfq``, ``cake``, ``prio`` or the police action):
propagation delay, jitter and packet loss cannot come from ``tc`` and must be
emulated in the transport or the test harness if needed.  The only latency in
this network is the queueing delay of the token buckets.

Lifetime
--------
``EmulatedNetwork`` is a context manager.  The namespaces it created (and only
those, by name) are deleted on exit, on an exception, on Ctrl-C, at interpreter
exit (``atexit``) and on SIGTERM/SIGHUP (a handler that cleans up and then
chains to the previous handler, or dies of the signal if there was none).
Deleting a namespace destroys its veth ends.  A SIGKILLed owner cannot clean up:
:func:`cleanup_stale` removes namespaces whose owner process is dead (the owner
pid is part of every name and is also recorded with its start time under
``/run/sparcoll-netem/``).

Requires root and iproute2 (``ip``, ``tc``); otherwise :class:`NetemUnavailable`
is raised — run benchmarks with ``--network none`` (plain loopback) instead.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "EmulatedNetwork",
    "NetemError",
    "NetemUnavailable",
    "cleanup_stale",
    "netem_available",
    "parse_rate",
    "tbf_burst_bytes",
]

#: Timeout (seconds) of every ``ip``/``tc`` invocation.
COMMAND_TIMEOUT = 10.0
#: Where owner records are kept (one JSON file per run).
OWNER_DIR = "/run/sparcoll-netem"
#: Interface name of the veth end inside each host namespace.
HOST_INTERFACE = "eth0"
BRIDGE_INTERFACE = "br0"
#: tbf ``latency`` parameter (bounds the queue of each token bucket).
TBF_LATENCY = "50ms"
MAX_HOSTS = 254

_NETNS_DIR = "/run/netns"
_RUNID_RE = re.compile(r"^(\d+)x([0-9a-f]{6})$")
_ROLE_RE = re.compile(r"^(br|h\d+)$")


class NetemError(RuntimeError):
    """An emulated-network operation failed (includes the command and its stderr)."""


class NetemUnavailable(NetemError):
    """Emulated networks cannot be used here (not root, or iproute2 missing)."""


# --------------------------------------------------------------------------- rates

_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
}


def parse_rate(rate: str | int) -> int:
    """Parse a ``tc``-style rate into bits per second.

    ``"1gbit" -> 1_000_000_000``, ``"500Mbit" -> 500_000_000``,
    ``"2.5gbit" -> 2_500_000_000``, ``"1000"`` or ``1000 -> 1000``.  Units are
    decimal (SI) as in ``tc``: bit, kbit, mbit, gbit (and tbit), case-insensitive.
    Byte units (``tc``'s ``bps``, ``mbps`` ...) are rejected to avoid the
    bit/byte ambiguity.  Raises ``ValueError`` for anything else or a rate < 1 bit/s.
    """
    if isinstance(rate, bool):
        raise ValueError(f"invalid rate {rate!r}: expected e.g. '1gbit', '500mbit' or a number of bit/s")
    if isinstance(rate, int):
        value: float = rate
    elif isinstance(rate, str):
        m = _RATE_RE.match(rate)
        if not m or m.group(2).lower() not in _RATE_UNITS:
            raise ValueError(
                f"invalid rate {rate!r}: expected a number followed by one of "
                "bit, kbit, mbit, gbit (e.g. '1gbit', '500mbit'), or a plain number of bit/s"
            )
        value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"invalid rate {rate!r}: expected a string such as '1gbit' or an int (bit/s)")
    bps = int(round(value))
    if bps < 1:
        raise ValueError(f"invalid rate {rate!r}: must be at least 1 bit/s")
    return bps


def tbf_burst_bytes(rate_bps: int) -> int:
    """Token-bucket size used for a link of ``rate_bps``: 8 ms of line rate, at least 128 KiB."""
    return max(math.ceil(rate_bps / 8 * 0.008), 128 * 1024)


# --------------------------------------------------------------------------- helpers


def netem_available() -> tuple[bool, str]:
    """Whether :class:`EmulatedNetwork` can work here, and if not, why."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    problems = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        problems.append("not running as root")
    if missing:
        problems.append(f"{' and '.join(missing)} not found on PATH")
    if problems:
        return False, (
            "an emulated network needs root and iproute2 (ip, tc): "
            + "; ".join(problems)
            + ". Use --network none (plain loopback) instead."
        )
    return True, ""


def _run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> str:
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


def _list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"])
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(_NETNS_DIR, name))


def _delete_netns(name: str) -> bool:
    """Delete one namespace by name; True if it is gone afterwards.  Never raises."""
    if not _netns_exists(name):
        return True
    try:
        _run(["ip", "netns", "delete", name])
    except Exception:
        pass
    return not _netns_exists(name)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, None if /proc has no entry."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _proc_starttime(pid: int) -> int | None:
    st = _proc_stat(pid)
    return None if st is None else st[1]


def _pid_alive(pid: int, starttime: int | None = None) -> bool:
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


def _owner_file(prefix: str, runid: str) -> str:
    return os.path.join(OWNER_DIR, f"{prefix}-{runid}.json")


# --------------------------------------------------------------------------- live registry
# Networks not yet torn down, for the atexit and signal handlers.

_LIVE: dict[int, "EmulatedNetwork"] = {}
_HANDLERS_INSTALLED = False
_ATEXIT_INSTALLED = False
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_HANDLER_LOCK = threading.Lock()


def _cleanup_all() -> None:
    for net in list(_LIVE.values()):
        try:
            net.close()
        except BaseException:  # noqa: BLE001 - best effort at exit
            pass


def _on_signal(signum: int, frame: Any) -> None:
    _cleanup_all()
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or unknown): die of the signal as we would have without us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _ATEXIT_INSTALLED, _HANDLERS_INSTALLED
    with _HANDLER_LOCK:
        if not _ATEXIT_INSTALLED:
            atexit.register(_cleanup_all)
            _ATEXIT_INSTALLED = True
        # Signal handlers can only be installed from the main thread; elsewhere we
        # rely on atexit, __exit__ and cleanup_stale() (until a main-thread network comes).
        if _HANDLERS_INSTALLED or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous = signal.getsignal(sig)
            if previous is _on_signal:
                continue
            _PREVIOUS_HANDLERS[sig] = previous
            signal.signal(sig, _on_signal)
        _HANDLERS_INSTALLED = True


# --------------------------------------------------------------------------- the network


class EmulatedNetwork:
    """``hosts`` network namespaces on one shaped bridge; see the module docstring.

    >>> with EmulatedNetwork(3, "1gbit") as net:          # doctest: +SKIP
    ...     procs = [net.popen(i, [sys.executable, "worker.py"],
    ...                        env={**os.environ, "GLOO_SOCKET_IFNAME": net.interface,
    ...                             "MASTER_ADDR": net.addresses[0]})
    ...              for i in range(3)]

    Attributes (valid after construction):

    - ``namespaces``: host namespace names, index = host number.
    - ``addresses``: IPv4 address (str) of each host.
    - ``interface``: the interface name inside every host namespace (``eth0``).
    - ``bridge_namespace``: the namespace holding the bridge.
    - ``rate_bps``: link rate in bit/s, or None if unshaped.
    - ``burst_bytes``: tbf bucket size, or None if unshaped.
    - ``runid``, ``subnet`` (e.g. ``"10.77.42.0/24"``).

    Processes started with :meth:`popen` that are still running at teardown are
    terminated (then killed after 2 s): their network is about to disappear.
    """

    def __init__(self, hosts: int, rate: str | int | None, prefix: str = "sparcoll"):
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an int in 1..{MAX_HOSTS}, got {hosts!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", prefix or ""):
            raise ValueError(f"invalid namespace prefix {prefix!r}")
        if rate is None or (isinstance(rate, str) and rate.strip().lower() == "none"):
            self.rate_bps: int | None = None
        else:
            self.rate_bps = parse_rate(rate)
        self.burst_bytes = None if self.rate_bps is None else tbf_burst_bytes(self.rate_bps)
        self.hosts = hosts
        self.prefix = prefix
        self._owner_pid = os.getpid()
        rand = secrets.token_hex(3)
        self.runid = f"{self._owner_pid}x{rand}"
        octet = int(rand, 16) % 256
        self.subnet = f"10.77.{octet}.0/24"
        base = f"{prefix}-{self.runid}"
        self.bridge_namespace = f"{base}-br"
        self.namespaces = [f"{base}-h{i}" for i in range(hosts)]
        self.addresses = [f"10.77.{octet}.{i + 1}" for i in range(hosts)]
        self.interface = HOST_INTERFACE
        self._owner_path = _owner_file(prefix, self.runid)
        self._procs: list[subprocess.Popen] = []
        self._state = "new"  # new -> up -> closed

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "EmulatedNetwork":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps} bit/s"
        return f"<EmulatedNetwork {self.bridge_namespace} hosts={self.hosts} {rate} {self._state}>"

    def _all_namespaces(self) -> list[str]:
        return [self.bridge_namespace, *self.namespaces]

    def open(self) -> None:
        """Create the namespaces, veths, bridge and qdiscs (called by ``__enter__``)."""
        if self._state != "new":
            raise NetemError(f"{self!r} cannot be opened twice")
        ok, reason = netem_available()
        if not ok:
            raise NetemUnavailable(reason)
        self._state = "up"
        _LIVE[id(self)] = self
        _install_handlers()
        step = "writing the owner record"
        try:
            self._write_owner_record()
            br = self.bridge_namespace
            step = f"creating the bridge namespace {br}"
            _run(["ip", "netns", "add", br])
            _run(["ip", "-n", br, "link", "set", "lo", "up"])
            _run(["ip", "-n", br, "link", "add", BRIDGE_INTERFACE, "type", "bridge", "stp_state", "0"])
            _run(["ip", "-n", br, "link", "set", BRIDGE_INTERFACE, "up"])
            for i, ns in enumerate(self.namespaces):
                step = f"creating host {i} ({ns})"
                port = f"h{i}"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # Created directly inside the namespaces: nothing ever appears in the root namespace.
                _run(["ip", "-n", ns, "link", "add", HOST_INTERFACE, "type", "veth",
                      "peer", "name", port, "netns", br])
                _run(["ip", "-n", br, "link", "set", port, "master", BRIDGE_INTERFACE])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", HOST_INTERFACE])
                if self.rate_bps is not None:
                    step = f"shaping host {i} ({ns}) to {self.rate_bps} bit/s"
                    tbf = ["root", "tbf", "rate", f"{self.rate_bps}bit",
                           "burst", str(self.burst_bytes), "latency", TBF_LATENCY]
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", HOST_INTERFACE, *tbf])  # uplink
                    _run(["tc", "-n", br, "qdisc", "add", "dev", port, *tbf])  # downlink
                _run(["ip", "-n", br, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "link", "set", HOST_INTERFACE, "up"])
        except BaseException as e:
            self.close()
            if isinstance(e, NetemError):
                cls = type(e)
                raise cls(f"failed to create the emulated network while {step}; "
                          f"removed what was created. {e}") from e
            raise

    def close(self) -> None:
        """Tear down: stop our child processes, delete our namespaces.  Idempotent, never raises.

        Only the process that created the network tears it down (a forked child's
        atexit or signal handler does nothing).  Namespaces that could not be
        deleted are reported with a ``RuntimeWarning`` and retried at exit.
        """
        if self._state != "up" or os.getpid() != self._owner_pid:
            return
        self._stop_processes()
        left = [ns for ns in self._all_namespaces() if not _delete_netns(ns)]
        if left:
            warnings.warn(
                f"could not delete network namespaces {left}; remove them with "
                f"'ip netns delete <name>' or sparcoll.bench.netem.cleanup_stale()",
                RuntimeWarning,
                stacklevel=2,
            )
            return  # stay registered: atexit retries
        try:
            os.unlink(self._owner_path)
        except OSError:
            pass
        self._state = "closed"
        _LIVE.pop(id(self), None)

    def _write_owner_record(self) -> None:
        os.makedirs(OWNER_DIR, exist_ok=True)
        record = {
            "pid": self._owner_pid,
            "starttime": _proc_starttime(self._owner_pid),
            "runid": self.runid,
            "prefix": self.prefix,
            "namespaces": self._all_namespaces(),
            "created": time.time(),
        }
        tmp = f"{self._owner_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._owner_path)

    def _stop_processes(self) -> None:
        running = [p for p in self._procs if p.poll() is None]
        for p in running:
            try:
                p.terminate()
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    p.kill()
                    p.wait(timeout=2.0)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        self._procs = [p for p in self._procs if p.poll() is None]

    # ------------------------------------------------------------------ running things

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside host ``i``'s namespace."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a sequence of arguments, not a string")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.hosts:
            raise IndexError(f"host index {i!r} out of range 0..{self.hosts - 1}")
        return ["ip", "netns", "exec", self.namespaces[i], *[str(a) for a in argv]]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in host ``i``'s namespace with :class:`subprocess.Popen`.

        ``ip netns exec`` execs the command, so the Popen's pid is the command's.
        Still running at teardown, it is terminated.
        """
        if self._state != "up":
            raise NetemError(f"{self!r} is not up")
        proc = subprocess.Popen(self.command(i, argv), **kwargs)
        self._procs = [p for p in self._procs if p.poll() is None]
        self._procs.append(proc)
        return proc


# --------------------------------------------------------------------------- stale cleanup


def _parse_name(name: str, prefix: str) -> tuple[str, int] | None:
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
    for name in _list_netns():
        parsed = _parse_name(name, prefix)
        if parsed is None:
            continue
        runid, pid = parsed
        if runid not in alive_cache:
            starttime = None
            try:
                with open(_owner_file(prefix, runid)) as f:
                    record = json.load(f)
                if record.get("pid") == pid:
                    starttime = record.get("starttime")
            except (OSError, ValueError):
                pass
            alive_cache[runid] = _pid_alive(pid, starttime)
        if alive_cache[runid]:
            continue
        dead_runs.add(runid)
        if _delete_netns(name):
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
            if _pid_alive(int(m.group(1)), starttime):
                continue  # a live run that is still being set up, or has no namespace yet
        try:
            os.unlink(path)
        except OSError:
            pass
    return deleted


def _safe_list_netns() -> list[str]:
    try:
        return _list_netns()
    except NetemError:
        return []
