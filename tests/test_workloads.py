"""Tests for sparcoll.workloads: tiny models, synthetic data and file readers."""

import itertools
import math

import numpy as np
import pytest
import torch

from sparcoll.workloads import WORKLOADS, get_workload
from sparcoll.workloads.data import zipf
from sparcoll.workloads.deeplight import field_rows, read_criteo, table_ids
from sparcoll.workloads.lstm import read_text
from sparcoll.workloads.ncf import CSV_HEADER, read_movielens

NAMES = sorted(WORKLOADS)
LEARNING_RATES = {"cnn": 0.3, "deeplight": 0.1, "lstm": 1.0, "ncf": 0.5}
# Which batch tensor indexes each sparse parameter's rows.
LOOKUPS = {
    "deeplight": {"embedding.weight": lambda b: b[0], "linear.weight": lambda b: b[0]},
    "ncf": {
        "user_gmf.weight": lambda b: b[0],
        "user_mlp.weight": lambda b: b[0],
        "item_gmf.weight": lambda b: b[1],
        "item_mlp.weight": lambda b: b[1],
    },
    "lstm": {"embedding.weight": lambda b: b[0][:, :-1]},
}
SPARSE_OPTIONS = {"lstm": {"tie_weights": False}}  # a tied softmax cannot have a sparse gradient


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(name, **overrides):
    return get_workload(name, tiny=True, **overrides)


def block_density(grad: torch.Tensor, block: int = 256) -> float:
    flat = grad.detach().flatten()
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % block)])
    return (flat.view(-1, block) != 0).any(1).float().mean().item()


def test_registry():
    assert NAMES == ["cnn", "deeplight", "lstm", "ncf"]
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("nope")
    with pytest.raises(TypeError):
        get_workload("ncf", tiny=True, no_such_option=1)


@pytest.mark.parametrize("name", NAMES)
def test_loss_decreases_with_sgd(name):
    wl = tiny(name)
    held_out = wl.global_batch(10_000, 256)
    with torch.no_grad():
        before = wl.loss(wl.model, held_out).item()
    opt = torch.optim.SGD(wl.model.parameters(), lr=LEARNING_RATES[name])
    losses = []
    batch_size = 32 if name == "cnn" else 128  # bigger batches steady the cheap models' losses
    for batch in itertools.islice(wl.batches(batch_size, seed=1), 20):
        opt.zero_grad()
        loss = wl.loss(wl.model, batch)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in wl.model.parameters())
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        after = wl.loss(wl.model, held_out).item()
    assert all(math.isfinite(x) for x in losses)
    assert after < before - 0.02, (before, after)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_sparse_embeddings_give_coo_gradients(name):
    wl = tiny(name, sparse_embeddings=True, **SPARSE_OPTIONS.get(name, {}))
    assert wl.sparse_embeddings and set(wl.sparse_params) == set(LOOKUPS[name])
    batch = next(wl.batches(8))
    wl.loss(wl.model, batch).backward()
    for pname, p in wl.model.named_parameters():
        assert (p.grad.layout == torch.sparse_coo) == (pname in wl.sparse_params), pname
    torch.optim.SGD(wl.model.parameters(), lr=0.1).step()  # plain SGD accepts the COO gradients


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_dense_embedding_gradients_are_zero_outside_looked_up_rows(name):
    wl = tiny(name, **SPARSE_OPTIONS.get(name, {}))
    batch = next(wl.batches(4))
    wl.loss(wl.model, batch).backward()
    params = dict(wl.model.named_parameters())
    for pname in wl.sparse_params:
        grad = params[pname].grad
        assert grad.layout == torch.strided
        nonzero_rows = set(torch.nonzero(grad.flatten(1).any(1)).flatten().tolist())
        assert nonzero_rows <= set(LOOKUPS[name][pname](batch).flatten().tolist())
        zero_fraction = 1 - len(nonzero_rows) / grad.shape[0]
        assert zero_fraction > 0.5, f"{pname}: zero rows {zero_fraction:.2f}, block density {block_density(grad):.2f}"


