"""The block view of a tensor: scan, runs, gather/scatter and the padded last block."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from unittest import mock

from sparcoll import blocks
from sparcoll.blocks import BlockTensor, SparseBlocks, nonzero_mask, runs

CHUNK = 64      # the scan's rows per reduceat in these tests: its chunk edges in small tensors
FLAGGED = 16    # rows of at most 8 words flagged at a time in these tests: their edges inside a chunk


@pytest.mark.parametrize("width", [8, 9, 10, 12, 256])    # rows that 8, 4 or 2-byte words tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_scan_matches_elementwise_definition(dtype, width):
    g = torch.Generator().manual_seed(0)
    rows = torch.zeros(CHUNK * 2 + 17, width, dtype=dtype)
    picks = torch.randint(0, rows.numel(), (200,), generator=g)
    rows.view(-1)[picks] = torch.randn(200, generator=g).to(dtype)
    rows[3:10] = 0
    rows[3, 2] = -0.0                       # -0.0 alone: a zero block
    rows[5, 1], rows[7, 7] = float("nan"), float("-inf")
    rows[9, 0] = torch.finfo(dtype).tiny / 4 if dtype != torch.bfloat16 else 1e-40   # subnormal
    rows[CHUNK, 0] = rows[CHUNK * 2 + 16, width - 1] = 1.0     # a chunk's first row, the last
    expected = (rows.double() != 0).any(1) | rows.double().isnan().any(1)
    with mock.patch.multiple(blocks, SCAN_ROWS=CHUNK, FLAG_ROWS=FLAGGED):
        mask = nonzero_mask(rows)
    assert np.array_equal(mask, expected.numpy())
    assert not mask[3] and mask[5] and mask[7] and mask[CHUNK] and mask[-1]
    assert np.array_equal(nonzero_mask(rows), mask)         # in one chunk


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 * CHUNK + 3), st.integers(1, 20), st.data())
def test_scan_of_any_shape(nrows, width, data):
    """Every row count and width, including chunk edges and widths that no word size tiles."""
    rows = torch.zeros(nrows, width)
    if rows.numel():
        picks = data.draw(st.lists(st.integers(0, rows.numel() - 1), max_size=30))
        values = data.draw(st.lists(st.sampled_from([1.0, -2.5, -0.0, float("nan"), 1e-45]),
                                    min_size=len(picks), max_size=len(picks)))
        rows.view(-1)[torch.tensor(picks, dtype=torch.int64)] = torch.tensor(values)
    expected = (rows != 0).any(1) | rows.isnan().any(1)
    with mock.patch.multiple(blocks, SCAN_ROWS=CHUNK, FLAG_ROWS=FLAGGED):
        assert np.array_equal(nonzero_mask(rows), expected.numpy())


NARROW = dict(SCAN_ROWS=CHUNK, COARSE_BYTES=512, SAMPLE_GROUPS=4, FLAG_ROWS=FLAGGED)   # groups of 8 to 32 rows here


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([4, 8, 16]), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       st.lists(st.tuples(st.integers(1, 150), st.sampled_from([0, 0.01, 0.1, 0.5, 1])), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_scan_of_narrow_rows_in_groups(width, dtype, segments, seed):
    """Narrow rows scanned in groups first, then row by row inside the groups that hold something,
    or row by row at once where most groups do: stretches of different densities, so that chunks
    switch between the two, against the elementwise definition."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for nrows, density in segments:
        part = torch.zeros(nrows, width, dtype=dtype)
        hit = torch.rand(nrows, generator=g) < density
        values = torch.tensor([1.0, -0.0, float("nan"), torch.finfo(dtype).tiny / 2], dtype=dtype)
        part[hit, torch.randint(0, width, (int(hit.sum()),), generator=g)] = \
            values[torch.randint(0, 4, (int(hit.sum()),), generator=g)]
        parts.append(part)
    rows = torch.cat(parts)
    expected = (rows.double() != 0).any(1) | rows.double().isnan().any(1)
    with mock.patch.multiple(blocks, **NARROW):
        assert np.array_equal(nonzero_mask(rows), expected.numpy())


