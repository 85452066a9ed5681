"""Physical lower bounds: the bytes each algorithm's data must put on the busiest link direction.

All links are full duplex at the same rate (what the emulated network shapes), N is the tensor's size in
bytes, n the number of workers, d the block density of each worker, d_u the density of the union of all
workers' non-zero blocks. Headers, indices of the sparcoll protocol and latency are ignored, so a
measured time can beat `bytes * 8 / rate` only by what the link lets through at once (the emulated
links' token bucket: 1 MB, a 1%-dense 16M tensor's whole bound over 2 workers).

- ring (gloo dense all_reduce): reduce-scatter + all-gather, 2(n-1)/n * N per direction.
- agsparse (gloo sparse all_reduce = an AllGather of every worker's COO rows): each worker must receive
  the other workers' rows, (n-1) * d * (N + 8 * nblocks) (values plus one int64 index per row).
- ps (parameter servers sharded over the workers, shard 1/n each): a host's uplink carries its pushes to
  the n-1 other servers, (n-1)/n * N, plus its own server's sum sent back to n-1 workers, (n-1)/n * N:
  2(n-1)/n * N per direction, the same as the ring (each way (n-1)/n*N pushed and (n-1)/n*N pulled).
- sparcoll colocated (an aggregator in every worker, shard 1/n): up, the worker's blocks of the other
  shards, (n-1)/n * d * N, plus its shard's results to n-1 workers, (n-1)/n * d_u * N; down the same:
  (n-1)/n * (d + d_u) * N.
- sparcoll dedicated (A aggregators on their own hosts): a worker link carries d*N up and d_u*N down:
  max(d, d_u) * N; an aggregator link n/A times that. The busiest is max(1, n/A) * max(d, d_u) * N.
- gather (ring.py: every rank's data to rank 0 in one round through the star, the sum back): rank 0's
  link carries the n-1 other ranks' data, (n-1) * N; a tiny tensor's travels so too, in float64 (2 N).
- sparcoll as users get it ("auto"): the lowest bound among the paths its chooser may take for the
  input (algorithm.py). A tiny tensor (at most TINY_NUMEL elements) takes only the tiny round; a dense
  one the sparse path, gloo's ring where its result is at least CANDIDATE_DENSITY dense (a sparser one
  never tries the ring: its bound was the ring's, 1.61x where the sparse path it took ran at 1.05x, a
  review) or small enough to gather, and gather too where small enough to gather (never lower than the
  ring: (n-1) >= 2(n-1)/n). With colocated aggregators the sparse bound is the lowest; with fewer
  dedicated aggregators than workers a dense tensor's ring is lower (4 workers, 1 aggregator: 1.5 N
  against 4 N), and a run that took the ring was reported at 0.4x its bound (a review). A COO tensor
  takes the sparse path, unless its dense buffer (densified.py: its values and a mark per entry) is
  small enough to gather: then that buffer takes the dense paths too (a COO run had been given the
  ring's bound, half of what the sparse path it took must move: 3.27x "its bound" (a review)).

For the gloo baselines these are also their actual traffic per worker (their traffic is symmetric), which
is what the benchmark reports as bytes sent when it cannot read interface counters.
"""
from __future__ import annotations

from sparcoll.algorithm import CANDIDATE_DENSITY, GATHER_ELEMENTS, TINY_NUMEL

SPARCOLL_ALGOS = ("sparcoll", "sparse")   # sparcoll as users get it ("auto"), and forced sparse
GLOO_INDEX_BYTES = 8  # gloo's sparse all_reduce sends int64 row indices (sparcoll's are wire.INDEX_BYTES)


def ring(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes


def agsparse(n: int, nbytes: float, density: float, nblocks: int) -> float:
    return (n - 1) * density * (nbytes + GLOO_INDEX_BYTES * nblocks)


def ps(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes


def sparcoll_colocated(n: int, nbytes: float, density: float, union_density: float) -> float:
    return (n - 1) / n * (density + union_density) * nbytes


def sparcoll_dedicated(n: int, nbytes: float, density: float, union_density: float,
                       aggregators: int) -> float:
    return max(1.0, n / aggregators) * max(density, union_density) * nbytes


def gather(n: int, nbytes: float) -> float:
    return (n - 1) * nbytes


def sparcoll_auto(n: int, nbytes: float, sparse: float, input: str, entries: int, itemsize: int,
                  union_density: float = 1.0) -> float:
    """The lowest bound among the paths sparcoll's chooser may take for this input, the sparse one's
    being `sparse` (see the module docstring; algorithm.Chooser.choose and engine.Engine._run): the
    ring only where the result is dense enough for the chooser to try it (CANDIDATE_DENSITY, at the
    blocks' granularity: `union_density`, an approximation of its sample) or small enough to gather."""
    numel = nbytes / itemsize
    if input == "coo":
        numel += entries                    # its dense buffer: the values, then a mark per entry
        if numel * n > GATHER_ELEMENTS:
            return sparse                   # too large to gather: always the sparse path
        nbytes = numel * itemsize
    if numel <= TINY_NUMEL:
        return gather(n, 2 * nbytes)        # only the tiny round, in float64
    paths = [sparse]
    if numel * n <= GATHER_ELEMENTS:
        paths += [ring(n, nbytes), gather(n, nbytes)]
    elif union_density >= CANDIDATE_DENSITY:
        paths.append(ring(n, nbytes))
    return min(paths)


def link_bytes(algo: str, *, workers: int, nbytes: float, density: float, union_density: float,
               nblocks: int, aggregators: str | None = None, num_aggregators: int | None = None,
               input: str = "dense", itemsize: int = 4) -> float:
    """Bytes on the busiest link direction for `algo` (ring, agsparse, ps, sparcoll, sparse) from an
    `input` "dense" or "coo" tensor (`nblocks` its entries) of `itemsize`-byte elements."""
    if algo == "ring":
        return ring(workers, nbytes)
    if algo == "agsparse":
        return agsparse(workers, nbytes, density, nblocks)
    if algo == "ps":
        return ps(workers, nbytes)
    if algo in SPARCOLL_ALGOS:
        if aggregators == "dedicated":
            sparse = sparcoll_dedicated(workers, nbytes, density, union_density, num_aggregators)
        else:
            sparse = sparcoll_colocated(workers, nbytes, density, union_density)
        return sparse if algo == "sparse" else sparcoll_auto(workers, nbytes, sparse, input, nblocks, itemsize,
                                                             union_density)
    raise ValueError(f"no lower bound for algorithm {algo!r}")


def seconds(nbytes: float, rate_bps: int) -> float:
    """Time to push `nbytes` through a link of `rate_bps` bit/s."""
    return nbytes * 8 / rate_bps
