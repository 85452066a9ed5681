"""A discrete-event model (simpy) of one allreduce on hosts joined by full-duplex links through a switch.

What is modelled, and why:
- Links: each host has an uplink and a downlink of the point's rate (times the measured goodput), see
  `Link`: an incast is limited by the receiver's downlink, a host's flows to several peers share its
  uplink. Transfers go in pieces of at most `PIECE_BYTES`, so a long one pipelines with its CPU work and
  concurrent flows take turns, as TCP's do.
- CPU: every host runs one process whose Python work takes turns (the GIL); per-byte work (the scan,
  sums, copies, the kernel's socket copies) only needs a core. With `cores` set, all hosts share that many
  cores, as this machine's emulated hosts share its 2; else each host has `host_cores` of its own.
- sparcoll: every message of the protocol with its flow control: a worker's stream keeps at most its
  in-flight credits of messages not yet answered, an aggregator answers round j once every worker's
  message j arrived, message size and credits as `sparcoll.message_size` chooses them for the link.
  Independent patterns are spread evenly: each message covers the same index range at every worker,
  and its result carries the union's blocks in that range.
- gloo's ring (reduce-scatter then all-gather) and its sparse allreduce (AllGather of every rank's rows,
  then a coalesce) run in lockstep steps on symmetric ranks: one step is simulated, then multiplied.
- The parameter server (sparcoll.torch.ps): every rank pushes a shard to every other rank at once, sums
  what it receives and sends the sum back to everyone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import simpy

from ..algorithm import CANDIDATE_DENSITY, GATHER_ELEMENTS, SPARSE_MARGIN, TINY_NUMEL
from ..bench.bounds import GLOO_INDEX_BYTES
from ..message_size import ADAPT_MIN_BYTES, MessageSizePolicy
from ..options import DEFAULT_CREDITS, default_message_blocks
from ..wire import HEADER_BYTES, INDEX_BYTES, MAX_BLOCK_SIZE
from .costs import Costs

ALGOS = ("sparse", "sparcoll", "ring", "ps", "agsparse")
ITEMSIZE = 4                 # float32
PIECE_BYTES = 64 << 10      # the kernel hands veth and tbf packets of up to 64 KiB (GSO)
MAX_GROUPS = 16
MIN_GROUPS = 8               # fewer lockstep groups misprice (64 workers as 4 groups: ps +21%; 8: +9%)
MOST_EXACT = 64              # hosts simulated one by one where no grouping fits, or sharing cores (5 s a point)
MOST_WORKERS = 16384         # workers a point may have (a bound on the model's time and memory)
HOST_CORES = 4               # cores of a host of its own (cores=None)


@dataclass(frozen=True)
class Point:
    """One allreduce to predict. The union of the workers' blocks is `union_density` if given, else
    that of `sparcoll bench --overlap`'s inputs: a share `overlap` of every worker's blocks common to
    all, the rest independent (overlap 0: 1 - (1 - d)^n)."""
    algo: str
    workers: int
    numel: int
    density: float
    rate_bps: float | None                   # link rate; None: unshaped (loopback)
    aggregators: str = "colocated"
    num_aggregators: int | None = None       # dedicated only; default as many as workers
    union_density: float | None = None
    overlap: float = 0.0
    cores: int | None = None                 # all hosts share this many cores; None: each its own
    block_size: int = 256
    message_blocks: int | None = None        # sparcoll's most blocks per message; None: its default
    credits: int = DEFAULT_CREDITS           # sparcoll's messages in flight per stream
    burst_bytes: float | None = None         # a token bucket per link (the emulated network's tbf)

    def __post_init__(self):
        if self.algo not in ALGOS:
            raise ValueError(f"unknown algorithm {self.algo!r}; known: {', '.join(ALGOS)}")
        if not 2 <= self.workers <= MOST_WORKERS:
            raise ValueError(f"workers {self.workers}: an allreduce needs at least 2, and the model simulates at "
                             f"most {MOST_WORKERS} (its events grow faster than the workers: 16384 took 10 s a point)")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block size {self.block_size} outside [1, {MAX_BLOCK_SIZE}]")
        if self.numel < self.block_size:
            raise ValueError(f"numel {self.numel} must be at least one block of {self.block_size}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density {self.density} outside (0, 1]")
        if self.aggregators not in ("colocated", "dedicated"):
            raise ValueError(f"aggregators {self.aggregators!r}: colocated or dedicated")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"link rate {self.rate_bps} bit/s must be positive")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores {self.cores} must be at least 1")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap {self.overlap} outside [0, 1]")
        if self.credits < 1:
            raise ValueError(f"credits {self.credits} must be at least 1")
        if self.num_aggregators is not None and self.num_aggregators < 1:
            raise ValueError(f"num_aggregators {self.num_aggregators} must be at least 1")
        groups(self.workers, self.cores)                  # refuses a count it cannot simulate well
        if self.dedicated:
            groups(self.shards, self.cores)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE

    @property
    def nblocks(self) -> int:
        return self.numel // self.block_size

    @property
    def union(self) -> float:
        if self.union_density is not None:
            return self.union_density
        shared = self.overlap * self.density
        if shared >= 1:
            return 1.0
        own = (self.density - shared) / (1 - shared)     # a worker's share of the other blocks
        return shared + (1 - shared) * (1 - (1 - own) ** self.workers)

    @property
    def dedicated(self) -> bool:
        return self.aggregators == "dedicated"

    @property
    def shards(self) -> int:
        """sparcoll's aggregators: one per worker when colocated."""
        return (self.num_aggregators or self.workers) if self.dedicated else self.workers


