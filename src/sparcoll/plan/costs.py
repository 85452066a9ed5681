"""Empirical cost models: what each option costs each tensor, from a profile measured on the user's
machine and network (sparcoll.plan.profiler, `sparcoll plan --profile`).

Every measured quantity is a Curve, time by size x through the measured points (the sparse AllReduce's
a Grid):
  collectives  ring, ps, allgather: x = the bytes each worker contributes. sparse: a Grid, time by the
               tensor's elements and the share of its dense bytes the sparse AllReduce sends and
               receives back, (local + union block density) / 2 (a dense tensor: 1); x = sparse_volume;
               on a model's large dense gradient that is not dense, its time measured on that gradient
               (alone and under load) instead. A sparse-scheme compressor's payload (blocktopk's kept
               blocks) travels as a COO tensor of those blocks, so no dense tensor is scanned: its own
               curve (BLOCKS) by the same x
  compressors  compress and decompress: x = the tensor's elements (measured while every worker of the
               job computes at once, as in training); a large gradient of the model's own takes the
               times measured on it instead (a compressor's time depends on the data)
  SFB          per linear layer: the weight gradient's share of backward, which SFB spares; its
               rebuild from every worker's factors, on the channel after the factors' allgather, alone
               and while backward computes (a collective's contention); and how long the layer's
               backward takes from its output gradient (when the factors are ready) to its weight
               gradient
  lookups      an embedding declared dense whose rows DataParallel looks up sparse under the sparse
               AllReduce: the backward time and CPU that spares (as SFB's spared work, a negative
               compression on the training thread), its collective measured on its rows
  COO          a sparse COO gradient's options (its compressor on the entries and its collective),
               measured whole on the model's own gradient, alone and beside backward: its cost follows
               its rows, not its dense size
  PowerSGD     measured whole (its products, its error feedback and its two allreduces: thin products
               are bound by memory, not flops), on the channel
  CPU          each of those collectives' and compressors' CPU seconds on one worker (every thread of
               its process) where it was timed alone, and a step's forward, backward and optimizer:
               what timeline.Step.cpu_bound spreads over the worker's cores
  contention   per collective kind and size, its time while the model's forward and backward run on
               the training thread (`loaded`), and how many times longer they take meanwhile
               (`slowdown`; neither made monotone); PowerSGD, whose allreduces are the ring's, takes the
               ring's at its payload
  the link     an uncompressed tensor on the ring runs on gloo's lane (timeline.py) and holds the
               channel for its bytes on the busiest link (2 (n - 1) / n of its own) at the link's
               rate, or, up to the largest ring the profile timed so, for as long as it delayed a
               sparse AllReduce started right after it (`held`: its CPU on a busy machine), if
               longer; where that is all its time, and on loopback (no rate), it is priced on the
               channel (the same timeline, fewer states for the decision's search)
How an option's cost is built from them is `Costing.cost`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from sparcoll.compress import make

from .options import ALLGATHER, DEDICATED, RING, SFB, SPARSE, Option, TensorFacts, coo_label
from .timeline import Cost

ITEMSIZE = 4
MONOTONE = ("collectives", "cpu", "cpu_loaded")     # quantities that never fall with size (contention's may)
# A COO gradient's measurements per option (profiler.profile_coo): alone, beside backward, and
# backward's slowdown meanwhile; the profile's fits hold each as KIND_own (and its CPU alone as
# coo_cpu_own, beside training as coo_cpu_loaded_own).
COO_KINDS = ("coo", "coo_loaded", "coo_slowdown")


@dataclass(frozen=True)
class Curve:
    """Time by size through the measured points: linear between them, the smallest point's time
    below them (a latency floor), the last two points' line above them. Made non-decreasing (a
    larger size never takes less time; noise in the measurements would say otherwise)."""
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[-1] or len(xs) == 1:
            return float(np.interp(x, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])

    @classmethod
    def of(cls, points, monotone: bool = True) -> "Curve":
        """From measured (x, y) points; points of one x are averaged."""
        by_x: dict = {}
        for x, y in points:
            by_x.setdefault(float(x), []).append(float(y))
        xs = sorted(by_x)
        ys = [float(np.mean(by_x[x])) for x in xs]
        if monotone:
            ys = np.maximum.accumulate(ys)
        return cls(tuple(xs), tuple(float(y) for y in ys))


@dataclass(frozen=True)
class Grid:
    """The sparse AllReduce's time by a tensor's elements and the share of its dense bytes it carries:
    a Curve by share at each measured element count, and between counts a Curve by count (the scan for
    non-zero blocks follows the elements, the bytes on the wire both). A curve by bytes alone priced
    deeplight's dense 160K-element MLP weights (640 KB) between a dense 256K-element tensor (1 MB) and
    a 4M-element one at 1% (431 KB), whose scan beside backward took 11.7x its time alone."""
    numels: tuple[float, ...]
    by_share: tuple[Curve, ...]
    monotone: bool = True

    def __call__(self, numel: float, share: float) -> float:
        ys = np.array([c(share) for c in self.by_share])
        return Curve(self.numels, tuple(np.maximum.accumulate(ys) if self.monotone else ys))(numel)

    @classmethod
    def of(cls, points, monotone: bool = True) -> "Grid":
        """From measured (elements, share, seconds) points."""
        by_numel: dict = {}
        for numel, share, y in points:
            by_numel.setdefault(float(numel), []).append((share, y))
        numels = sorted(by_numel)
        return cls(tuple(numels), tuple(Curve.of(by_numel[n], monotone) for n in numels), monotone)

    def rows(self) -> list:
        """As a profile's fits store it: [elements, shares, seconds] per measured element count."""
        return [[n, list(c.xs), list(c.ys)] for n, c in zip(self.numels, self.by_share)]

    @classmethod
    def of_rows(cls, rows: list, monotone: bool = True) -> "Grid":
        return cls(tuple(float(n) for n, _, _ in rows), tuple(Curve(tuple(xs), tuple(ys)) for _, xs, ys in rows),
                   monotone)


