"""sparcoll on IPv6: addresses with brackets ("[::1]:7300"), listeners in the family of their address,
a rank's own address found toward an IPv6 MASTER_ADDR; every sum against the independent references of
test_allreduce.py. Skipped on a machine without an IPv6 loopback (a container started without IPv6)."""
import socket
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scenarios
from ranks import run_ranks
from scenarios import check_outcome
from sparcoll import hosts, transport
from support import start_aggregator, stop


def has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


TIMEOUT = 240
needs_ipv6 = pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
HOSTS = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str),
                  st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,20}){0,3}", fullmatch=True))


@settings(deadline=None)     # a loaded machine may stall any one example
@given(host=HOSTS, port=st.integers(1, 65535))
def test_an_address_written_for_a_host_is_read_back_as_it(host, port):
    address = transport.format_address(host, port)
    assert transport.parse_address(address) == (host, port)
    assert address.startswith("[") == (":" in host)


@pytest.mark.parametrize("text", ["[::1:7300", "::1]:7300", "[::1]7300", "[]:7300", "[[::1]]:7300"])
def test_a_malformed_bracketed_address_is_named(text):
    with pytest.raises(ValueError, match="is not host:port"):
        transport.parse_address(text)


@needs_ipv6
def test_a_ranks_own_address_is_the_ipv6_one_that_routes_to_an_ipv6_master(monkeypatch):
    monkeypatch.delenv("SPARCOLL_HOST", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "::1")
    assert hosts.local_host() == "::1"
    # GLOO_SOCKET_IFNAME's interface, of MASTER_ADDR's family where it has one, else of the other
    # (gloo takes either): an interface without an IPv6 address failed init (a review)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert hosts.local_host() == "::1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert hosts.local_host() == "127.0.0.1"
    listed = subprocess.run(["ip", "-6", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                            timeout=10, check=True).stdout.split()      # "2: eth0 inet6 fd00::2/64 scope global ..."
    if listed:                  # an interface with a global IPv6 address: that one, never its link-local one
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", listed[1])
        monkeypatch.setenv("MASTER_ADDR", "::1")
        assert hosts.local_host() == listed[3].split("/")[0], listed
    with transport.listen("::1", 0, backlog=1) as listener:
        assert listener.family == socket.AF_INET6


CASES = scenarios.correctness_cases(2)[::3]


def families_and_sums(rank: int, world: int, cases: list[dict]) -> dict:
    """run_correctness, and the address families of this rank's connections to the aggregators and
    of its star (sparcoll's socket round beside gloo's ring; None on the sparse path)."""
    import sparcoll

    with sparcoll.init(timeout=30) as comm:
        aggregators = {conn.sock.family for conn in comm._worker.connections.values()}
        ring = comm._engine.ring
        star = None if ring is None else {sock.family for sock in ring.star.links.values()}
    return {**scenarios.run_correctness(rank, world, cases), "aggregators": aggregators, "star": star}


@needs_ipv6
@pytest.mark.parametrize("algorithm", ["sparse", "ring"])
def test_colocated_ranks_reduce_over_ipv6(algorithm):
    """With MASTER_ADDR on IPv6 the colocated aggregators and, on the ring, sparcoll's star listen
    and connect on IPv6 (gloo's data group is made at the same address; its sockets are gloo's, not
    looked at); the sums are the references'."""
    outcomes = run_ranks(families_and_sums, 2, timeout=TIMEOUT, cases=CASES,
                         env={"MASTER_ADDR": "::1", "SPARCOLL_ALGORITHM": algorithm})
    check_outcome(outcomes, CASES)
    assert [o["aggregators"] for o in outcomes] == [{socket.AF_INET6}] * 2
    assert [o["star"] for o in outcomes] == [None if algorithm == "sparse" else {socket.AF_INET6}] * 2
    ring = [o["stats"].ring_collectives for o in outcomes]
    assert ring == ([0, 0] if algorithm == "sparse" else [len(CASES)] * 2)


@needs_ipv6
def test_a_dedicated_aggregator_on_ipv6_serves_ranks_given_its_bracketed_address():
    proc, address = start_aggregator("--host", "::1")
    try:
        assert address.startswith("[::1]:")
        outcomes = run_ranks(scenarios.run_correctness, 2, timeout=TIMEOUT, cases=CASES,
                             env={"SPARCOLL_AGGREGATORS": address})
    finally:
        stop(proc)
    check_outcome(outcomes, CASES)
    assert all(o["stats"].bytes_sent > 0 for o in outcomes)
