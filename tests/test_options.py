"""Whose fault: a caller's own bad option is a ValueError naming it, raised before anything is built
(no Store key, no socket, no thread); the same values arriving from a peer are a ProtocolError. And
the message-size policy, driven with measured rates instead of sockets."""
import os
import re
import threading

import pytest
import torch.distributed as dist

from sparcoll import wire
from sparcoll.communicator import Communicator
from sparcoll.errors import ProtocolError
from sparcoll.message_size import ADAPT_MIN_BYTES, MessageSizePolicy
from sparcoll.options import Options


def refused_and_announced(options: dict) -> str:
    """A Communicator refused for `options`: its error's text, once checked that it started no
    thread and told the Store why, where its peers look (they waited for its aggregator until the
    timeout, and could not say which rank or why)."""
    store, threads = dist.HashStore(), set(threading.enumerate())
    with pytest.raises(ValueError) as info:
        Communicator(store, 0, 2, **options)
    assert set(threading.enumerate()) <= threads    # (a thread of an earlier test may have ended)
    assert store.check(["1/init-failed/0"])
    assert store.get("1/init-failed/0").decode() == f"ValueError\n{info.value}"
    return str(info.value)


@pytest.mark.parametrize("options, named", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=wire.MAX_BLOCK_SIZE + 1), "block_size"),
    (dict(block_size="wide"), "block_size"),
    (dict(message_blocks=1 << 20), "message_blocks"),
    (dict(block_size=wire.MAX_BLOCK_SIZE, message_blocks=wire.MAX_MESSAGE_BYTES // (wire.MAX_BLOCK_SIZE * 8) + 1),
     r"exceeds the \d+-byte message limit; at most 128 blocks per message fit"),
    (dict(streams=65), "streams"),
    (dict(credits=0), "credits"),
    (dict(timeout=0), "timeout"),
    (dict(timeout=-1.0), "timeout"),
    (dict(timeout=None), "timeout"),
    (dict(timeout=float("nan")), "timeout"),
    (dict(aggregators=[]), "aggregators"),
    (dict(aggregators=["no-port"]), "host:port"),
    (dict(aggregators=["127.0.0.1:72836"]), "port 72836 is not in 1-65535"),     # not 7300, wrapped
    (dict(aggregators=["127.0.0.1:0"]), "port 0 is not in 1-65535"),
    (dict(aggregators=["a:7000", "b:7000", "a:7000"]), "a:7000 listed more than once"),
    (dict(aggregators=["[::1]:7000", "::1:7000"]), r"\[::1\]:7000, ::1:7000 listed more than once"),
    (dict(aggregators=["[::1:7000"]), "is not host:port"),
    (dict(block_size=256.7), "block_size must be an integer, got 256.7"),     # not truncated to 256
    (dict(credits=True), "credits must be an integer, got True"),
])
def test_bad_options_are_value_errors_before_anything_is_built_and_told_to_the_peers(options, named):
    assert re.search(named, refused_and_announced(options))


def test_the_largest_message_that_fits_in_float64_is_taken():
    """The boundary of the message-size check: 128 blocks of 65536 float64 fill the 64 MiB limit."""
    options = Options.resolve(block_size=wire.MAX_BLOCK_SIZE, message_blocks=128)
    assert options.message_blocks * options.block_size * 8 == wire.MAX_MESSAGE_BYTES


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("SPARCOLL_CREDITS", "two")
    with pytest.raises(ValueError, match=r"\$SPARCOLL_CREDITS must be an integer, got 'two'"):
        Options.resolve()
    monkeypatch.setenv("SPARCOLL_CREDITS", "3")
    monkeypatch.setenv("SPARCOLL_AGGREGATORS", " a:1, b:2 ,")
    options = Options.resolve()
    assert options.credits == 3 and options.aggregators == ("a:1", "b:2")
    assert Options.resolve(credits=5).credits == 5        # an argument beats the environment
    monkeypatch.delenv("SPARCOLL_AGGREGATORS")
    for variable, value in (("SPARCOLL_CREDITS", "0"), ("SPARCOLL_STREAMS", "65"), ("SPARCOLL_MESSAGE_BLOCKS", "0"),
                            ("SPARCOLL_BLOCK_SIZE", "-5")):
        monkeypatch.setenv(variable, value)
        with pytest.raises(ValueError, match=rf"^\${variable}={value} outside \[1, "):   # before: unnamed
            Options.resolve()
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SPARCOLL_AGGREGATORS", ",")     # before: "pass None for colocated aggregators"
    with pytest.raises(ValueError, match=r"^\$SPARCOLL_AGGREGATORS lists no address"):
        Options.resolve()
    monkeypatch.delenv("SPARCOLL_AGGREGATORS")
    monkeypatch.setenv("SPARCOLL_HOST", " 10.1.2.3 ")
    assert Options.resolve().host == "10.1.2.3" and Options.resolve(host="h").host == "h"


def test_the_same_values_from_a_peer_are_protocol_errors():
    bad = wire.JobConfig(world=2, num_aggs=1, streams=65, credits=2, message_blocks=64)
    hello = wire.Hello(1, 0, 0, bad, os.urandom(wire.NONCE_BYTES))
    with pytest.raises(ValueError, match="streams=65"):
        bad.check()
    with pytest.raises(ProtocolError, match="streams=65"):
        wire.Hello.decode(hello.encode())