@dataclass(frozen=True)
class Measured:
    """One tensor as the profile saw it (besides its facts): its shape, the rows K its layer saw per
    step (linear layers), the block density of its gradient on one worker and of their union, and
    for a linear layer's weight SFB's times (seconds): its layer's backward from the output gradient
    to the weight gradient (`node`), the local weight gradient's share of backward (`spared`) and the
    rebuild from every worker's factors, alone (`rebuild`) and while backward computes
    (`rebuild_loaded`, None: as alone; backward `rebuild_slowdown` times slower meanwhile), and the
    rebuild's CPU seconds, alone (`rebuild_cpu`) and while backward computes (`rebuild_cpu_loaded`).
    For an embedding's weight declared dense, the backward time and CPU its rows looked up sparse
    spare where the sparse AllReduce takes it (`lookup_spared`, `lookup_spared_cpu`)."""
    facts: TensorFacts
    shape: tuple
    rows: int = 0
    density: float = 1.0
    union: float = 1.0
    node: float = 0.0
    spared: float = 0.0
    rebuild: float = 0.0
    rebuild_loaded: float | None = None
    rebuild_slowdown: float = 1.0
    rebuild_cpu: float = 0.0
    rebuild_cpu_loaded: float | None = None
    lookup_spared: float = 0.0
    lookup_spared_cpu: float = 0.0


# The sparse AllReduce of a COO tensor of blocks, as a sparse-scheme compressor's payload travels
# (Channel.blocks_mean): measured apart from the dense tensors' grid, whose scan of every element it
# does not do (6M elements, 1% of the blocks kept per worker, 4 workers at 1 Gbit/s: 7.2 ms and 3.1 ms
# of CPU a worker as blocks, 14.1 ms and 6.3 ms as a dense tensor)
BLOCKS = "sparse-blocks"


def sparse_volume(numel: int, density: float, union: float) -> float:
    """The sparse AllReduce's x: what a worker sends (its non-zero blocks) and receives (the union's)
    as a share of a dense tensor of `numel` float32."""
    return numel * ITEMSIZE * (density + union) / 2