def test_tied_lstm_has_dense_embedding_gradient():
    wl = tiny("lstm")
    assert wl.sparse_params == ()
    wl.loss(wl.model, next(wl.batches(4))).backward()
    assert block_density(wl.model.embedding.weight.grad) == 1.0
    with pytest.raises(ValueError, match="tie_weights=False"):
        tiny("lstm", sparse_embeddings=True)


def test_cnn_has_no_sparse_params_and_no_file_data(tmp_path):
    assert tiny("cnn").sparse_params == ()
    with pytest.raises(ValueError, match="synthetic data only"):
        tiny("cnn", data=tmp_path / "x")


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_model_and_batches(name):
    a, b, c = tiny(name, seed=3), tiny(name, seed=3), tiny(name, seed=4)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    for x, y in zip(itertools.islice(a.batches(8, seed=5), 3), itertools.islice(b.batches(8, seed=5), 3)):
        assert_batches_equal(x, y)
    first, second = itertools.islice(a.batches(8, seed=5), 2)
    other_seed = next(a.batches(8, seed=6))
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[0], other_seed[0])


@pytest.mark.parametrize("name", NAMES)
def test_ranks_slice_the_single_process_batch(name):
    wl, bs, ws = tiny(name), 4, 3
    ranks = [list(itertools.islice(wl.batches(bs, rank=r, world_size=ws, seed=7, start_step=2), 2)) for r in range(ws)]
    single = list(itertools.islice(wl.batches(bs * ws, seed=7, start_step=2), 2))
    for step in range(2):
        joined = tuple(torch.cat(parts) for parts in zip(*(ranks[r][step] for r in range(ws))))
        assert_batches_equal(joined, single[step])
        assert_batches_equal(joined, wl.global_batch(2 + step, bs, ws, seed=7))
        assert not torch.equal(ranks[0][step][0], ranks[1][step][0])
    with pytest.raises(ValueError):
        wl.batches(bs, rank=ws, world_size=ws)


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_mean_of_rank_gradients_is_single_process_gradient(name):
    wl, bs, ws = tiny(name), 4, 2
    params = list(wl.model.parameters())

    def grads(batch):
        return torch.autograd.grad(wl.loss(wl.model, batch), params)

    ranks = [grads(next(wl.batches(bs, rank=r, world_size=ws))) for r in range(ws)]
    single = grads(next(wl.batches(bs * ws)))
    for g0, g1, g in zip(*ranks, single):
        torch.testing.assert_close((g0 + g1) / 2, g)


def test_default_deeplight_has_over_10m_parameters():
    wl = get_workload("deeplight")
    assert sum(p.numel() for p in wl.model.parameters()) >= 10_000_000
    labels = wl.global_batch(0, 4096)[2]
    assert 0.15 < labels.mean().item() < 0.4  # Criteo-like click rate


def test_zipf_ranks_are_bounded_and_skewed():
    ranks = zipf(np.random.default_rng(0), 1000, 100_000, 1.1)
    assert ranks.min() == 0 and ranks.max() < 1000
    counts = np.bincount(ranks, minlength=1000)
    assert counts[0] > counts[1] > counts[3] > counts[10] > counts[100]
    exact = 1 / np.arange(1, 1001) ** 1.1
    assert abs(counts[0] / len(ranks) - exact[0] / exact.sum()) < 0.02


# --- file readers -------------------------------------------------------------

CRITEO_LINES = [
    "1\t5\t\t-3\t0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t" + "\t".join(["68fd1e64"] * 25 + [""]),
    "0\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["05db9164"] * 26),
    "0\t" + "\t".join([""] * 13) + "\t" + "\t".join([""] * 26),
]


def test_read_criteo(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(CRITEO_LINES) + "\n")
    labels, dense, raw = read_criteo(path)
    assert labels.tolist() == [1, 0, 0]
    np.testing.assert_allclose(dense[0, :4], np.log1p([5, 0, 0, 0]), rtol=1e-6)  # empty and negative -> 0
    assert raw[0, 0] == 0x68FD1E64 and raw[0, 25] == -1 and (raw[2] == -1).all()
    wl = get_workload("deeplight", data=path, tiny=True)
    rows = field_rows(wl.config)
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
    ids = table_ids(raw, rows)
    assert (ids[2] == offsets).all() and ids[0, 25] == offsets[25]  # missing -> each field's first row
    assert ((ids[:2, :25] > offsets[:25]) & (ids[:2, :25] < offsets[:25] + rows[:25])).all()
    batch_ids, batch_dense, batch_labels = wl.global_batch(0, 16)
    file_rows = {tuple(r) for r in ids.tolist()}
    assert all(tuple(r) in file_rows for r in batch_ids.tolist())
    assert set(batch_labels.tolist()) <= {0.0, 1.0} and batch_dense.shape == (16, 13)


