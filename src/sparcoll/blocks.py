"""A tensor seen as fixed-size blocks: find the non-zero ones, hand out views, gather and scatter.

All work is whole-tensor torch ops; nothing loops over blocks in Python. Runs of consecutive blocks are
exposed as views so the transport can send from, and receive into, the tensor's own memory.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

SCAN_ROWS = 1 << 16   # rows per reduceat in a scan: bounds the cached row starts (512 KiB)
COARSE_BYTES = 1024   # rows of at most an eighth of this are first scanned in groups this wide
REFINE_SHARE = 0.25   # ... unless more than this share of the last chunk's groups held something
SAMPLE_GROUPS = 64    # (or, before the first chunk, of as many groups sampled across the rows)
FLAG_ROWS = 1 << 14   # rows of at most 8 words flagged at a time: their scratch stays in the cache (1 MiB)


def block_count(numel: int, block_size: int) -> int:
    """Blocks of `block_size` elements that hold `numel` elements (the last one may be partial)."""
    return -(-numel // block_size)


def may_overlap(t: torch.Tensor) -> bool:
    """Whether elements of a strided tensor may share memory: stride 0 (as expand() makes) or
    strides that interleave. Results are written back in place, so such a tensor cannot take them.
    Where torch cannot tell, the dimensions sorted by stride must each step past the last offset
    the ones below reach (every view of distinct elements that slices, steps, narrows, transposes
    or permutes does); any layout more tangled counts as overlapping."""
    verdict = torch._debug_has_internal_overlap(t)     # 0: no, 1: yes, 2: torch cannot tell
    if verdict != 2:
        return verdict == 1
    reach = 0     # the largest offset the dimensions so far reach
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def nonzero_mask(rows: torch.Tensor) -> np.ndarray:
    """Which rows hold a non-zero element. -0.0 counts as zero; NaN and Inf count as non-zero.

    One pass over the data and no temporary of its size: each row's bytes are read as the widest
    unsigned words that tile a row and OR-ed together (reduceat over the flat words: numpy reduces
    a long contiguous array far faster than many short rows); a row is non-zero iff that OR has a
    bit set outside its elements' sign bits. Measured on 16M float32 at 1% (one core): 1.9 ms,
    against 2.6 ms for `!= 0` into a reused scratch then the same OR of its flags, and 29 ms for
    torch's abs().amax(1).

    Narrow rows cost more per byte (a reduceat step per row): rows of at most an eighth of
    COARSE_BYTES are first OR-ed in groups COARSE_BYTES wide, and only the groups that hold
    something are scanned row by row; if more than REFINE_SHARE of a sample of groups (then of the
    last chunk's) held something, rows are scanned one by one at once. 16M float32 freshly copied,
    one core, medians of 100 alternated: 1% of rows non-zero, rows of 16 10.6 -> 6.7 ms, of 32
    6.2 -> 4.6 (rows of 256: 3.3); every row non-zero 10.9 -> 11.9 and 8.4 -> 8.7 (the sample).
    Rows of 64 gained nothing (4.9 -> 5.1 at 1%), so they are scanned row by row. Rows of at most 8
    words skip reduceat altogether (_flag_rows): medians of 40 alternated, rows of 16 at 1% 5.5 ->
    4.8 ms, every row 10.7 -> 6.4; rows of 8 at 1% 19.7 -> 7.8 (docs/results/narrow-flags)."""
    if rows.device.type != "cpu":
        return ((rows.amax(1) != 0) | (rows.amin(1) != 0)).cpu().numpy()
    nrows, width = rows.shape
    if nrows == 0:
        return np.zeros(0, dtype=bool)
    size = rows.element_size()
    row_bytes = width * size
    word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8)
                if row_bytes % np.dtype(w).itemsize == 0)
    as_ints = rows.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    words = np.ascontiguousarray(as_ints.numpy()).reshape(-1).view(word)
    per_row = len(words) // nrows
    value_bits = _value_bits(word, size)
    group = COARSE_BYTES // row_bytes if COARSE_BYTES % row_bytes == 0 and row_bytes * 8 <= COARSE_BYTES \
        else 1
    coarse = group > 1 and _sampled_share(words, per_row, group, value_bits) <= REFINE_SHARE
    mask = np.empty(nrows, dtype=bool)
    for first in range(0, nrows, SCAN_ROWS):
        count = min(SCAN_ROWS, nrows - first)
        chunk, out = words[first * per_row:(first + count) * per_row], mask[first:first + count]
        if coarse:
            share = _scan_groups(chunk, per_row, group, value_bits, out)
        else:
            _scan_rows(chunk, per_row, value_bits, out)
            share = _group_share(out, group) if group > 1 else 1.0
        coarse = group > 1 and share <= REFINE_SHARE
    return mask


def _scan_rows(words: np.ndarray, per_row: int, value_bits, out: np.ndarray) -> None:
    """out[i]: whether row i of `words` (rows of `per_row` words, at most SCAN_ROWS of them) has a
    bit of `value_bits` set."""
    if per_row in (1, 2, 4, 8):
        _flag_rows(words, per_row, value_bits, out)
        return
    ors = np.bitwise_or.reduceat(words, _row_starts(per_row, SCAN_ROWS)[:len(out)])
    np.not_equal(np.bitwise_and(ors, value_bits, out=ors), 0, out=out)


def _flag_rows(words: np.ndarray, per_row: int, value_bits, out: np.ndarray) -> None:
    """_scan_rows for rows of 1, 2, 4 or 8 words, where a reduceat step per row costs more than
    reading the row: every word tested into a bool, and a row's bools read as one integer. 16M
    float32 in rows of 16 (8 words), one core: every row non-zero 9.3 -> 5.7 ms; inside the groups
    that hold something at 1% of rows, 1.2 -> 0.45 ms."""
    span = min(len(out), FLAG_ROWS) * per_row
    scratch, flags = np.empty(span, dtype=words.dtype), np.empty(span, dtype=bool)
    row_of_flags = np.dtype(f"u{per_row}")
    for first in range(0, len(out), FLAG_ROWS):
        count = min(FLAG_ROWS, len(out) - first)
        part, n = words[first * per_row:(first + count) * per_row], count * per_row
        np.not_equal(np.bitwise_and(part, value_bits, out=scratch[:n]), 0, out=flags[:n])
        np.not_equal(flags[:n].view(row_of_flags), 0, out=out[first:first + count])


def _sampled_share(words: np.ndarray, per_row: int, group: int, value_bits) -> float:
    """The share of SAMPLE_GROUPS groups of `group` rows, evenly spaced, that hold something (1 where
    there are not many more groups than that: a row-by-row scan of so few costs nothing)."""
    groups = len(words) // per_row // group
    if groups < 2 * SAMPLE_GROUPS:
        return 1.0
    picks = np.linspace(0, groups - 1, SAMPLE_GROUPS).astype(np.intp)
    sample = words[:groups * group * per_row].reshape(groups, group * per_row)[picks].reshape(-1)
    held = np.empty(SAMPLE_GROUPS, dtype=bool)
    _scan_rows(sample, per_row * group, value_bits, held)
    return np.count_nonzero(held) / SAMPLE_GROUPS


def _group_share(flags: np.ndarray, group: int) -> float:
    """The share of whole groups of `group` (a power of two) flags with one set: the flags read as
    integers of up to 8 of them (no reduction over short rows, which costs numpy more than the scan)."""
    whole = len(flags) - len(flags) % group
    if whole == 0:
        return 1.0
    per_word = min(group, 8)
    words = flags[:whole].view(np.dtype(f"u{per_word}"))
    if group > per_word:
        words = np.bitwise_or.reduce(words.reshape(-1, group // per_word), axis=1)
    return np.count_nonzero(words) * group / whole


def _scan_groups(words: np.ndarray, per_row: int, group: int, value_bits, out: np.ndarray) -> float:
    """_scan_rows over groups of `group` rows first, then row by row within the groups that hold
    something (rows left over after the last whole group row by row); the share of groups that did."""
    whole = len(out) - len(out) % group
    groups = whole // group
    held = np.empty(groups, dtype=bool)
    _scan_rows(words[:whole * per_row], per_row * group, value_bits, held)
    hit = np.flatnonzero(held)
    if hit.size > REFINE_SHARE * groups:       # gathering them would copy much of the chunk
        _scan_rows(words, per_row, value_bits, out)
        return hit.size / groups
    out[:whole] = False
    if hit.size:
        inside = np.empty(hit.size * group, dtype=bool)
        _scan_rows(words[:whole * per_row].reshape(groups, per_row * group)[hit].reshape(-1),
                   per_row, value_bits, inside)
        out[:whole].reshape(groups, group)[hit] = inside.reshape(hit.size, group)
    if whole < len(out):
        _scan_rows(words[whole * per_row:], per_row, value_bits, out[whole:])
    return hit.size / max(groups, 1)


def _value_bits(word, size: int):
    """A `word` with every bit set but the sign bit of each `size`-byte element in it
    (little-endian: an element's sign is the top bit of its last byte)."""
    element = b"\xff" * (size - 1) + b"\x7f" if size > 1 else b"\xff"
    return np.frombuffer(element * (np.dtype(word).itemsize // size), dtype=word)[0]


@functools.lru_cache(maxsize=16)
def _row_starts(per_row: int, rows: int) -> np.ndarray:
    """The first word of each of `rows` rows of `per_row` words (read-only: shared by threads)."""
    starts = np.arange(rows, dtype=np.intp) * per_row
    starts.flags.writeable = False
    return starts


def runs(indices: np.ndarray, limit: int) -> list[tuple[int, int]] | None:
    """Sorted block indices as [start, stop) runs of consecutive blocks, or None if there are more
    than `limit` runs (then gathering into one buffer beats one system call per run)."""
    if indices.size == 0:
        return []
    if int(indices[-1]) - int(indices[0]) + 1 == indices.size:
        return [(int(indices[0]), int(indices[-1]) + 1)]
    breaks = np.flatnonzero(np.diff(indices) != 1)
    if breaks.size + 1 > limit:
        return None
    starts = [int(indices[0])] + (indices[breaks + 1]).tolist()
    stops = (indices[breaks] + 1).tolist() + [int(indices[-1]) + 1]
    return list(zip(starts, stops))


def as_bytes(t) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's or numpy array's memory (no copy)."""
    if isinstance(t, np.ndarray):
        return memoryview(t).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class BlockTensor:
    """A flat contiguous CPU tensor as (nblocks, block_size) rows. A last, partial block is kept padded
    with zeros in a one-row side buffer, copied back by `finish()`."""

    direct = True           # results can be received straight into the tensor's memory

    def __init__(self, flat: torch.Tensor, block_size: int):
        self.flat = flat
        self.dtype = flat.dtype
        self.block_size = block_size
        self.full = flat.numel() // block_size
        self.nblocks = block_count(flat.numel(), block_size)
        self.rows = flat[: self.full * block_size].view(self.full, block_size)
        self.tail = None
        if self.nblocks > self.full:
            self.tail = torch.zeros(1, block_size, dtype=flat.dtype)
            self.tail[0, : flat.numel() - self.full * block_size] = flat[self.full * block_size:]

    def nonzero(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Indices (int64, sorted) of the non-zero blocks in [lo, hi): the scan."""
        hi = self.nblocks if hi is None else hi
        mask = nonzero_mask(self.rows[lo:min(hi, self.full)])
        if self.tail is not None and hi > self.full:
            mask = np.concatenate([mask, nonzero_mask(self.tail)])
        return np.flatnonzero(mask) + lo

    def views(self, start: int, stop: int) -> list[torch.Tensor]:
        """The blocks [start, stop) as one or two views of the tensor's memory (two when the run
        reaches the padded last block)."""
        out = []
        if start < self.full:
            out.append(self.rows[start:min(stop, self.full)])
        if stop > self.full:
            out.append(self.tail)
        return out

    def gather(self, indices: np.ndarray) -> torch.Tensor:
        """Copy of the blocks `indices` as an (m, block_size) tensor."""
        if self.tail is not None and indices.size and int(indices[-1]) == self.full:
            return torch.cat([self.rows.index_select(0, torch.from_numpy(indices[:-1])), self.tail])
        return self.rows.index_select(0, torch.from_numpy(indices))

    def rows_of(self, indices: np.ndarray) -> torch.Tensor:
        """The blocks `indices` as an (m, block_size) tensor: a view when they form one run inside the
        full blocks, else a gathered copy."""
        n = indices.size
        if n and int(indices[-1]) < self.full and int(indices[-1]) - int(indices[0]) == n - 1:
            return self.rows[int(indices[0]):int(indices[0]) + n]
        return self.gather(indices)

    def scatter(self, indices: np.ndarray, rows: torch.Tensor) -> None:
        """Write `rows` into the blocks `indices`."""
        if self.tail is not None and indices.size and int(indices[-1]) == self.full:
            self.tail.copy_(rows[-1:])
            indices, rows = indices[:-1], rows[:-1]
        n = indices.size
        if n and int(indices[-1]) - int(indices[0]) == n - 1:
            target = self.rows[int(indices[0]):int(indices[0]) + n]
            if target.data_ptr() != rows.data_ptr():
                target.copy_(rows)
        elif n:
            self.rows.index_copy_(0, torch.from_numpy(indices), rows)

    def finish(self) -> torch.Tensor:
        """Copy the padded last block back into the tensor; return the flat tensor."""
        if self.tail is not None:
            start = self.full * self.block_size
            self.flat[start:].copy_(self.tail[0, : self.flat.numel() - start])
        return self.flat


def _retile(ids: np.ndarray, units: torch.Tensor, width: int) -> tuple[np.ndarray, torch.Tensor]:
    """Units of a flat index space (`units[k]` is unit `ids[k]`, sorted, of units.shape[1] elements)
    regrouped into units of `width` elements: (their ids, their data, zero where nothing was given).
    Element by element: only for widths that do not tile each other."""
    size = units.shape[1]
    positions = (ids[:, None] * size + np.arange(size)).reshape(-1)
    out_ids, inverse = np.unique(positions // width, return_inverse=True)
    out = torch.zeros(out_ids.size, width, dtype=units.dtype)
    out.view(-1)[torch.from_numpy(inverse * width + positions % width)] = units.reshape(-1)
    return out_ids, out


def entries_of(coo: torch.Tensor) -> int:
    """Entries of the dense tensor a COO tensor stands for (an entry: one index of its sparse dims,
    a row of an embedding table)."""
    return math.prod(coo.shape[:coo.sparse_dim()])


def entry_width(coo: torch.Tensor) -> int:
    """Elements per entry of a COO tensor (an embedding gradient's row width)."""
    return math.prod(coo.shape[coo.sparse_dim():])


def entries_share_blocks(width: int, block_size: int) -> bool:
    """Whether entries of `width` elements and blocks of `block_size` do not tile: then a block of a
    sum holds entries no rank stored, and a result lists only the entries that hold something (on
    the sparse path and on gloo's, alike)."""
    return width % block_size != 0


def linear_entries(coo: torch.Tensor) -> torch.Tensor:
    """Row-major index of each stored entry of a coalesced COO tensor among all entries of the dense
    tensor it stands for (an entry: one index of its sparse dims)."""
    indices = coo.indices()
    linear = torch.zeros(indices.shape[1], dtype=torch.int64)
    for dim in range(coo.sparse_dim()):       # a handful of dims, not elements
        linear = linear * coo.shape[dim] + indices[dim]
    return linear


def coo_of(entries: np.ndarray, values: torch.Tensor, shape, sparse_dim: int) -> torch.Tensor:
    """A coalesced COO tensor of `shape` from its entries' row-major indices (sorted, distinct, in
    range: torch need not check them) and their values, a row each."""
    coords = np.stack(np.unravel_index(entries, shape[:sparse_dim])) if sparse_dim else \
        np.zeros((0, entries.size), dtype=np.int64)
    return torch.sparse_coo_tensor(torch.from_numpy(coords.astype(np.int64, copy=False)),
                                   values.reshape(-1, *shape[sparse_dim:]), shape,
                                   is_coalesced=True, check_invariants=False)


def holding(entries: np.ndarray, values: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """The entries that hold something. A block of several entries comes back whole, and the entries
    in it that no rank sent are zeros: kept, they would make the result list rows nobody touched
    (deeplight's 1-wide rows in blocks of 16: 12x the union's rows, each one more for the optimizer,
    and a row that SparseAdam updates where gloo's sum has none). An entry whose sum is exactly zero
    goes too. Entries share blocks only in a table too tall for the wire's block indices
    (algorithm.entry_block_size)."""
    sums = values.abs().sum(dim=1) if values.is_floating_point() else values.ne(0).sum(dim=1)
    keep = sums.ne(0).numpy()           # NaN is kept; an abs-sum that overflows is inf, kept too
    if not keep.any():
        return entries[:0], values[:0]
    # numpy's compress (of the rows' bytes): boolean indexing took 4-6x as long
    kept = np.compress(keep, values.contiguous().view(torch.uint8).numpy(), axis=0)
    return np.compress(keep, entries), torch.from_numpy(kept).view(values.dtype)


class CompactBlocks:
    """Only the non-zero blocks, packed in one host buffer (`data`, rows in index order). Results come in
    through a staging buffer and are collected; subclasses turn them into the output in `finish()`."""

    direct = False          # results arrive through a staging buffer, then `scatter`

    def __init__(self, indices: np.ndarray, data: torch.Tensor, numel: int, block_size: int):
        self.indices, self.data = indices, data
        self.dtype, self.block_size = data.dtype, block_size
        self.numel = numel
        self.nblocks = block_count(numel, block_size)
        self._results: list[tuple[np.ndarray, torch.Tensor]] = []

    def nonzero(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Indices of the present blocks in [lo, hi)."""
        hi = self.nblocks if hi is None else hi
        return self.indices[np.searchsorted(self.indices, lo):np.searchsorted(self.indices, hi)]

    def _slots(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.indices, indices)

    def rows_of(self, indices: np.ndarray) -> torch.Tensor:
        slots = self._slots(indices)
        if slots.size and slots[-1] - slots[0] + 1 == slots.size:
            return self.data[int(slots[0]):int(slots[-1]) + 1]
        return self.data.index_select(0, torch.from_numpy(slots))

    gather = rows_of

    def scatter(self, indices: np.ndarray, rows: torch.Tensor) -> None:
        """Collect a result whose rows stay the sender's (copied)."""
        self._results.append((indices.copy(), rows.clone()))

    def receive_buffer(self, count: int) -> torch.Tensor:
        """A new buffer for a result's rows, to be received into and handed to `keep`: the only
        copy a remote result takes on its way to the output is the final concatenation."""
        return torch.empty(count, self.block_size, dtype=self.dtype)

    def keep(self, indices: np.ndarray, rows: torch.Tensor) -> None:
        """Collect a result whose arrays now belong to this object (no copy)."""
        self._results.append((indices, rows))

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All result blocks in ascending index order: (indices int64, rows). Each message's blocks
        are sorted and ranges are disjoint, so ordering the messages by first index suffices."""
        chunks = sorted((c for c in self._results if c[0].size), key=lambda c: int(c[0][0]))
        if not chunks:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.block_size, dtype=self.dtype)
        return (torch.from_numpy(np.concatenate([i for i, _ in chunks])),
                torch.cat([r for _, r in chunks]))


class StagedBlocks(CompactBlocks):
    """A tensor that cannot be worked on in place (on an accelerator, or not contiguous): it is scanned
    where it lives and only its non-zero blocks are copied to the host; results are written back into
    it by `finish()`. Blocks outside the union are zero everywhere, so they need no write."""

    def __init__(self, tensor: torch.Tensor, block_size: int):
        numel = tensor.numel()
        nblocks = block_count(numel, block_size)
        padded = torch.zeros(nblocks, block_size, dtype=tensor.dtype, device=tensor.device)
        padded.view(-1)[:numel] = tensor.reshape(-1)
        indices = np.flatnonzero(nonzero_mask(padded))
        data = padded[torch.from_numpy(indices).to(tensor.device)].cpu()
        super().__init__(indices, data, numel, block_size)
        self.tensor, self.padded = tensor, padded

    def finish(self) -> torch.Tensor:
        indices, rows = self.results()
        device = self.padded.device
        self.padded.index_copy_(0, indices.to(device), rows.to(device))
        self.tensor.copy_(self.padded.view(-1)[:self.numel].view_as(self.tensor))
        return self.tensor


class SparseBlocks(CompactBlocks):
    """A sparse COO tensor (e.g. an nn.Embedding(sparse=True) gradient) as the blocks of the dense
    tensor it stands for, without ever allocating that dense tensor: the blocks its stored entries touch
    are the non-zero blocks (no scan needed). `finish()` assembles the summed blocks into a coalesced COO
    tensor of the same shape and sparse dims: every entry some rank sent when entries are whole blocks,
    and the entries that hold something when they share blocks (`holding`).

    An entry is one index of the sparse dims (a row of an embedding table) with `width` elements. When
    entries and blocks tile each other (width a multiple of the block size, or the reverse) all the
    work is per entry or per block, and the values are used as they are; otherwise it is per element."""

    def __init__(self, coo: torch.Tensor, block_size: int):
        coo = coo.coalesce()
        self.shape, self.sparse_dim = coo.shape, coo.sparse_dim()
        self.width = width = entry_width(coo)
        self.entries = entries_of(coo)              # of the dense tensor it stands for
        numel = int(np.prod(coo.shape, dtype=np.int64))
        entries = linear_entries(coo).numpy()       # ascending: coalesced entries are sorted
        values = coo.values().reshape(-1, width)
        b = block_size
        if width % b == 0:                 # each entry is width/b whole blocks
            per = width // b
            indices = (entries[:, None] * per + np.arange(per)).reshape(-1)
            data = values.reshape(-1, b)
        elif b % width == 0:               # each block holds b/width entries
            per = b // width
            indices, inverse = np.unique(entries // per, return_inverse=True)
            data = torch.zeros(indices.size, per, width, dtype=coo.dtype)
            data[torch.from_numpy(inverse), torch.from_numpy(entries % per)] = values
            data = data.view(-1, b)
        else:
            indices, data = _retile(entries, values, b)
        super().__init__(indices, data.contiguous(), numel, block_size)

    def finish(self) -> torch.Tensor:
        indices, rows = self.results()
        indices, b, width = indices.numpy(), self.block_size, self.width
        if not entries_share_blocks(width, b):      # every touched entry came back whole
            per = width // b
            entries, values = indices[::per] // per, rows.reshape(-1, width)
        else:                              # several entries share a block
            if b % width == 0:
                per = b // width
                entries = (indices[:, None] * per + np.arange(per)).reshape(-1)
                values = rows.reshape(-1, width)
            else:
                entries, values = _retile(indices, rows, width)
            entries, values = holding(entries, values)
        kept = int(np.searchsorted(entries, self.entries))    # sorted: drop the last block's padding
        return coo_of(entries[:kept], values[:kept], self.shape, self.sparse_dim)