class Costing:
    """Options' costs from a profile's curves (its "fits": per quantity the points' xs and ys, and the
    sparse AllReduce's grids under "grids", see profiler.fit)."""

    def __init__(self, fits: dict, workers: int, link_rate: float | None = None):
        """`link_rate`: the network's, bytes per second (None: loopback)."""
        self.collective = {name: Curve(*xy) for name, xy in fits["collectives"].items()}
        self.grids = {quantity: {name: Grid.of_rows(rows, monotone=quantity in MONOTONE)
                                 for name, rows in by_name.items()}
                      for quantity, by_name in fits.get("grids", {}).items()}
        # a collective measured on the model's own gradient: quantity -> kind -> tensor name -> time
        self.own = {quantity: fits.get(f"{quantity}_own", {})
                    for quantity in ("collectives", "loaded", "slowdown", "cpu", "cpu_loaded")}
        self.compress = {spec: Curve(*xy) for spec, xy in fits["compress"].items()}
        self.decompress = {spec: Curve(*xy) for spec, xy in fits["decompress"].items()}
        self.compress_own = fits.get("compress_own", {})       # spec -> tensor name -> seconds
        self.decompress_own = fits.get("decompress_own", {})
        # their CPU seconds (a profile before they were measured: none, no CPU bound)
        self.compress_cpu = {spec: Curve(*xy) for spec, xy in fits.get("compress_cpu", {}).items()}
        self.decompress_cpu = {spec: Curve(*xy) for spec, xy in fits.get("decompress_cpu", {}).items()}
        self.compress_cpu_own = fits.get("compress_cpu_own", {})
        self.decompress_cpu_own = fits.get("decompress_cpu_own", {})
        self.coo_cpu = fits.get("coo_cpu_own", {})
        self.coo_cpu_loaded = fits.get("coo_cpu_loaded_own", {})
        # a COO gradient's options, measured whole: option -> tensor name -> seconds (or slowdown)
        self.coo = {kind: fits.get(f"{kind}_own", {}) for kind in COO_KINDS}
        self.loaded = {name: Curve(*xy) for name, xy in fits.get("loaded", {}).items()}
        self.slowdown = {name: Curve(*xy) for name, xy in fits.get("slowdown", {}).items()}
        self.held = {name: Curve(*xy) for name, xy in fits.get("held", {}).items()}
        self.cpu = {name: Curve(*xy) for name, xy in fits.get("cpu", {}).items()}
        self.cpu_loaded = {name: Curve(*xy) for name, xy in fits.get("cpu_loaded", {}).items()}
        self._curves = {"collectives": self.collective, "loaded": self.loaded, "slowdown": self.slowdown,
                        "cpu": self.cpu, "cpu_loaded": self.cpu_loaded}
        self.workers = workers
        self.link_rate = link_rate

    def _measured(self, quantity: str, kind: str, x: float, numel: int, name: str | None = None) -> float | None:
        """The profile's `quantity` ("collectives", "loaded", "slowdown", "cpu" or "cpu_loaded") of
        collective `kind` for x bytes of tensor `name` of `numel` elements: as measured on that
        tensor's own gradient if it was, else from the kind's grid (the share x is of its dense
        bytes) or curve; None if not measured."""
        own = self.own[quantity].get(kind, {}).get(name)
        if own is not None:
            return own
        grid = self.grids.get(quantity, {}).get(kind)
        if grid is not None:
            return grid(numel, x / max(1, numel * ITEMSIZE))
        curve = self._curves[quantity].get(kind)
        return None if curve is None else curve(x)

    def _on(self, kind: str, x: float, compress: float = 0.0, decompress: float = 0.0, offload: bool = False,
            sooner: float = 0.0, comm: float | None = None, numel: int = 0, name: str | None = None,
            beside: bool = False, cpu: float = 0.0, comm_cpu: float | None = None,
            compress_cpu: float = 0.0) -> Cost:
        """A cost whose payload of size x (of tensor `name`, of `numel` elements) travels on collective
        `kind` (its time alone `comm` and CPU `comm_cpu`, if not the kind's measured ones), with that
        kind's contention where the profile measured it; `beside`: on gloo's lane (an uncompressed
        ring allreduce); `cpu`: the compression's and decompression's CPU seconds, `compress_cpu` the
        compression's. Its CPU beside training, where the profile measured the kind's, is that
        collective's (`Cost.cpu_loaded`)."""
        measured = self._measured("collectives", kind, x, numel, name)
        comm_cpu_loaded = None
        if comm_cpu is None:
            comm_cpu = self._measured("cpu", kind, x, numel, name) or 0.0
            comm_cpu_loaded = self._measured("cpu_loaded", kind, x, numel, name)
        cpu_loaded = None if comm_cpu_loaded is None else cpu + comm_cpu_loaded
        cpu += comm_cpu
        if measured is None and comm is None:
            raise ValueError(f"the profile has no measurement of the {kind} collective (fits.collectives.{kind}): "
                             f"edited or damaged? run with --reprofile")
        alone = measured if comm is None else comm
        hold = None     # a collective that needs the link for all its time: the same as on the channel
        if beside and self.link_rate:
            link = 2 * (self.workers - 1) / self.workers * x / self.link_rate
            held = self.held.get(kind)
            if held is not None and x <= held.xs[-1]:
                link = max(link, held(x))
            hold = link if link < alone else None
        loaded = self._measured("loaded", kind, x, numel, name)
        if loaded is None:
            return Cost(compress, alone, decompress, offload, sooner, hold=hold, cpu=cpu, compress_cpu=compress_cpu,
                        cpu_loaded=cpu_loaded)
        return Cost(compress, alone, decompress, offload, sooner, alone * loaded / max(measured, 1e-12),
                    max(1.0, self._measured("slowdown", kind, x, numel, name)), hold, cpu, compress_cpu, cpu_loaded)

    def _gathered(self, x: float, parts: int, compress: float = 0.0, decompress: float = 0.0, offload: bool = False,
                  sooner: float = 0.0, variable: bool = True, cpu: float = 0.0, compress_cpu: float = 0.0) -> Cost:
        """An allgather of `parts` tensors of x bytes in all, as the Channel runs it: sizes that vary
        between ranks (SFB's factors, a sparsifier's entries) are gathered first, a round of their own."""
        data = self._on(ALLGATHER, x, compress, decompress, offload, sooner, cpu=cpu, compress_cpu=compress_cpu)
        if not variable:
            return data
        both = in_sequence([self._on(ALLGATHER, 8 * parts), data])
        return replace(data, comm=both.comm, loaded=both.loaded, slowdown=both.slowdown, cpu=both.cpu,
                       cpu_loaded=both.cpu_loaded)

    def cost(self, t: Measured, option: Option) -> Cost:
        """The option's compression time (on the training thread or offloaded), channel time and
        decompression time for tensor t."""
        numel, c = t.facts.numel, option.compressor
        if t.facts.coo:
            return self._coo(t, option)
        if option.collective == SFB:        # backward no longer computes the local weight gradient
            m, n = t.shape      # the rebuild runs on the channel, slower while backward computes
            gather = self._gathered(t.rows * (m + n) * ITEMSIZE, 2, -t.spared, sooner=max(0.0, t.node - t.spared))
            rebuild = Cost(comm=t.rebuild, loaded=t.rebuild_loaded, slowdown=t.rebuild_slowdown, cpu=t.rebuild_cpu,
                           cpu_loaded=t.rebuild_cpu_loaded)
            both = in_sequence([gather, rebuild])
            return replace(gather, comm=both.comm, loaded=both.loaded, slowdown=both.slowdown, cpu=both.cpu,
                           cpu_loaded=both.cpu_loaded)
        if c == "none":
            if option.collective in (SPARSE, DEDICATED):
                sent = self._on(option.collective, sparse_volume(numel, t.density, t.union), numel=numel,
                                name=t.facts.name)
                if not (t.lookup_spared or t.lookup_spared_cpu):
                    return sent
                # an embedding declared dense, its rows looked up sparse: the backward work that spares, as
                # a negative compression (its CPU the compression's: the collective keeps its own)
                spared = t.lookup_spared_cpu
                return replace(sent, compress=-t.lookup_spared, cpu=sent.cpu - spared, compress_cpu=-spared,
                               cpu_loaded=None if sent.cpu_loaded is None else sent.cpu_loaded - spared)
            return self._on(option.collective, numel * ITEMSIZE, beside=option.collective == RING)
        return self.bucket([t], option)

    def priced_coo(self, name: str, option: Option) -> bool:
        """Whether the profile timed COO gradient(s) `name` (several: their names joined by "+", as
        one collective of them all) under `option`."""
        return all(name in self.coo[kind].get(coo_label(option), {}) for kind in COO_KINDS)

    def _coo(self, t: Measured, option: Option) -> Cost:
        """A sparse COO gradient's option as the profile measured it on the gradient (compression and
        collective, on the channel), alone and beside backward."""
        label, name = coo_label(option), t.facts.name
        try:
            alone, loaded, slowdown = (self.coo[kind][label][name] for kind in COO_KINDS)
        except KeyError:
            raise ValueError(f"the profile has no time for {name}'s sparse COO gradient under {label}; "
                             f"profile again (--reprofile)") from None
        return Cost(0.0, alone, 0.0, option.offload, 0.0, loaded, max(1.0, slowdown),
                    cpu=self.coo_cpu.get(label, {}).get(name, 0.0),
                    cpu_loaded=self.coo_cpu_loaded.get(label, {}).get(name))

    def bucket(self, ts: list[Measured], option: Option) -> Cost:
        """Dense tensors of one compressor as sparcoll.torch.DataParallel sends a bucket (or a layer's
        bias and weight): each compressed and decompressed on its own, their payloads in one
        collective (PowerSGD's, measured whole per tensor, one by one)."""
        c = option.compressor
        compressor = _compressor(c)
        compress = decompress = compress_cpu = decompress_cpu = 0.0
        for t in ts:
            compress += _own_or_curve(self.compress_own, self.compress, c, t)
            compress_cpu += _own_or_curve(self.compress_cpu_own, self.compress_cpu, c, t, missing=0.0)
            if compressor.scheme != "powersgd":
                decompress += _own_or_curve(self.decompress_own, self.decompress, c, t)
                decompress_cpu += _own_or_curve(self.decompress_cpu_own, self.decompress_cpu, c, t, missing=0.0)
        cpu = compress_cpu + decompress_cpu
        numel = sum(t.facts.numel for t in ts)
        payload = sum(compressor.payload_bytes(t.facts.numel, t.shape) for t in ts)
        if compressor.scheme == "powersgd":        # its time is measured whole: all on the channel
            return self._on(RING, payload, comm=compress, comm_cpu=cpu)
        if compressor.scheme == "sparse":
            kept = min(1.0, payload / (numel * ITEMSIZE))
            kind = BLOCKS if option.collective == SPARSE and BLOCKS in self.collective else option.collective
            return self._on(kind, sparse_volume(numel, kept, 1 - (1 - kept) ** self.workers),
                            compress, decompress, option.offload, numel=numel, cpu=cpu, compress_cpu=compress_cpu)
        if compressor.scheme == "allreduce":
            return self._on(RING, payload, compress, decompress, option.offload, cpu=cpu, compress_cpu=compress_cpu)
        return self._gathered(payload, 2 * len(ts), compress, decompress, option.offload,
                              variable=compressor.variable, cpu=cpu, compress_cpu=compress_cpu)


