"""The `sparcoll` command: `aggregator` (a dedicated aggregator), `bench`, `demo`, `emulate` (your own
script on emulated hosts), `plan`, `simulate` and `train`."""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from typing import Callable


def run_aggregator(args: argparse.Namespace) -> int:
    """Serve jobs until SIGINT, SIGTERM or SIGHUP, then tell every worker why its connection
    closes. Run as its own process (`args.own_process`), it leaves the stop signals blocked when it
    returns: the process exits, and they are the same request, answered; in-process, its caller's
    mask comes back. Prints its address once listening (port 0 picks one). A bad
    option, an unusable secret or an address it cannot listen on ends it with one line on stderr
    (exit code 2): these are the operator's to fix, a traceback would only hide the reason. The
    options are checked before torch is imported, so a mistyped one is refused at once."""
    from .hosts import is_loopback
    from .secret import shared_secret

    def refuse(problem: str) -> int:
        print(f"sparcoll aggregator: {problem}", file=sys.stderr)
        return 2

    if not 0 <= args.port <= 65535:
        return refuse(f"--port {args.port} is not a TCP port (0-65535; 0 picks a free one)")
    for name in ("max_handshakes", "max_connections"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return refuse(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    try:
        secret = shared_secret(args.secret_file)
    except ValueError as exc:
        return refuse(str(exc))
    if not secret and not is_loopback(args.host):
        return refuse(f"refusing to listen on {args.host} without a secret; set SPARCOLL_SECRET "
                      f"or pass --secret-file (only loopback may run without one)")
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # One torch thread: each message's sum is small (at most a few MiB) and the receiver threads
    # (one per worker connection) already add in parallel, with the GIL released. An OpenMP team per
    # add costs more than it saves: measured on 2 cores, 2 workers, 2 aggregators, 256 KiB messages,
    # aggregator CPU over 23 allreduces of 16M float32 2.8 -> 1.8 s.
    torch.set_num_threads(1)
    # Blocked from before the server's threads start (they inherit it) and taken by sigtimedwait below:
    # a handler that set an Event deadlocked when a second signal landed inside the first (the
    # Event's lock held by the handler it interrupted), and the aggregator served on (a review:
    # SIGTERM then SIGINT, 6 of 11).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return _serve_until_stopped(args, secret, refuse)
    finally:
        # Unblocked, with their default action, a stop signal that came while the process exited
        # ended it with 143 (a review: 10 of 12 pairs of SIGTERMs), not 0. An in-process caller
        # (a test) gets its mask back, and its pending stop signals are dropped first.
        if not getattr(args, "own_process", False):
            while STOP_SIGNALS & signal.sigpending():
                signal.sigwait(STOP_SIGNALS)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _stop_signal() -> int:
    """Wait for a stop signal, in slices: between them the handlers of other signals run (sigwait
    alone held off a caller's SIGALRM, and so pytest-timeout's, until a stop signal came)."""
    while True:
        received = signal.sigtimedwait(STOP_SIGNALS, 1.0)
        if received is not None:
            return received.si_signo


def _serve_until_stopped(args: argparse.Namespace, secret: bytes | None, refuse: Callable[[str], int]) -> int:
    from .server import MAX_HANDSHAKES, AggregatorServer

    try:
        server = AggregatorServer(args.host, args.port, secret,
                                  max_handshakes=args.max_handshakes or MAX_HANDSHAKES,
                                  max_connections=args.max_connections)
    except (OSError, UnicodeError, ValueError) as exc:     # an address that cannot be encoded, too
        return refuse(f"cannot listen on {args.host}:{args.port}: {exc}")
    print(f"sparcoll aggregator listening on {server.address}", flush=True)
    limit = server.connection_limit()
    log = logging.getLogger("sparcoll.aggregator")
    if limit is not None:
        log.info("serving at most %d worker connections at once (%s)", *limit)
    soft, left = server.descriptors_left()
    if args.max_connections is not None and left is not None and args.max_connections > left:
        log.warning("--max-connections %d is more than the descriptor limit %d leaves for connections (%d): "
                    "past it accept() fails without a reason to the worker; raise `ulimit -n` or give fewer",
                    args.max_connections, soft, left)
    try:
        name = signal.Signals(_stop_signal()).name
    except BaseException:   # another signal's handler raised (a caller's alarm): the server goes with it
        server.close(reason=f"the aggregator at {server.address} was interrupted")
        raise
    log.info("stopping on %s: telling each of %d worker connections why", name, server.connections())
    server.close(reason=f"the aggregator at {server.address} was stopped ({name})")
    return 0


def add_aggregator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free one)")
    parser.add_argument("--secret-file", help="file holding the shared secret, at least 16 bytes "
                                              "(else $SPARCOLL_SECRET)")
    parser.add_argument("--max-handshakes", type=int, metavar="N",
                        help="connections allowed to be handshaking at once; more are closed at "
                             "once (default 256)")
    parser.add_argument("--max-connections", type=int, metavar="N",
                        help="worker connections served at once; more are refused at their "
                             "handshake, with the reason (default: the descriptor limit, ulimit -n, "
                             "less the handshakes' and 64, at least half of it)")


#: A subcommand's loader: returns its add_arguments(parser) and run(args), importing what they need.
Loader = Callable[[], tuple[Callable, Callable]]


def _entry(module: str) -> Loader:
    """The loader of `module`'s add_arguments and run: the module is imported only when it is called."""
    def load() -> tuple[Callable, Callable]:
        loaded = importlib.import_module(module)
        return loaded.add_arguments, loaded.run
    return load


#: name -> (summary, loader). Only the chosen subcommand's loader runs: `sparcoll aggregator` does not
#: load the benchmarks, the training workloads or the torch backend.
COMMANDS: dict[str, tuple[str, Loader]] = {
    "aggregator": ("run a dedicated aggregator serving any number of jobs",
                   lambda: (add_aggregator_arguments, run_aggregator)),
    "bench": ("compare sparcoll with gloo ring, sparse AllGather and a parameter server, on loopback or "
              "an emulated network", _entry("sparcoll.bench.command")),
    "demo": ("4 local workers: sparse allreduce vs gloo at several densities", _entry("sparcoll.demo")),
    "emulate": ("run your own torch.distributed script with each rank on an emulated host behind a "
                "shaped link (needs root)", _entry("sparcoll.emulate")),
    "plan": ("profile a model on this machine and network and choose a strategy per tensor "
             "(ByteComp's planner)", _entry("sparcoll.plan.command")),
    "simulate": ("predict time per allreduce at worker counts and link rates beyond this machine, "
                 "from costs measured on it", _entry("sparcoll.simulate.command")),
    "train": ("train a workload data-parallel on sparcoll, gloo DDP, the hook or sparse AllGather, on "
              "loopback or an emulated network", _entry("sparcoll.train.command")),
}


#: The subcommands that run jobs of local processes (bench/launch.py).
LAUNCHING = {"bench", "demo", "plan", "train"}


def _chosen(argv: list[str]) -> str | None:
    """The subcommand `argv` names: the top-level parser has no option taking a value, so it is the
    first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _forks_here(argv: list[str]) -> bool:
    """Whether the command forks its jobs' processes from this process's fork server: a launching
    command, not asked for help, and not one whose workers torchrun's agents start
    (`bench --launcher torchrun`)."""
    if _chosen(argv) not in LAUNCHING or {"-h", "--help"} & set(argv):
        return False
    return "--launcher=torchrun" not in argv and ["--launcher", "torchrun"] not in map(list, zip(argv, argv[1:]))


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`, with the arguments of the subcommand it names (the others are listed
    by name only)."""
    chosen = _chosen(argv)
    parser = argparse.ArgumentParser(prog="sparcoll", description=__doc__)
    from . import __version__
    parser.add_argument("--version", action="version", version=f"sparcoll {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (summary, load) in COMMANDS.items():
        command = sub.add_parser(name, help=summary)
        if name == chosen:
            add_arguments, run = load()
            add_arguments(command)
            command.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; without `argv` (the `sparcoll` script, `python -m sparcoll`) it is this
    process's whole life: the process exits when main returns."""
    own_process, argv = argv is None, sys.argv[1:] if argv is None else argv
    if _forks_here(argv):
        # Its fork server (bench/forked.py) imports torch on another core while this process does.
        from .bench.forked import fork_context
        fork_context()
    try:    # building the parser imports the command (torch: seconds), where Ctrl-C may land too
        args = build_parser(argv).parse_args(argv)
        args.own_process = own_process
        if args.command != "aggregator":
            # Terminated like interrupted: the launcher's clean-up (children, network, temporary
            # files) runs as it does on Ctrl-C.
            signal.signal(signal.SIGTERM, _interrupt)
        return args.func(args)
    except KeyboardInterrupt:   # outside a launcher's own handling (an import, a report being written)
        print(" ".join(filter(None, ["sparcoll", _chosen(argv)])) + ": interrupted", file=sys.stderr)
        return 130


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