def test_message_size_policy_follows_the_observed_rate():
    kib = 256 * 4
    policy = MessageSizePolicy(limit=2048)
    assert policy.blocks(kib) == 2048                     # nothing measured yet: the limit
    policy.observe(ADAPT_MIN_BYTES - 1, 1.0)              # too little to say anything
    assert policy.rate is None and policy.blocks(kib) == 2048
    policy.observe(110_000_000, 1.0)                      # about 1 Gbit/s
    assert policy.blocks(kib) == 256
    assert policy.blocks(2 * kib) == 256                  # never below limit / 8
    policy.observe(2_000_000_000, 1.0)                    # loopback-like
    assert policy.blocks(kib) == 2048
    policy.observe(ADAPT_MIN_BYTES, 0.0)                  # an instant collective: no division error
    assert policy.blocks(kib) == 2048


@pytest.mark.parametrize("raw", ["   \n", "short-secret"])
def test_workers_refuse_a_blank_or_short_secret_for_dedicated_aggregators(monkeypatch, raw):
    monkeypatch.setenv("SPARCOLL_SECRET", raw)
    assert re.search(r"\$SPARCOLL_SECRET holds .*at least 16 bytes",
                     refused_and_announced(dict(aggregators=["127.0.0.1:7000"])))
    monkeypatch.setenv("SPARCOLL_SECRET", f"  {'k' * 32}\n")
    options = Options.resolve(aggregators=["127.0.0.1:7000"])
    assert options.secret == b"k" * 32 and "kkkk" not in repr(options)
    assert Options.resolve().secret == b""      # colocated aggregators use the job's own secret


@pytest.mark.parametrize("host", ["nonexistent.invalid", "192.0.2.1"])    # no such name; not this host's
@pytest.mark.parametrize("given", ["argument", "environment"])
def test_a_host_this_rank_cannot_listen_on_is_named(monkeypatch, host, given):
    """From $SPARCOLL_HOST it used to be a bare gaierror or "Cannot assign requested address" (a review)."""
    import torch.distributed as dist
    options = dict(host=host) if given == "argument" else {}
    if given == "environment":
        monkeypatch.setenv("SPARCOLL_HOST", host)
    with pytest.raises(ValueError, match=f"host '{host}' \\(host= or \\$SPARCOLL_HOST\\): this rank cannot listen"):
        Communicator(dist.HashStore(), 0, 1, timeout=5.0, **options)


def test_without_a_host_a_rank_listens_on_gloo_socket_ifnames_interface(monkeypatch):
    """$GLOO_SOCKET_IFNAME chose the interface of torch's gloo groups, while the aggregators and the
    ring went over the one that routes to MASTER_ADDR (a review of docs/cluster.md, two networks:
    5.8 MB sent on eth0, 13 KB on eth1, where it named eth1). The reference: `ip -4 -o addr`."""
    import subprocess
    from sparcoll.hosts import local_host
    listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10, check=True)
    addresses = {}
    for line in listed.stdout.splitlines():         # "2: eth0    inet 192.0.2.2/24 brd ..."
        device, _, cidr = line.split()[1:4]
        addresses.setdefault(device, cidr.split("/")[0])
    assert addresses.get("lo") == "127.0.0.1", listed.stdout
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")     # routed through lo
    for device, address in addresses.items():
        for names in (f"{device},other", f" ,{device}"):        # gloo's groups use every one; we, the first
            monkeypatch.setenv("GLOO_SOCKET_IFNAME", names)
            assert local_host() == address, (names, listed.stdout)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch9")
    with pytest.raises(ValueError, match=re.escape("$GLOO_SOCKET_IFNAME=nosuch9: no address on that interface "
                                                   "of this host")):
        Communicator(dist.HashStore(), 0, 1, timeout=5.0)
    monkeypatch.setenv("SPARCOLL_HOST", "127.0.0.1")    # which says where, whatever gloo's interface
    Communicator(dist.HashStore(), 0, 1, timeout=5.0).close()


def test_a_second_close_returns_once_the_first_has_finished():
    """close() from two threads (an exit hook beside the script's own): the second returned at once
    while the first still tore the threads down (a review)."""
    import time
    before = set(threading.enumerate())
    comm = Communicator(dist.HashStore(), 0, 1, timeout=10.0)
    tear_down = comm._worker.close

    def slowly(*args):
        time.sleep(0.5)
        tear_down(*args)
    comm._worker.close = slowly
    first = threading.Thread(target=comm.close)
    first.start()
    time.sleep(0.1)
    comm.close()
    assert not [t.name for t in set(threading.enumerate()) - before if t is not first]
    first.join(10)


def test_a_communicator_dropped_without_close_is_closed_when_collected():
    """Its threads held it (through the worker's poison callback), so one dropped without close()
    kept its threads, sockets and port until the process exited: 9 descriptors and 7 threads each in
    a review's loop. It is now closed when collected."""
    import gc
    import time
    import torch
    before = set(threading.enumerate())
    comm = Communicator(dist.HashStore(), 0, 1, timeout=10.0)
    tensor = torch.ones(1000)
    comm.allreduce(tensor)
    assert set(threading.enumerate()) - before         # its threads run
    del comm
    gc.collect()
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in set(threading.enumerate()) - before]