@pytest.mark.parametrize("every, grouped", [(CHUNK * 3 + 5, True), (1, False)])
def test_narrow_rows_are_scanned_in_groups_only_where_sparse(every, grouped):
    """Sparse narrow rows take the grouped scan in every chunk; dense ones never (the sample says
    so before the first chunk), and rows of 64 floats never (nothing to gain)."""
    rows, wide = torch.zeros(CHUNK * 40, 8), torch.zeros(CHUNK * 40, 64)
    rows[::every, 3] = wide[::every, 3] = 1.0
    with mock.patch.multiple(blocks, **NARROW), \
            mock.patch.object(blocks, "_scan_groups", wraps=blocks._scan_groups) as grouped_scan:
        mask = nonzero_mask(rows)
        assert grouped_scan.call_count == (40 if grouped else 0)
        assert np.array_equal(nonzero_mask(wide), (wide != 0).any(1).numpy())
        assert grouped_scan.call_count == (40 if grouped else 0)
    assert np.array_equal(mask, (rows != 0).any(1).numpy())


@pytest.mark.parametrize("dtype, width, flagged", [(torch.float32, 16, True), (torch.float16, 4, True),
                                                    (torch.float32, 10, False), (torch.float32, 64, False)])
def test_rows_of_at_most_eight_words_are_flagged_word_by_word(dtype, width, flagged):
    """Rows of 1, 2, 4 or 8 words take the word-by-word path (its correctness is the tests above);
    rows of 5 words, and wide ones, reduceat's."""
    rows = torch.zeros(CHUNK * 3 + 5, width, dtype=dtype)
    rows[::7, width - 1] = 1.0
    with mock.patch.multiple(blocks, SCAN_ROWS=CHUNK, FLAG_ROWS=FLAGGED), \
            mock.patch.object(blocks, "_flag_rows", wraps=blocks._flag_rows) as flag_rows:
        mask = nonzero_mask(rows)
    assert flag_rows.called == flagged
    assert np.array_equal(mask, (rows != 0).any(1).numpy())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True, max_size=40), st.integers(1, 8))
def test_runs_cover_exactly_the_indices(values, limit):
    indices = np.array(sorted(values), dtype=np.int64)
    spans = runs(indices, limit)
    covered = [i for start, stop in (spans or []) for i in range(start, stop)]
    if spans is None:
        assert len(np.flatnonzero(np.diff(indices) != 1)) + 1 > limit
    else:
        assert covered == indices.tolist() and len(spans) <= max(limit, 1)


@pytest.mark.parametrize("numel", [0, 5, 16, 21])
def test_padded_last_block_round_trip(numel):
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    bt = BlockTensor(flat, 8)
    assert bt.nblocks == -(-numel // 8)
    everything = np.arange(bt.nblocks)
    assert np.array_equal(bt.nonzero(), everything)
    gathered = bt.gather(everything)
    assert torch.equal(gathered.reshape(-1)[:numel], flat)
    bt.scatter(everything, gathered * 2)
    bt.finish()
    assert torch.equal(flat, 2 * torch.arange(1, numel + 1, dtype=torch.float32))
    views = bt.views(0, bt.nblocks)
    assert sum(v.numel() for v in views) == bt.nblocks * 8


@pytest.mark.parametrize("shape, entries", [((40, 256), 10), ((10, 512), 4), ((7, 64), 3),
                                            ((1000, 3), 50), ((333, 7), 50), ((50, 600), 7),
                                            ((6, 5, 4), 9), ((300,), 20)])
def test_sparse_blocks_round_trip_every_tiling(shape, entries):
    """Rows wider than, narrower than, or not tiling the block; several sparse dims; 1-D COO."""
    g = torch.Generator().manual_seed(sum(shape))
    sparse_dims = 2 if len(shape) == 3 else 1
    coords = torch.stack([torch.randint(0, shape[d], (entries,), generator=g) for d in range(sparse_dims)])
    coo = torch.sparse_coo_tensor(coords, torch.randint(-3, 4, (entries, *shape[sparse_dims:]),
                                                        generator=g).float(), shape,
                                  check_invariants=True)
    sb = SparseBlocks(coo, 256)
    dense = torch.zeros(sb.nblocks * 256)
    dense[:coo.numel()] = coo.to_dense().reshape(-1)
    assert torch.equal(dense.view(-1, 256)[torch.from_numpy(sb.indices)], sb.data)
    assert not dense.view(-1, 256)[torch.from_numpy(np.setdiff1d(np.arange(sb.nblocks),
                                                                 sb.indices))].any()
    halves = np.array_split(np.arange(sb.indices.size), 2)[::-1]      # results in any order
    for part in halves:
        sb.scatter(sb.indices[part], sb.data[torch.from_numpy(part)])
    out = sb.finish()
    assert out.is_coalesced() and out.shape == coo.shape and out.sparse_dim() == sparse_dims
    assert torch.equal(out.to_dense(), coo.to_dense())
    # the rows stored, as gloo's sum lists them; where rows share a block, the untouched ones that
    # come back as zeros are not listed, nor rows that sum to zero
    stored = coo.coalesce()
    width = math.prod(shape[sparse_dims:])
    holding = stored.values().reshape(stored._nnz(), width).ne(0).any(dim=1)
    want = stored.indices() if width % 256 == 0 else stored.indices()[:, holding]
    assert torch.equal(out.indices(), want)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.sampled_from([1, 2, 4, 6, 8, 12, 32]), st.integers(0, 12)),
                min_size=1, max_size=4), st.booleans(), st.integers(0, 2**16))