class Link:
    """One direction of a host's link at `rate_bps`. With `burst_bytes`, a token bucket as tbf's in the
    emulated network: after idling it lets that many bytes through at once.

    An uplink is a FIFO queue (`carry`). A downlink forwards cut-through (`forward`): a piece starts
    down as soon as its first byte arrives and the link is free, so a free path costs one piece's time,
    not one per hop, while pieces from several uplinks into one downlink still queue."""

    def __init__(self, env: simpy.Environment, rate_bps: float, burst_bytes: float | None):
        self.env = env
        self.queue = simpy.Resource(env)
        self.bytes_per_s = rate_bps / 8
        self.burst = burst_bytes or 0.0
        self.tokens, self.filled_at = self.burst, 0.0
        self.free_at = 0.0

    def _transmit(self, start: float, nbytes: float) -> float:
        """Seconds from `start` to put `nbytes` through the bucket; takes the tokens."""
        tokens = min(self.burst, self.tokens + (start - self.filled_at) * self.bytes_per_s)
        seconds = max(0.0, nbytes - tokens) / self.bytes_per_s
        self.tokens, self.filled_at = max(0.0, tokens - nbytes), start + seconds
        return seconds

    def carry(self, nbytes: float) -> Iterator:
        """Queue, then send; returns the time the first byte left."""
        with self.queue.request() as turn:
            yield turn
            first = self.env.now
            yield self.env.timeout(self._transmit(first, nbytes))
        return first

    def forward(self, nbytes: float, first: float) -> Iterator:
        """A piece whose first byte arrived at `first` and whose last has just arrived."""
        start = max(first, self.free_at)
        self.free_at = max(self.env.now, start + self._transmit(start, nbytes))
        yield self.env.timeout(self.free_at - self.env.now)