@pytest.mark.parametrize(
    "bad, lineno, problem",
    [
        ("1\t2\t3", 2, "fields"),
        ("x" + CRITEO_LINES[1][1:], 3, "x"),
        (CRITEO_LINES[1].replace("\t1\t", "\t1.5\t", 1), 2, "1.5"),
        ("2" + CRITEO_LINES[1][1:], 3, "label"),
        (CRITEO_LINES[1].replace("05db9164", "zz", 1), 2, "zz"),
    ],
)
def test_read_criteo_rejects_malformed_lines(tmp_path, bad, lineno, problem):
    path = tmp_path / "bad.tsv"
    lines = CRITEO_LINES[:2]
    lines.insert(lineno - 1, bad)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.tsv, line {lineno}: .*{problem}"):
        read_criteo(path)


@pytest.mark.parametrize("suffix, sep, header", [(".csv", ",", CSV_HEADER + "\n"), (".dat", "::", "")])
def test_read_movielens(tmp_path, suffix, sep, header):
    rows = [(10, 500, "4.0"), (3, 7, "3.5"), (10, 7, "5"), (42, 9000, "1")]
    path = tmp_path / f"ratings{suffix}"
    path.write_text(header + "".join(f"{u}{sep}{i}{sep}{r}{sep}1112486027\n" for u, i, r in rows))
    users, items, num_users, num_items = read_movielens(path)
    assert (num_users, num_items) == (3, 3)
    assert users.tolist() == [1, 0, 1, 2] and items.tolist() == [1, 0, 0, 2]
    wl = get_workload("ncf", data=path, tiny=True)
    assert (wl.config.num_users, wl.config.num_items) == (3, 3)
    batch_users, batch_items = wl.global_batch(0, 32)
    pairs = set(zip(batch_users.tolist(), batch_items[:, 0].tolist()))
    assert pairs <= set(zip(users.tolist(), items.tolist()))
    assert batch_items.shape == (32, 1 + wl.config.num_negatives) and batch_items.max() < 3


@pytest.mark.parametrize(
    "suffix, text, lineno",
    [
        (".csv", "userId,movieId,rating,timestamp\n1,2,3.0,4\n1,2,3.0\n", 3),
        (".csv", "1,2,3.0,4\nuser,2,3.0,4\n", 2),
        (".csv", "userId,movieId\n1,2,3.0,4\n", 1),
        (".dat", "1::2::3::4\n1::2::three::4\n", 2),
        (".dat", "1,2,3.0,4\n", 1),
    ],
)
def test_read_movielens_rejects_malformed_lines(tmp_path, suffix, text, lineno):
    path = tmp_path / f"ratings{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"ratings\{suffix}, line {lineno}:"):
        read_movielens(path)


def test_read_text_and_lstm_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\nthe dog sat\n\tzebra  ")
    tokens, vocab = read_text(path, vocab_size=4)
    assert vocab == ["<unk>", "the", "sat", "cat"]
    assert tokens.tolist() == [1, 3, 2, 0, 1, 0, 1, 0, 2, 0]
    wl = get_workload("lstm", data=path, tiny=True, vocab_size=4, bptt=3)
    assert wl.config.vocab_size == 4 and wl.model.embedding.num_embeddings == 4
    (windows,) = wl.global_batch(0, 16)
    assert windows.shape == (16, 4)
    text = tokens.tolist()
    for row in windows.tolist():
        assert any(text[i : i + 4] == row for i in range(len(text) - 3))
    assert math.isfinite(wl.loss(wl.model, (windows,)).item())
    with pytest.raises(ValueError, match="corpus.txt"):
        get_workload("lstm", data=path, tiny=True, bptt=20)
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(ValueError, match="empty.txt"):
        read_text(tmp_path / "empty.txt", 10)