def test_coo_tensors_concatenated_sum_and_split_as_each_alone(tables, two_sparse_dims, seed):
    """COO gradients of different entry widths (and one of two sparse dims) as one COO tensor, as
    DataParallel sends a plan's unit of them: the sum over two ranks of their concatenations, split,
    is each one's own dense sum; and the concatenation's blocks of its piece width hold exactly their
    entries."""
    from sparcoll.torch.sparse import concatenate, split
    g = torch.Generator().manual_seed(seed)
    shapes = [((rows, width), n) for rows, width, n in tables] + ([((6, 5, 4), 9)] if two_sparse_dims else [])

    def one_rank() -> list:
        out = []
        for shape, n in shapes:
            sparse_dims = len(shape) - 1
            coords = torch.stack([torch.randint(0, shape[d], (n,), generator=g) for d in range(sparse_dims)])
            out.append(torch.sparse_coo_tensor(coords, torch.randn(n, shape[-1], generator=g), shape,
                                               check_invariants=True).coalesce())
        return out
    a, b = one_rank(), one_rank()
    fused = concatenate(a)
    assert fused.is_coalesced() and fused._nnz() * fused.shape[1] == sum(x._nnz() * x.shape[-1] for x in a)
    assert torch.equal(fused.to_dense().reshape(-1), torch.cat([x.to_dense().reshape(-1) for x in a]))
    got = split((fused + concatenate(b)).coalesce(), a)
    for x, y, z in zip(a, b, got):
        assert z.is_coalesced() and z.shape == x.shape and z.sparse_dim() == x.sparse_dim()
        assert torch.allclose(z.to_dense(), x.to_dense() + y.to_dense())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_sparse_blocks_list_no_row_whose_sum_is_zero(dtype):
    """Rows of 4 share blocks of 16: rows whose sums cancel to zero are not listed, down to none."""
    coo = torch.sparse_coo_tensor(torch.tensor([[1, 2, 5, 9]]), torch.arange(1, 17).view(4, 4).to(dtype), (12, 4),
                                  check_invariants=True)
    for scale, listed in ((0, []), (1, [1, 2, 5, 9])):
        sb = SparseBlocks(coo, 16)
        sums = sb.data * scale
        sums[0, 8:12] = 0               # row 2's sum cancels
        sb.scatter(sb.indices, sums)
        out = sb.finish()
        assert out.dtype == dtype and out.indices()[0].tolist() == [r for r in listed if r != 2]
        assert out.values().shape == (len(out.indices()[0]), 4)
        assert torch.equal(out.to_dense(), (coo.to_dense() * scale).index_fill(0, torch.tensor([2]), 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sparse_blocks_list_rows_that_hold_nan_or_inf(dtype):
    """A row whose sum is NaN or infinite holds something, as in gloo's sum: it is listed, with its
    values, beside the ordinary rows (a filter on positive abs-sums dropped them silently: a
    mutation review)."""
    coo = torch.sparse_coo_tensor(torch.tensor([[1, 2, 5, 9]]), torch.arange(1, 17).view(4, 4).to(dtype),
                                  (12, 4), check_invariants=True)
    sb = SparseBlocks(coo, 16)
    sums = sb.data.clone()
    sums[0, 8] = float("nan")           # row 2
    sums[1, 4] = float("-inf")          # row 5
    sb.scatter(sb.indices, sums)
    out = sb.finish()
    assert out.indices()[0].tolist() == [1, 2, 5, 9]
    expected = coo.to_dense()
    expected[2, 0], expected[5, 0] = float("nan"), float("-inf")
    torch.testing.assert_close(out.to_dense(), expected, equal_nan=True, rtol=0, atol=0)


def _shares_memory(t: torch.Tensor) -> bool:
    """The truth by enumeration: whether two of t's elements sit at the same storage offset."""
    offsets = np.tensordot(np.indices(t.shape).reshape(t.dim(), -1).T, np.array(t.stride()), axes=1) \
        if t.dim() else np.zeros(1, dtype=np.int64)
    return len(np.unique(offsets)) < t.numel()


@st.composite
def _views(draw):
    """A view of a contiguous tensor by slices with steps, narrowings, transposes and permutes."""
    shape = draw(st.lists(st.integers(2, 9), min_size=2, max_size=4))
    t = torch.zeros(shape)
    for kind in draw(st.lists(st.sampled_from(["slice", "narrow", "transpose", "permute"]), min_size=1, max_size=6)):
        dim = draw(st.integers(0, t.dim() - 1))
        if kind == "slice":
            start = draw(st.integers(0, min(2, t.shape[dim] - 1)))     # non-empty: an empty view is trivially fine
            stop = draw(st.one_of(st.none(), st.integers(start + 1, t.shape[dim])))
            index = [slice(None)] * t.dim()
            index[dim] = slice(start, stop, draw(st.integers(1, 4)))
            t = t[tuple(index)]
        elif kind == "narrow":
            start = draw(st.integers(0, t.shape[dim] - 1))
            t = t.narrow(dim, start, draw(st.integers(1, t.shape[dim] - start)))
        elif kind == "transpose":
            t = t.transpose(dim, draw(st.integers(0, t.dim() - 1)))
        else:
            t = t.permute(draw(st.permutations(range(t.dim()))))
    return t


@settings(max_examples=300, deadline=None)
@given(_views())
@example(torch.zeros(10, 5)[:, ::2])
@example(torch.zeros(4, 6, 7)[1:, ::4, ::3].permute(2, 0, 1))
def test_views_of_distinct_elements_may_be_reduced_in_place(view):
    """Slices with steps (e.g. [:, ::2], strides (5, 2) of a (10, 5) tensor), narrowings, transposes
    and permutes never share memory, so the in-place results can land in them."""
    assert not _shares_memory(view)
    assert not blocks.may_overlap(view)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=4))
def test_strided_views_that_share_memory_are_refused(dims):
    """Any as_strided layout whose elements really overlap is refused (the check may refuse more)."""
    view = torch.zeros(2000).as_strided([n for n, _ in dims], [s for _, s in dims])
    if _shares_memory(view):
        assert blocks.may_overlap(view)


@pytest.mark.parametrize("shape, strides, overlaps", [
    ((10, 3), (5, 2), False),          # [:, ::2] of a (10, 5) tensor
    ((3, 10), (2, 5), False),          # ... transposed
    ((4, 3), (0, 1), True),            # expand()
    ((2, 2), (1, 1), True),            # offsets 0 1 1 2
    ((2, 2, 2), (3, 2, 1), True),      # each stride steps past the one below alone, not past both
    ((2, 2, 2), (4, 2, 1), False),
])
def test_overlap_of_known_layouts(shape, strides, overlaps):
    view = torch.zeros(100).as_strided(shape, strides)
    assert _shares_memory(view) == overlaps and blocks.may_overlap(view) == overlaps
