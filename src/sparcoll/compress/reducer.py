"""The single entry point: one tensor through compress, communicate, decompress and error feedback.

    reducer = Reducer("topk:0.01", group=None, comm=None)
    avg = reducer.reduce(grad, key="layer1.weight")     # the average over ranks
    avgs = reducer.reduce_many([g1, g2], ["w1", "w2"])  # the same, one collective for both

`reduce` returns the AVERAGE over ranks of what each rank's compressor kept (DDP's convention), as a
new tensor of the input's shape and dtype (a COO tensor for compressors that compress COO entries,
with the input's layout); it never modifies its input. Compressors work in float32: a float64
gradient comes back rounded to float32's precision, even under `none` (1 + 1e-12 comes back as 1),
and non-finite values are not guarded (a NaN or infinity kept in error-feedback memory stays there:
docs/reliability.md, "Known gaps"). Every rank must reduce the same tensors
(shapes, keys) in the same order: the collectives and the shared seeds (randomk, PowerSGD's Q) rely
on it. `key` names the tensor's error-feedback and warm-start state; a compressor that keeps state
needs one. Before its first collective a Reducer checks that every rank has the same spec and block
size (one small allgather): a seed or a level that differed would give each rank its own average, or
end the process inside gloo. Before each call's collective it checks that every rank reduces tensors
of the same sizes, and that none refused its input (one allgather of four integers, 0.4-0.7 ms a call on
2 processes on loopback, which doubles a small tensor's call; `check_sizes=False` skips it where the
caller knows, as DDP's hook and DataParallel do, whose models' shapes are checked across ranks when
they are wrapped): other sizes ended a process inside gloo, or read one rank's values into another's
shape. On the split path (`compress`, then `communicate`) the sizes are checked in `communicate`,
after `compress` updated the error feedback.

`sent_bytes` counts the payload bytes this rank contributed (parts, or kept blocks and their indices
for the sparse AllReduce; not the collective's own traffic: a ring allreduce moves about twice its
input, an allgather world - 1 times its input).
"""
from __future__ import annotations

import torch

from . import coo
from .base import Payload, block_bytes, index_dtype, parts_bytes
from ..errors import MismatchError
from .channel import Channel
from .memory import make_memory
from .registry import make
from .spec import parse