class Cluster:
    """Hosts, their links and CPUs in one simpy environment. The methods are simpy processes.

    A host may stand for `width` identical hosts that act in lockstep (see `groups`): its links carry
    width times the rate, and the work and bytes it is given are the group's total, shared by its
    width hosts."""

    def __init__(self, widths: list[int], costs: Costs, rate_bps: float | None, cores: int | None,
                 burst_bytes: float | None = None):
        self.env = simpy.Environment()
        self.costs = costs
        self.widths = widths
        shaped = rate_bps is not None
        self.up = [Link(self.env, rate_bps * costs.goodput * w, burst_bytes) for w in widths] if shaped else None
        self.down = [Link(self.env, rate_bps * costs.goodput * w, burst_bytes) for w in widths] if shaped else None
        self.turn = [simpy.Resource(self.env) for _ in widths]   # one process's Python: the GIL
        shared = simpy.Resource(self.env, cores) if cores else None
        self.cores = [shared or simpy.Resource(self.env, HOST_CORES) for _ in widths]

    def native(self, host: int, seconds: float) -> Iterator:
        """Work that needs a core of `host` but not its process's turn (numpy, torch, the kernel)."""
        if seconds <= 0:
            return
        with self.cores[host].request() as core:
            yield core
            yield self.env.timeout(seconds / self.widths[host])

    def python(self, host: int, seconds: float) -> Iterator:
        """Work of `host`'s process that holds its turn and a core."""
        with self.turn[host].request() as turn:
            yield turn
            yield from self.native(host, seconds)

    def send(self, src: int, dst: int, nbytes: float, transfers: int = 1) -> Iterator:
        """`nbytes` from src to dst, in pieces: the sender's socket copy, the sender's uplink, the
        receiver's downlink, the latency, the receiver's copy. Ends when the receiver has every byte. Between groups, one send stands for
        `transfers` real ones, each cut in pieces of PIECE_BYTES."""
        pieces = max(1, math.ceil(nbytes / transfers / PIECE_BYTES))
        piece = nbytes / pieces
        deliveries = []
        for _ in range(pieces):
            yield from self.native(src, piece * self.costs.socket_s_per_byte / 2)
            deliveries.append(self.env.process(self._deliver(src, dst, piece)))
        yield simpy.AllOf(self.env, deliveries)

    def _deliver(self, src: int, dst: int, nbytes: float) -> Iterator:
        if self.up is not None:
            first = yield from self.up[src].carry(nbytes)
            yield from self.down[dst].forward(nbytes, first)
        yield self.env.timeout(self.costs.latency_s)
        yield from self.native(dst, nbytes * self.costs.socket_s_per_byte / 2)

    def run(self, processes: list[Iterator]) -> float:
        """Run `processes` to their end; the simulated seconds it took."""
        start = self.env.now
        done = simpy.AllOf(self.env, [self.env.process(p) for p in processes])
        self.env.run(until=done)
        return self.env.now - start


def groups(n: int, cores: int | None) -> tuple[int, int]:
    """(groups, hosts per group): symmetric hosts simulated as MIN_GROUPS to MAX_GROUPS groups that act
    in lockstep, so that 256 workers cost what 16 do. Hosts sharing cores are all simulated (their
    contention for the cores is the point), and so are up to MOST_EXACT hosts that no such count of
    groups divides (17, 34); more of either is refused: their time grows with the square."""
    fitting = [g for g in range(MIN_GROUPS, MAX_GROUPS + 1) if n % g == 0]
    if n <= MAX_GROUPS or (n <= MOST_EXACT and (cores is not None or not fitting)):
        return n, 1
    if cores is not None:
        raise ValueError(f"{n} hosts sharing {cores} cores: the model simulates each such host, at most "
                         f"{MOST_EXACT} (their events grow with the square of their number)")
    if not fitting:
        raise ValueError(f"{n} hosts: the model simulates more than {MOST_EXACT} hosts as {MIN_GROUPS} to "
                         f"{MAX_GROUPS} equal groups, and none divides {n}; try {n - n % MIN_GROUPS} or "
                         f"{n + MIN_GROUPS - n % MIN_GROUPS}")
    return max(fitting), n // max(fitting)


# ---- gloo's collectives: symmetric lockstep steps --------------------------------------------------

def ring_step(point: Point, costs: Costs, nbytes: float, add: bool) -> float:
    """One step of a ring: every rank sends `nbytes` to the next (and, in a reduce-scatter, adds
    what it received). Every host does the same, so they act as the lockstep `groups` (agsparse's
    steps carry a whole tensor each: one by one, 256 hosts took a minute)."""
    count, width = groups(point.workers, point.cores)
    cluster = Cluster([width] * count, costs, point.rate_bps, point.cores)   # back to back: no burst

    def rank(r: int) -> Iterator:
        yield from cluster.python(r, costs.gloo_step_s * width)
        yield from cluster.send(r, (r + 1) % count, nbytes * width, transfers=width)
        if add:
            yield from cluster.native((r + 1) % count, nbytes * width * costs.add_s_per_byte)

    return cluster.run([rank(r) for r in range(count)])


def predict_ring(point: Point, costs: Costs) -> float:
    segment = point.nbytes / point.workers
    steps = point.workers - 1
    return steps * (ring_step(point, costs, segment, add=True) + ring_step(point, costs, segment, add=False))


def everyone(point: Point, costs: Costs, work: Callable[[Cluster, int], Iterator]) -> float:
    """Every rank does `work` at once (the same on each): how long until the last is done."""
    cluster = Cluster([1] * point.workers, costs, point.rate_bps, point.cores)
    return cluster.run([work(cluster, r) for r in range(point.workers)])


