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

A bucket lets B bytes through at once after the link idled, faster than a real link: a protocol that
waits a round trip per message looks better here than on real hardware (benchmarks/run_in_flight.sh,
dedicated aggregators at 1 Gbit/s, 4 workers, one message in flight, 3 rounds: 585-608 ms with the
1 MB bucket, 772-902 ms with 128 KiB; the ring 838-855 ms either way). ``burst_bytes`` (``sparcoll bench --link-burst``) sets B to check a result's sensitivity.

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
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from sparcoll.bench import netns
from sparcoll.bench.netns import NetemError, NetemUnavailable, cleanup_stale, netem_available
from sparcoll.bench.sizes import count_argument

__all__ = [
    "EmulatedNetwork",
    "MIN_BURST_BYTES",
    "NetemError",
    "NetemUnavailable",
    "check_network",
    "cleanup_stale",
    "netem_available",
    "parse_rate",
    "tbf_burst_bytes",
]

#: Interface name of the veth end inside each host namespace.
HOST_INTERFACE = "eth0"
BRIDGE_INTERFACE = "br0"
#: tbf ``latency`` parameter (bounds the queue of each token bucket).
TBF_LATENCY = "50ms"
MAX_HOSTS = 254


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


MIN_BURST_BYTES = 64 * 1024


def add_link_burst_argument(parser) -> None:
    """`--link-burst BYTES` of the commands that run jobs on the emulated network (bench, train, plan)."""
    parser.add_argument("--link-burst", type=count_argument, default=None, metavar="BYTES",
                        help="the links' token bucket (tbf burst), e.g. 128K, closer to a NIC that never "
                             "sends above its rate; default 8 ms of the rate, at least 128K: 1M at 1gbit")


def check_link_burst(burst_bytes: int | None, network: str) -> None:
    """A ValueError naming the problem if `--link-burst` cannot shape `network`."""
    if burst_bytes is None:
        return
    if network == "none":
        raise ValueError("--link-burst shapes the emulated links: give --network")
    if burst_bytes < MIN_BURST_BYTES:
        raise ValueError(f"--link-burst {burst_bytes}: at least {MIN_BURST_BYTES} bytes (64K)")


def check_network(network: str, burst_bytes: int | None, hosts: int) -> int | None:
    """The emulated links' rate in bit/s for `--network` (None: loopback), or a ValueError naming what
    stops them: a bad burst or rate, more `hosts` than one subnet holds, then no netem here (so a
    mistyped rate is named alike with or without root)."""
    check_link_burst(burst_bytes, network)
    if network == "none":
        return None
    try:
        rate = parse_rate(network)
    except ValueError as exc:
        raise ValueError(f"--network: {exc}, or none") from None
    if hosts > MAX_HOSTS:
        raise ValueError(f"--network {network}: {hosts} emulated hosts (workers and dedicated aggregators), "
                         f"at most {MAX_HOSTS}")
    ok, reason = netem_available()
    if not ok:
        raise ValueError(reason)
    return rate


def tbf_burst_bytes(rate_bps: int) -> int:
    """Token-bucket size used for a link of ``rate_bps``: 8 ms of line rate, at least 128 KiB."""
    return max(math.ceil(rate_bps / 8 * 0.008), 128 * 1024)


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

    def __init__(self, hosts: int, rate: str | int | None, prefix: str = "sparcoll",
                 burst_bytes: int | None = None):
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be an int in 1..{MAX_HOSTS}, got {hosts!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", prefix or ""):
            raise ValueError(f"invalid namespace prefix {prefix!r}")
        if rate is None or (isinstance(rate, str) and rate.strip().lower() == "none"):
            self.rate_bps: int | None = None
        else:
            self.rate_bps = parse_rate(rate)
        if burst_bytes is not None and burst_bytes < MIN_BURST_BYTES:
            raise ValueError(f"burst {burst_bytes} bytes: at least {MIN_BURST_BYTES} (one 64 KiB GSO packet)")
        self.burst_bytes = None if self.rate_bps is None else burst_bytes or tbf_burst_bytes(self.rate_bps)
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
        self._owner_path = netns.owner_file(prefix, self.runid)
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
            netns.run(["ip", "netns", "add", br])
            netns.run(["ip", "-n", br, "link", "set", "lo", "up"])
            netns.run(["ip", "-n", br, "link", "add", BRIDGE_INTERFACE, "type", "bridge", "stp_state", "0"])
            netns.run(["ip", "-n", br, "link", "set", BRIDGE_INTERFACE, "up"])
            for i, ns in enumerate(self.namespaces):
                step = f"creating host {i} ({ns})"
                port = f"h{i}"
                netns.run(["ip", "netns", "add", ns])
                netns.run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # Created directly inside the namespaces: nothing ever appears in the root namespace.
                netns.run(["ip", "-n", ns, "link", "add", HOST_INTERFACE, "type", "veth",
                      "peer", "name", port, "netns", br])
                netns.run(["ip", "-n", br, "link", "set", port, "master", BRIDGE_INTERFACE])
                netns.run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", HOST_INTERFACE])
                if self.rate_bps is not None:
                    step = f"shaping host {i} ({ns}) to {self.rate_bps} bit/s"
                    tbf = ["root", "tbf", "rate", f"{self.rate_bps}bit",
                           "burst", str(self.burst_bytes), "latency", TBF_LATENCY]
                    netns.run(["tc", "-n", ns, "qdisc", "add", "dev", HOST_INTERFACE, *tbf])  # uplink
                    netns.run(["tc", "-n", br, "qdisc", "add", "dev", port, *tbf])  # downlink
                netns.run(["ip", "-n", br, "link", "set", port, "up"])
                netns.run(["ip", "-n", ns, "link", "set", HOST_INTERFACE, "up"])
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
        left = [ns for ns in self._all_namespaces() if not netns.delete_netns(ns)]
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
        os.makedirs(netns.OWNER_DIR, exist_ok=True)
        record = {
            "pid": self._owner_pid,
            "starttime": netns.proc_starttime(self._owner_pid),
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
        self._kill_descendants()

    def _kill_descendants(self) -> None:
        """SIGKILL whatever still runs in our host namespaces: the children of our children (torchrun's
        workers live in sessions of their own, so stopping the agent we started may not reach them)."""
        for i in range(self.hosts):
            self.kill_host(i)

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process in host ``i``'s namespace, as when a machine fails; the pids signalled."""
        return netns.kill_inside(self.namespaces[i])

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
