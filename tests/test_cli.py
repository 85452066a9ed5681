"""The `sparcoll` command line: each subcommand loads only its own modules, and every --help works."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sparcoll.cli import COMMANDS, main
from support import sparcoll_here, start_aggregator, stop

TIMEOUT = 120
# What `sparcoll aggregator` must not load: the training workloads, the benchmark workers and the torch
# backend (which registers itself with torch.distributed on import).
NOT_FOR_AGGREGATOR = ("sparcoll.train", "sparcoll.workloads", "sparcoll.bench.worker", "sparcoll.torch")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_aggregator_parsing_loads_no_other_subcommand():
    script = (
        "import sys\n"
        "from sparcoll.cli import build_parser\n"
        "argv = ['aggregator', '--port', '0']\n"
        "args = build_parser(argv).parse_args(argv)\n"
        "assert args.func.__name__ == 'run_aggregator' and args.port == 0, args\n"
        f"print(sorted(m for m in sys.modules if m.startswith({NOT_FOR_AGGREGATOR!r})))\n"
    )
    cp = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True,
                        timeout=TIMEOUT)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "[]"


def until_listening(proc: subprocess.Popen) -> None:
    """Wait (at most TIMEOUT) for an aggregator's first line, which says where it listens."""
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(TIMEOUT)
    assert line and "listening on" in line[0], line