def in_sequence(parts: list[Cost], offload: bool = False) -> Cost:
    """Tensors or collectives sent one after another as one: their times add up; backward's slowdown
    is that of each part for as long as it runs."""
    total = Cost(sum(c.compress for c in parts), sum(c.comm for c in parts), sum(c.decompress for c in parts),
                 offload, cpu=sum(c.cpu for c in parts), compress_cpu=sum(c.compress_cpu for c in parts),
                 cpu_loaded=None if all(c.cpu_loaded is None for c in parts) else sum(c.in_training for c in parts))
    if all(c.loaded is None for c in parts):
        return total
    loaded = [c.comm if c.loaded is None else c.loaded for c in parts]
    spans = [t + c.decompress for t, c in zip(loaded, parts)]
    slowdown = sum(s * c.slowdown for s, c in zip(spans, parts)) / sum(spans) if sum(spans) > 0 else 1.0
    return replace(total, loaded=sum(loaded), slowdown=slowdown)


def _own_or_curve(own: dict, curves: dict, spec: str, t: Measured, missing: float | None = None) -> float:
    """A compressor's time (or CPU) on tensor t: as measured on t's own gradient if it was, else from
    its curve by elements; `missing` where the profile has neither (CPU: a profile from before it was
    measured), if given."""
    measured = own.get(spec, {}).get(t.facts.name)
    if measured is not None:
        return measured
    if spec not in curves and missing is not None:
        return missing
    return curves[spec](t.facts.numel)


@functools.lru_cache(maxsize=None)
def _compressor(spec: str):
    return make(spec)