class Reducer:
    def __init__(self, spec, group=None, comm=None, timeout: float | None = None, check_sizes: bool = True):
        self.spec = parse(spec)
        self.check_sizes = check_sizes
        self.compressor = make(self.spec)
        self.memory = make_memory(self.spec)
        self.channel = Channel(group, comm, timeout)
        self.compressor.block_size = comm.block_size if comm is not None else 256
        self.compressor.seed_rank(self.channel.rank)
        self.sent_bytes = 0
        self._agreed = self.channel.world == 1
        self._mismatch: str | None = None   # what agree() found: every later call raises it too

    def payload_bytes(self, tensor: torch.Tensor) -> int:
        """What this rank sends for dense `tensor` (an upper bound where the size depends on the
        data). A sparse COO tensor's payload depends on its entries: `sent_bytes` counts it."""
        return self.compressor.payload_bytes(tensor.numel(), tuple(tensor.shape))

    def reduce(self, tensor: torch.Tensor, key=None, tag: int = 0) -> torch.Tensor:
        return self.reduce_many([tensor], [key], tag=tag)[0]

    def reduce_many(self, tensors: list, keys: list, exact: list = (), into: list | None = None,
                    tag: int = 0) -> list:
        """`reduce` for several tensors, with one collective for all of them (two for PowerSGD and
        variable-size gathers) instead of one per tensor: latency is paid once. Sparse COO tensors
        of compressors that keep them sparse are reduced one by one. `exact`: dense tensors averaged
        uncompressed in the same collective (every block of them; only where the compressor's
        collective can carry them, `carries_exact`), their averages after the others'. `into`: flat
        float32 tensors, one per dense input then per exact one, that receive the averages (each
        scheme decompresses there directly, saving a dense temporary and a copy); returned.
        `tag`: the sparse AllReduce's (Communicator.allreduce), which every rank must give alike."""
        other = next((t.layout for t in tensors if t.layout not in (torch.strided, torch.sparse_coo)), None)
        if other is not None:
            raise TypeError(f"a Reducer takes dense or sparse COO tensors, got {other}: convert it with .to_dense() "
                            f"or .to_sparse_coo()")
        stateful = self._stateful()
        if len(keys) != len(tensors) or (stateful and len(set(keys)) < len(keys)):
            raise ValueError(f"reduce_many takes one key per tensor{', each its own' if stateful else ''} (a key "
                             f"names its tensor's error-feedback or warm-start state), got {len(keys)} keys, "
                             f"{len(set(keys))} distinct, for {len(tensors)} tensors")
        self._need_keys(keys)
        if exact and not self.compressor.carries_exact:
            raise ValueError(f"{self.spec} cannot carry uncompressed tensors in its collective")
        if into is not None and any(t.is_sparse for t in tensors):
            raise ValueError("`into` takes dense inputs only")
        if into is not None and [t.numel() for t in into] != [t.numel() for t in [*tensors, *exact]]:
            raise ValueError(f"`into` holds tensors of {[t.numel() for t in into]} elements for inputs of "
                             f"{[t.numel() for t in [*tensors, *exact]]}")
        refused = self._refusal(tensors, keys, exact)
        self.agree()
        self._same_sizes([t.numel() for t in [*tensors, *exact]], refused)
        c, results, dense = self.compressor, [None] * len(tensors), []
        for i, (tensor, key) in enumerate(zip(tensors, keys)):
            if tensor.is_sparse and c.entries:
                results[i] = self._reduce_entries(tensor.coalesce(), key, tag)
            else:
                dense.append(i)
        shapes = [tuple(tensors[i].shape) for i in dense]
        comps = [self.memory.compensate(_flat_float(tensors[i]), keys[i]) for i in dense]
        if not comps and not exact:
            return results
        if c.scheme == "powersgd":
            outs = c.reduce_many(comps, shapes, [keys[i] for i in dense],
                                 self.channel.allreduce_mean_many, into)
            for comp, out, shape, i in zip(comps, outs, shapes, dense):
                # a tensor sent whole has no error to feed back; else the residual is what the
                # averaged approximation missed of this rank's own (as torch's PowerSGD hook keeps it)
                self.memory.update(comp, comp if c.sends_whole(comp.numel(), shape) else out, keys[i])
                self.sent_bytes += c.payload_bytes(comp.numel(), shape)
        else:
            payloads = [self._compress(comp, keys[i]) for comp, i in zip(comps, dense)]
            riders = [c.whole(_flat_float(t)) for t in exact]
            self.sent_bytes += sum(c.sent_bytes(payload) for payload in riders)
            outs = self._communicate(payloads + riders, into, tag)
        if into is not None:
            for target, out in zip(into, outs):
                if out.data_ptr() != target.data_ptr():
                    target.copy_(out.reshape(-1))
            return into
        for i, out, shape in zip(dense, outs, shapes):
            results[i] = out.view(shape).to(tensors[i].dtype)
        return results + [out.view(t.shape).to(t.dtype) for out, t in zip(outs[len(dense):], exact)]

    @property
    def splits(self) -> bool:
        """Whether `compress` and `communicate` can run apart (PowerSGD computes between its two
        allreduces: it cannot)."""
        return self.compressor.scheme != "powersgd"

    def compress(self, tensor: torch.Tensor, key=None) -> Payload:
        """The part of `reduce` before the collective, for a dense tensor: error feedback's
        compensation, the compressor and the memory's update. It may run on another thread than
        `communicate`, which takes its payload (in the same order on every rank)."""
        if not self.splits or tensor.is_sparse:
            raise ValueError(f"{self.spec} cannot compress apart from its collective"
                             if tensor.is_dense else "compress takes dense tensors")
        self._need_keys([key])
        return self._compress(self.memory.compensate(_flat_float(tensor), key), key)

    def communicate(self, payloads: list, likes: list, into: list | None = None, tag: int = 0) -> list:
        """The averages over ranks of what `compress` kept, one collective for all the payloads (two
        for variable-size gathers), each shaped and typed as its tensor in `likes`. `into`: flat
        float32 tensors the averages are decompressed into (as `reduce_many`'s); `tag` as
        `reduce_many`'s."""
        self.agree()
        self._same_sizes([like.numel() for like in likes])
        outs = self._communicate(payloads, into, tag)
        return [out.view(like.shape).to(like.dtype) for out, like in zip(outs, likes)]

    def _stateful(self) -> bool:
        return self.memory.active or self.compressor.scheme == "powersgd"

    def _need_keys(self, keys: list) -> None:
        """Keys name the state a compressor keeps per tensor: without one, every tensor would share it
        (one tensor's residual added into the next)."""
        if self._stateful() and any(key is None for key in keys):
            raise ValueError(f"{self.spec} keeps state per tensor (error feedback or PowerSGD's warm start): "
                             f"give each tensor its own key=, e.g. the parameter's name")

    def agree(self) -> None:
        """Once, before this reducer's first collective: every rank's spec and block size alike, or
        MismatchError naming them on every rank (reduce_many and communicate call it; a caller that
        uses the channel directly calls it first). A reducer that found them different raises that
        again at every later call: a caller that caught the first would otherwise run with them."""
        if self._mismatch is not None:
            raise MismatchError(self._mismatch)
        if self._agreed:
            return
        every = self.channel.allgather_object(f"{self.spec} in blocks of {self.compressor.block_size}")
        self._agreed = True
        if len(set(every)) > 1:
            self._mismatch = "ranks compress with different settings: " + ", ".join(
                f"rank {rank} {mine}" for rank, mine in enumerate(every))
            raise MismatchError(self._mismatch)

    def _refusal(self, tensors: list, keys: list, exact: list) -> Exception | None:
        """Why this rank cannot reduce these tensors, found before any state changes: one that is
        not floating-point (it was averaged in float32 and truncated back without a word), or a key
        whose error feedback is of another size (a review). Every tensor is looked at before any is
        compensated: a refusal of the second left the first's residual changed."""
        whole = next((t.dtype for t in [*tensors, *exact] if not t.is_floating_point()), None)
        if whole is not None:
            return TypeError(f"a Reducer averages floating-point tensors, got {whole}")
        entries = self.compressor.entries
        return next(filter(None, (self.memory.refusal(tuple(t.shape) if t.is_sparse and entries else (t.numel(),), key)
                                  for t, key in zip(tensors, keys))), None)

    def _same_sizes(self, numels: list, refused: Exception | None = None) -> None:
        """Every rank reduces tensors of these sizes in this call, else MismatchError on every rank,
        before any state changes (where `check_sizes`: one allgather of four integers, 0.4-0.7 ms on
        2 processes on loopback, a review). `refused`: this rank's own reason not to reduce them,
        raised here; its peers raise a MismatchError naming it (they waited for this rank until
        their timeout)."""
        if not self.check_sizes or self.channel.world == 1:
            if refused is not None:
                raise refused
            return
        digest = 0          # of the sizes in order, the same on every rank for the same sizes
        for numel in numels:
            digest = (digest * 1_000_003 + numel) % (1 << 61)
        mine = torch.tensor([len(numels), sum(numels), digest, refused is not None], dtype=torch.long)
        every = [tuple(t.tolist()) for (t,) in self.channel.allgather((mine,), variable=False)]
        if refused is not None:
            raise refused
        refusing = [rank for rank, e in enumerate(every) if e[3]]
        if refusing:
            raise MismatchError(f"rank{'s' if len(refusing) > 1 else ''} {', '.join(map(str, refusing))} refused "
                                f"its input to this call (a tensor not floating-point, or a key of another size)")
        if len(set(every)) > 1:
            raise MismatchError("ranks reduce tensors of different sizes in one call: " + ", ".join(
                f"rank {rank} {count} of {total} elements" for rank, (count, total, _, _) in enumerate(every))
                + ("" if len({e[:2] for e in every}) > 1 else " (the same counts and totals: other sizes or order)"))

    def _compress(self, comp: torch.Tensor, key) -> Payload:
        payload = self.compressor.compress(comp)
        self.sent_bytes += self.compressor.sent_bytes(payload)
        if self.memory.active:      # before the collective, which may reuse the parts' memory
            self.memory.update(comp, self.compressor.sent(payload, comp.numel()), key)
        return payload

    def _communicate(self, payloads: list, into: list | None = None, tag: int = 0) -> list:
        c, count = self.compressor, len(payloads[0].parts)
        parts = [p for payload in payloads for p in payload.parts]
        if c.scheme == "allreduce":
            parts = self.channel.allreduce_mean_many(parts)
        elif c.scheme == "sparse":
            return self.channel.blocks_mean([(*payload.parts, payload.ctx) for payload in payloads],
                                            c.block_size, into, tag)
        else:
            gathered = self.channel.allgather(tuple(parts), c.variable)
            return [c.combine([ranks[j * count:(j + 1) * count] for ranks in gathered], payload.ctx,
                              None if into is None else into[j])
                    for j, payload in enumerate(payloads)]
        return [c.decompress(tuple(parts[j * count:(j + 1) * count]), payload.ctx,
                             None if into is None else into[j])
                for j, payload in enumerate(payloads)]

    def _reduce_entries(self, g: torch.Tensor, key, tag: int) -> torch.Tensor:
        """A COO tensor compressed entry by entry, never densified (memory included). Kept entries
        go by sparcoll's sparse AllReduce for blocktopk, and when there is a communicator for
        compressors that keep every entry (none, fp16, bf16: the blocks are the input's own);
        otherwise they are gathered (topk's scattered entries would touch a block each)."""
        c = self.compressor
        comp = self.memory.compensate(g, key).coalesce()
        shape, sparse_dim = comp.shape, comp.sparse_dim()
        idx, vals = coo.entries(comp)
        kept_idx, kept_vals = c.compress_entries(idx, vals, comp.numel())
        if self.memory.active:
            sent = coo.from_entries(kept_idx, kept_vals.float(), shape, sparse_dim)
            self.memory.update(comp, sent, key)
        if c.scheme == "sparse" or (c.keeps_entries and self.channel.comm is not None):
            # sparcoll's sparse AllReduce of the entries' blocks (fp16/bf16 values stay cast)
            blocks = torch.unique(kept_idx // c.block_size).numel()
            self.sent_bytes += block_bytes(blocks, c.block_size, kept_vals.element_size())
            flat = torch.sparse_coo_tensor(kept_idx.unsqueeze(0), kept_vals, (comp.numel(),),
                                           is_coalesced=True, check_invariants=False)
            result = self.channel.sparse_mean(flat, tag).coalesce()
            idx, vals = result.indices()[0], result.values()
        else:
            parts = (kept_idx.to(index_dtype(comp.numel())), kept_vals)
            self.sent_bytes += parts_bytes(parts)
            gathered = self.channel.allgather(parts, variable=True)
            idx = torch.cat([parts[0].long() for parts in gathered])
            vals = torch.cat([parts[1].float() for parts in gathered]) / self.channel.world
        return coo.from_entries(idx, vals.float(), shape, sparse_dim).to(g.dtype)


def _flat_float(tensor: torch.Tensor) -> torch.Tensor:
    """A flat float32 view of a dense tensor where one exists (a sparse one densified), detached: a
    gradient that requires grad (one of a higher-order backward) is data here, as gloo takes it."""
    return (tensor.to_dense() if tensor.is_sparse else tensor).detach().reshape(-1).float()