def test_running_aggregator_loads_no_other_subcommand(tmp_path):
    """The whole command, until it listens: -X importtime lists every module it imported."""
    imports = tmp_path / "imports.txt"
    with open(imports, "w") as err:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "sparcoll", "aggregator", "--port", "0"],
                                env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        until_listening(proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    modules = [row.rsplit("|", 1)[-1].strip() for row in imports.read_text().splitlines() if "|" in row]
    assert "sparcoll.aggregator" in modules
    assert not [m for m in modules if m.startswith(NOT_FOR_AGGREGATOR)]


@pytest.mark.parametrize("argv, forks", [(["bench", "--network", "none"], True),
                                         (["bench", "--launcher", "direct"], True),
                                         (["bench", "--launcher", "torchrun"], False),
                                         (["bench", "--launcher=torchrun"], False), (["train", "--help"], False)])
def test_the_fork_server_starts_only_for_commands_that_fork_their_jobs_here(argv, forks, monkeypatch, capsys):
    """torchrun's agents start `bench --launcher torchrun`'s workers: a fork server importing torch
    beside it would be work for nothing."""
    import sparcoll.bench.command as bench
    import sparcoll.bench.forked as forked
    started = []
    monkeypatch.setattr(forked, "fork_context", lambda: started.append(argv))
    monkeypatch.setattr(bench, "run", lambda args: 0)
    monkeypatch.setattr(signal, "signal", lambda *args: None)      # main's SIGTERM handler stays out
    try:
        assert main(argv) == 0
    except SystemExit as exit:          # --help
        assert exit.code == 0
    assert bool(started) is forks


@pytest.mark.parametrize("name", list(COMMANDS))
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as exit:
        main([name, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: sparcoll {name} [-h]") and "--" in out.split("options:", 1)[1]


def test_version(capsys):
    """`sparcoll --version` was refused for want of a command (an install review)."""
    from sparcoll import __version__
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"sparcoll {__version__}\n"


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


@pytest.fixture(scope="module")
def busy_port():
    """A port something else listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.parametrize("args, problem", [
    (["--secret-file", "/nonexistent/secret"], "cannot read the secret file /nonexistent/secret"),
    (["--port", "99999"], "--port 99999 is not a TCP port"),
    (["--port", "-1"], "--port -1 is not a TCP port"),
    (["--max-handshakes", "0"], "--max-handshakes 0 must be at least 1"),
    (["--max-connections", "-2"], "--max-connections -2 must be at least 1"),
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
])
def test_aggregator_bad_options_give_one_line_and_exit_code_2(args, problem, busy_port):
    args = [str(busy_port) if arg == "BUSY" else arg for arg in args]
    env = {k: v for k, v in _env().items() if k != "SPARCOLL_SECRET"}
    cp = subprocess.run([sys.executable, "-m", "sparcoll", "aggregator", *args], env=env,
                        capture_output=True, text=True, timeout=TIMEOUT)
    assert cp.returncode == 2, (cp.returncode, cp.stderr)
    assert cp.stderr.startswith(f"sparcoll aggregator: {problem}"), cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr, cp.stderr


def test_an_aggregator_told_to_admit_more_than_its_descriptors_allow_warns():
    """--max-connections far above `ulimit -n` was taken silently: past the descriptors, accept()
    fails and a worker hears no reason (a review)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no descriptor limit here")
    env = {k: v for k, v in _env().items() if k != "SPARCOLL_SECRET"}
    proc = subprocess.Popen([sys.executable, "-m", "sparcoll", "aggregator", "--port", "0",
                             "--max-connections", str(10 * soft)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        until_listening(proc)
    finally:
        stop(proc)
    err = proc.stderr.read()
    assert f"--max-connections {10 * soft} is more than the descriptor limit {soft} leaves" in err, err


def test_an_aggregator_address_that_cannot_be_encoded_gives_one_line(tmp_path):
    """A host name with a label over 63 characters: the IDNA codec's UnicodeError was a traceback."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    env = {k: v for k, v in _env().items() if k != "SPARCOLL_SECRET"}
    cp = subprocess.run([sys.executable, "-m", "sparcoll", "aggregator", "--host", "a" * 64 + ".example",
                         "--secret-file", str(secret)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert cp.returncode == 2 and cp.stderr.startswith("sparcoll aggregator: cannot listen on aaaa"), cp.stderr
    assert len(cp.stderr.strip().splitlines()) == 1 and "Traceback" not in cp.stderr, cp.stderr


def test_help_and_a_bad_aggregator_option_need_no_torch():
    """`import sparcoll` imports torch only where it is used: the command's help and an option it
    refuses come at once (an import of torch is 1.5 s on our machine)."""
    probe = ("import contextlib, io, sys\n"
             "from sparcoll.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "    main(['--help'])\n"
             "code = main(['aggregator', '--port', '99999'])\n"
             "print(code, 'torch' in sys.modules)\n")
    cp = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True,
                        timeout=TIMEOUT)
    assert cp.stdout.split() == ["2", "False"], (cp.stdout, cp.stderr)
    assert "--port 99999 is not a TCP port" in cp.stderr
    import sparcoll
    from sparcoll import Communicator
    assert sparcoll.Communicator is Communicator and Communicator.__module__ == "sparcoll.communicator"


def test_aggregator_max_handshakes_closes_connections_over_it():
    """--max-handshakes 1: while one connection is in its handshake, the next is closed at once,
    refused as busy (its client tries again later)."""
    from sparcoll import transport, wire
    proc, address = start_aggregator("--max-handshakes", "1")
    try:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as first, \
                socket.create_connection((host, int(port)), timeout=10) as second:
            second.settimeout(5)     # a handshake would last 10 s: "at once" is well before
            said = b""
            while chunk := second.recv(4096):
                said += chunk
            refusal = wire.decode_refusal(said)
            assert refusal is not None and refusal[1].startswith(transport.BUSY), said
            first.setblocking(False)
            with pytest.raises(BlockingIOError):
                first.recv(1)        # still open, waiting for its HELLO
    finally:
        stop(proc)


@pytest.mark.parametrize("argv, named", [(["simulate", "--workers", "8"], "sparcoll simulate"), ([], "sparcoll")])
def test_ctrl_c_while_a_command_is_imported_is_reported_as_an_interrupt(monkeypatch, capsys, argv, named):
    """Building the parser imports the command and torch, seconds in which Ctrl-C gave a traceback."""
    def interrupted(argv):
        raise KeyboardInterrupt
    monkeypatch.setattr("sparcoll.cli.build_parser", interrupted)
    assert main(argv) == 130
    assert capsys.readouterr().err == f"{named}: interrupted\n"


def test_an_aggregator_stops_cleanly_however_its_stop_signals_come():
    """Two stop signals at once (a supervisor's SIGTERM and a terminal's Ctrl-C), or one repeated a
    little later, while it closes or exits: it exits with 0. Before, its handler set an Event, and a
    second signal landing inside the first handler deadlocked on the Event's lock: the aggregator
    served on (a review: 6 of 11 such pairs); then a second SIGTERM that came after it had unblocked
    its stop signals again ended it with 143 (a review: 10 of 12)."""
    pairs = [(signal.SIGTERM, signal.SIGINT, 0), (signal.SIGINT, signal.SIGTERM, 0),
             (signal.SIGHUP, signal.SIGINT, 0), (signal.SIGTERM, signal.SIGTERM, 0),
             (signal.SIGTERM, signal.SIGTERM, 0.05), (signal.SIGTERM, signal.SIGTERM, 0.3)]
    for first, second, pause in pairs:
        proc, _ = start_aggregator()
        try:
            proc.send_signal(first)
            time.sleep(pause)
            proc.send_signal(second)
            assert proc.wait(timeout=20) == 0, (first, second, pause, proc.returncode)
        finally:
            stop(proc)


def test_an_aggregator_served_in_process_yields_to_its_callers_alarm(capsys):
    """Its wait for a stop signal lets other signals' handlers run: a plain sigwait held off the
    caller's SIGALRM (sparcoll_here's deadline here, pytest-timeout's in any test) until a stop
    signal came (a review), so a test whose aggregator served by mistake would hang the suite. Its
    stop signals are unblocked again afterwards, with their handlers as they were (a version that
    ignored them once stopped left its caller, and the children it started, deaf to Ctrl-C)."""
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = [signal.getsignal(stop) for stop in stops]
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 2 s"):
        sparcoll_here(capsys, ["aggregator", "--port", "0"], 2)
    assert time.monotonic() - started < 15
    assert not set(stops) & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert [signal.getsignal(stop) for stop in stops] == handlers