def predict_agsparse(point: Point, costs: Costs) -> float:
    """From a dense tensor, as the bench runs it: scan, build the rows, gloo's sparse allreduce (an
    AllGather of sizes, then of indices and of values), then each rank coalesces every rank's rows and
    writes the union back."""
    n, d = point.workers, point.density
    rows = d * point.nblocks

    def prepare(cluster: Cluster, r: int) -> Iterator:
        yield from cluster.native(r, point.nbytes * costs.scan_s_per_byte + d * point.nbytes * costs.copy_s_per_byte)

    def combine(cluster: Cluster, r: int) -> Iterator:
        yield from cluster.native(r, n * d * point.nbytes * costs.coalesce_s_per_byte
                                  + point.union * point.nbytes * costs.copy_s_per_byte)

    steps = n - 1
    return (everyone(point, costs, prepare)
            + steps * ring_step(point, costs, 8, add=False)                                  # sizes
            + steps * ring_step(point, costs, rows * GLOO_INDEX_BYTES, add=False)            # indices
            + steps * ring_step(point, costs, rows * point.block_size * ITEMSIZE, add=False)  # values
            + everyone(point, costs, combine))


def predict_ps(point: Point, costs: Costs) -> float:
    n = point.workers
    count, size = groups(n, point.cores)
    shard = point.nbytes / n
    cluster = Cluster([size] * count, costs, point.rate_bps, point.cores, point.burst_bytes)
    # (rank group, server group) pairs, each rank's flows starting at its next neighbour, so that the
    # servers' downlinks take turns as concurrent TCP flows share them (not everyone's first push
    # into rank 0). A group's own ranks push to each other too.
    first = 0 if size > 1 else 1
    flows = [(g, (g + k) % count) for k in range(first, count) for g in range(count)]
    expected = count - first
    arrived = [0] * count
    summed = [cluster.env.event() for _ in range(count)]

    def shards_between(g: int, h: int) -> int:
        return size * size - (size if g == h else 0)      # nobody pushes to itself

    def push(g: int, h: int) -> Iterator:
        shards = shards_between(g, h)
        yield from cluster.python(g, shards * costs.gloo_step_s)
        yield from cluster.send(g, h, shards * shard, shards)
        yield from cluster.native(h, shards * shard * costs.add_s_per_byte)
        arrived[h] += 1
        if arrived[h] == expected:
            summed[h].succeed()

    def reply(h: int, g: int) -> Iterator:
        yield summed[h]
        shards = shards_between(g, h)
        yield from cluster.python(h, shards * costs.gloo_step_s)
        yield from cluster.send(h, g, shards * shard, shards)

    return cluster.run([push(g, h) for g, h in flows] + [reply(h, g) for g, h in flows])


# ---- sparcoll ------------------------------------------------------------------------------------

def message_blocks(point: Point, costs: Costs) -> int:
    """Blocks per message as a rank of sparcoll sets them once it has measured the link
    (sparcoll.message_size), from the bytes a collective reads."""
    policy = MessageSizePolicy(point.message_blocks or default_message_blocks(point.block_size))
    n, d, u = point.workers, point.density, point.union
    read = u * point.nbytes if point.dedicated else (n - 1) / n * (d + u) * point.nbytes
    if point.rate_bps is not None and read >= ADAPT_MIN_BYTES:
        policy.observe(int(read), read / (point.rate_bps / 8 * costs.goodput))
    return policy.blocks(point.block_size * ITEMSIZE)


def predict_sparse(point: Point, costs: Costs) -> float:
    """sparcoll's sparse AllReduce from a dense tensor: scan, then every (worker, aggregator) stream."""
    n = point.workers
    block_bytes = point.block_size * ITEMSIZE
    per_message, in_flight = message_blocks(point, costs), point.credits
    range_blocks = point.nblocks / point.shards
    own = point.density * range_blocks                       # a worker's blocks in one stream's range
    rounds = max(1, math.ceil(own / per_message))
    sent_blocks = own / rounds
    result_blocks = point.union * range_blocks / rounds
    sent_bytes = HEADER_BYTES + sent_blocks * (block_bytes + INDEX_BYTES)
    result_bytes = HEADER_BYTES + result_blocks * (block_bytes + INDEX_BYTES)

    worker_groups, workers_per_group = groups(n, point.cores)
    if point.dedicated:
        aggregator_groups, aggregators_per_group = groups(point.shards, point.cores)
        widths = [workers_per_group] * worker_groups + [aggregators_per_group] * aggregator_groups
        host_of = lambda h: worker_groups + h  # noqa: E731
    else:
        aggregator_groups, aggregators_per_group = worker_groups, workers_per_group
        widths = [workers_per_group] * worker_groups
        host_of = lambda h: h  # noqa: E731
    cluster = Cluster(widths, costs, point.rate_bps, point.cores, point.burst_bytes)
    env = cluster.env
    pairs = workers_per_group * aggregators_per_group           # real streams per simulated one

    def remote(g: int, h: int) -> int:
        """Streams between groups g and h whose worker is not its aggregator's process."""
        return pairs - (workers_per_group if host_of(h) == g else 0)

    arrivals = {(h, j): 0 for h in range(aggregator_groups) for j in range(rounds)}
    complete = {key: env.event() for key in arrivals}
    credits = {(g, h): simpy.Container(env, init=in_flight, capacity=in_flight)
               for g in range(worker_groups) for h in range(aggregator_groups)}
    scanned = [env.event() for _ in range(worker_groups)]

    def scan(g: int) -> Iterator:
        yield from cluster.python(g, workers_per_group * costs.collective_s)
        yield from cluster.native(g, workers_per_group * point.nbytes * costs.scan_s_per_byte)
        scanned[g].succeed()

    def stream(g: int, h: int) -> Iterator:
        yield scanned[g]
        for j in range(rounds):
            yield credits[g, h].get(1)
            yield from cluster.python(g, pairs * costs.message_s)
            yield from cluster.native(g, pairs * sent_blocks * block_bytes * costs.copy_s_per_byte)
            env.process(contribute(g, h, j))

    def contribute(g: int, h: int, j: int) -> Iterator:
        host, far = host_of(h), remote(g, h)
        if far:
            yield from cluster.send(g, host, far * sent_bytes, far)
            yield from cluster.python(host, far * costs.message_s)
        yield from cluster.native(host, pairs * sent_blocks * block_bytes * costs.add_s_per_byte)
        arrivals[h, j] += 1
        if arrivals[h, j] == worker_groups:
            complete[h, j].succeed()

    def answer(h: int, j: int, g: int) -> Iterator:
        yield complete[h, j]
        host, far = host_of(h), remote(g, h)
        if far:
            yield from cluster.python(host, far * costs.message_s)
            yield from cluster.send(host, g, far * result_bytes, far)
        yield from cluster.python(g, pairs * costs.message_s)
        yield from cluster.native(g, pairs * result_blocks * block_bytes * costs.copy_s_per_byte)
        yield credits[g, h].put(1)

    # A worker's streams and an aggregator's answers go out over separate connections at once, which
    # TCP interleaves; in FIFO queues, rotating each one's order spreads them as fairly (otherwise
    # every worker would start with aggregator 0 and every aggregator with worker 0: an incast each).
    processes = [scan(g) for g in range(worker_groups)]
    processes += [stream(g, (g + k) % aggregator_groups) for g in range(worker_groups)
                  for k in range(aggregator_groups)]
    processes += [answer(h, j, (h + k) % worker_groups) for h in range(aggregator_groups)
                  for j in range(rounds) for k in range(worker_groups)]
    return cluster.run(processes)


def predict_auto(point: Point, costs: Costs) -> float:
    """sparcoll as users get it, once its chooser has settled (sparcoll.algorithm): a tiny tensor on
    the ring path (its data travels in the check round: priced as the ring); the sparse path while
    the union is sparse, unless the tensor is small enough to gather, whose paths are timed at any
    density; else the ring unless the sparse path is SPARSE_MARGIN faster. The gather path, through
    rank 0, is not modelled: priced as the ring."""
    if point.numel <= TINY_NUMEL:
        return predict_ring(point, costs)
    sparse = predict_sparse(point, costs)
    if point.union < CANDIDATE_DENSITY and point.numel * point.workers > GATHER_ELEMENTS:
        return sparse
    ring = predict_ring(point, costs)
    return sparse if sparse < SPARSE_MARGIN * ring else ring


PREDICTORS: dict[str, Callable[[Point, Costs], float]] = {
    "sparse": predict_sparse, "sparcoll": predict_auto, "ring": predict_ring, "ps": predict_ps,
    "agsparse": predict_agsparse,
}


def predict(point: Point, costs: Costs) -> float:
    """Predicted seconds for one allreduce of `point`."""
    return PREDICTORS[point.algo](point, costs)
