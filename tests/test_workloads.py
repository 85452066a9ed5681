"""Tests for sparcoll.workloads: tiny models, synthetic data and file readers."""

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from sparcoll.workloads import WORKLOADS, get_workload, gpt, vgg
from sparcoll.workloads.data import zipf
from sparcoll.workloads.deeplight import field_rows, read_criteo, table_ids
from sparcoll.workloads.lstm import read_text
from sparcoll.workloads.ncf import CSV_HEADER, read_movielens
from sparcoll.workloads.user import UserModel

NAMES = sorted(WORKLOADS)
LEARNING_RATES = {"cnn": 0.3, "deeplight": 0.1, "gpt": 0.3, "lstm": 1.0, "narrowrec": 0.5, "ncf": 0.5, "vgg": 0.1}
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
    "gpt": {"embedding.weight": lambda b: b[0][:, :-1]},
    "narrowrec": {"tables.0.weight": lambda b: b[0][:, 0], "tables.1.weight": lambda b: b[0][:, 1]},
}
# A tied softmax cannot have a sparse gradient.
SPARSE_OPTIONS = {"lstm": {"tie_weights": False}, "gpt": {"tie_weights": False}}
# Every workload whose distributed gradient equals the single-process one (cnn's BatchNorm does not).
EXACT = [name for name in NAMES if name != "cnn"]


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
    assert NAMES == ["cnn", "deeplight", "gpt", "lstm", "narrowrec", "ncf", "vgg"]
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


@pytest.mark.parametrize("name", ["gpt", "lstm"])
def test_tied_softmax_has_dense_embedding_gradient(name):
    wl = tiny(name)
    assert wl.sparse_params == ()
    wl.loss(wl.model, next(wl.batches(4))).backward()
    assert block_density(wl.model.embedding.weight.grad) == 1.0
    with pytest.raises(ValueError, match="tie_weights=False"):
        tiny(name, sparse_embeddings=True)


@pytest.mark.parametrize("name", ["cnn", "narrowrec"])
def test_synthetic_only_workloads_reject_files(name, tmp_path):
    with pytest.raises(ValueError, match="synthetic data only"):
        tiny(name, data=tmp_path / "x")


@pytest.mark.parametrize("name", ["cnn", "vgg"])
def test_dense_models_have_no_sparse_params(name):
    assert tiny(name).sparse_params == ()


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


@pytest.mark.parametrize("name", EXACT)
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


# --- vgg, gpt, narrowrec ------------------------------------------------------


def test_vgg_is_poseidons_vgg19_22k_head():
    cfg = vgg.Config()
    with torch.device("meta"):  # shapes only: the real model is 836 MB
        head = vgg.ClassifierHead(cfg)
    shapes = [tuple(p.shape) for p in head.parameters()]
    assert shapes == [(4096, 25088), (4096,), (4096, 4096), (4096,), (21841, 4096), (21841,)]
    assert 209_000_000 < sum(p.numel() for p in head.parameters()) < 209_300_000
    assert cfg.dropout == 0.5


def test_vgg_batches_and_dropout():
    wl = tiny("vgg")
    cfg = wl.config
    features, labels, keep = wl.global_batch(0, 512)
    assert features.shape == (512, cfg.input_dim) and features.dtype == torch.float32
    assert labels.shape == (512,) and 0 <= labels.min() and labels.max() < cfg.num_classes
    assert keep.shape == (512, sum(cfg.hidden)) and keep.dtype == torch.bool
    assert 0.45 < keep.float().mean().item() < 0.55  # 16384 draws of p=0.5: 6 standard deviations
    torch.testing.assert_close(features.square().mean(1), torch.ones(512))
    assert (labels == 0).float().mean() > (labels == cfg.num_classes - 1).float().mean()  # Zipf classes
    with torch.no_grad():
        dropped = wl.model(features, keep)
        wl.model.eval()
        assert torch.equal(wl.model(features, keep), wl.model(features))  # eval mode: no dropout
        wl.model.train()
    assert not torch.equal(dropped, wl.model(features).detach())
    with pytest.raises(ValueError, match="dropout"):
        tiny("vgg", dropout=1.0)


def test_vgg_reads_npz_features(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "features.npz"
    np.savez(path, features=rng.standard_normal((20, 12)), labels=rng.integers(0, 15, 20))
    wl = get_workload("vgg", data=path, tiny=True)
    assert wl.config.input_dim == 12 and wl.config.num_classes == 15
    features, labels, _ = wl.global_batch(0, 32)
    file_rows = {tuple(np.float32(row).tolist()) for row in np.load(path)["features"]}
    assert all(tuple(row) in file_rows for row in features.tolist())
    assert math.isfinite(wl.loss(wl.model, (features, labels, wl.global_batch(0, 32)[2])).item())
    np.savez(tmp_path / "bad.npz", features=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="bad.npz: missing array"):
        get_workload("vgg", data=tmp_path / "bad.npz", tiny=True)
    np.savez(tmp_path / "neg.npz", features=np.zeros((3, 4)), labels=np.array([0, -1, 2]))
    with pytest.raises(ValueError, match="non-negative"):
        get_workload("vgg", data=tmp_path / "neg.npz", tiny=True)
    np.save(tmp_path / "one.npy", np.zeros((3, 4)))          # before: a TypeError about a context manager
    with pytest.raises(ValueError, match="one.npy: holds one array .*; expected an .npz archive"):
        get_workload("vgg", data=tmp_path / "one.npy", tiny=True)
    (tmp_path / "text.csv").write_text("features,labels\n1,2\n")   # before: numpy's words, no path
    with pytest.raises(ValueError, match="text.csv: not an .npz archive"):
        get_workload("vgg", data=tmp_path / "text.csv", tiny=True)


def test_gpt_tokenizer_round_trip():
    text = gpt.pydoc_text()
    tokenizer = gpt.WordTokenizer.build(text[:50_000], vocab_size=2000)
    assert len(tokenizer) == 2000
    for sample in (text[100_000:120_000], "naïve café ☃\n\t  x  \n\n", "", " leading and trailing  "):
        ids = tokenizer.encode(sample)
        assert ids.dtype == np.int64 and (ids < len(tokenizer)).all()
        assert tokenizer.decode(ids) == sample
    ids = tokenizer.encode(" the")
    assert len(ids) == 1 and ids[0] >= 256  # a frequent word is one token, with its leading space
    with pytest.raises(ValueError, match="256"):
        gpt.WordTokenizer.build(text, 100)


def test_gpt_default_vocabulary_and_held_out_split():
    wl = get_workload("gpt")
    assert 8_000 <= wl.config.vocab_size <= 32_000
    assert wl.model.decoder.weight is wl.model.embedding.weight
    train, held_out = gpt.split_text(gpt.pydoc_text(), wl.config.eval_fraction)
    assert train + held_out == gpt.pydoc_text() and held_out.startswith("\n")
    assert 0.09 < len(held_out) / (len(train) + len(held_out)) < 0.11
    # Lossless encoding of disjoint splits: the training split decodes to exactly the text before the cut.
    assert wl.tokenizer.decode(wl.train_tokens) == train and wl.tokenizer.decode(wl.eval_tokens) == held_out
    window = wl.config.seq_len + 1
    (windows,) = wl.eval_batch()
    assert windows.shape == (len(wl.eval_tokens) // window, window)
    assert torch.equal(windows.flatten(), torch.from_numpy(wl.eval_tokens[: windows.numel()]))
    assert wl.eval_batch(3)[0].shape == (3, window)


def test_gpt_text_file_trains_tokenizer_on_the_training_split_only(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 20 + "zebras graze\n" * 3)
    wl = get_workload("gpt", data=path, tiny=True, eval_fraction=0.1)
    assert " zebras" not in wl.tokenizer.pieces and " cat" in wl.tokenizer.pieces
    assert wl.config.vocab_size == len(wl.tokenizer) == wl.model.embedding.num_embeddings
    train = wl.tokenizer.decode(wl.train_tokens)
    (windows,) = wl.global_batch(0, 16)
    assert all(wl.tokenizer.decode(row) in train for row in windows)
    assert math.isfinite(wl.eval_loss())
    with pytest.raises(ValueError, match="corpus.txt: held-out split"):
        get_workload("gpt", data=path, tiny=True, seq_len=len(wl.eval_tokens))


def test_narrowrec_default_tables_get_narrow_coo_rows():
    wl = get_workload("narrowrec", sparse_embeddings=True)
    assert [p.shape for p in (wl.model.tables[0].weight, wl.model.tables[1].weight)] == [(1_000_000, 32)] * 2
    ids, labels = wl.global_batch(0, 256)
    assert 0.1 < labels.mean().item() < 0.9
    wl.loss(wl.model, (ids, labels)).backward()
    for i, table in enumerate(wl.model.tables):
        grad = table.weight.grad.coalesce()
        assert grad.layout == torch.sparse_coo and grad.values().shape[1] == 32
        assert set(grad.indices()[0].tolist()) == set(ids[:, i].tolist())
        assert grad.indices().shape[1] < 256  # Zipf: popular ids repeat within a batch
    assert get_workload("narrowrec", tiny=True, embedding_dim=16).model.tables[0].embedding_dim == 16


def test_a_users_model_trains_on_its_example_input(tmp_path, monkeypatch):
    """`--model MODULE:FUNCTION` as a workload: the loss is a scalar output itself, else the output's
    sum, on the function's input every step (a tuple is the model's positional arguments)."""
    (tmp_path / "users_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Pair(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)\n"
        "    def forward(self, x, y):\n        return (self.a(x) * self.b(y)).mean()\n\n"
        "def pair():\n    torch.manual_seed(1)\n    return Pair(), (torch.randn(5, 3), torch.randn(5, 4))\n\n"
        "def linear():\n    torch.manual_seed(2)\n    return nn.Linear(3, 2), torch.randn(6, 3)\n\n"
        "def wrong():\n    return 'not a model'\n\n"
        "class Keyed(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(3, 4)\n"
        "    def forward(self, x, labels):\n"
        "        logits = self.a(x)\n"
        "        return {'loss': nn.functional.cross_entropy(logits, labels), 'logits': logits}\n\n"
        "def keyed():\n    torch.manual_seed(3)\n"
        "    return Keyed(), {'labels': torch.tensor([0, 3, 1]), 'x': torch.randn(3, 3)}\n\n"
        "class Nested(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(3, 2)\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        return h, [h.argmax(1), {'r': h.relu(), 's': (h.relu(),)}]\n\n"
        "def nested():\n    torch.manual_seed(4)\n    return Nested(), torch.randn(5, 3)\n\n"
        "from collections import UserDict\n\n"
        "def encoded():\n    model, batch = keyed()\n    return model, UserDict(batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wl = UserModel("users_models:pair")
    x, y = wl.batch
    first, second = itertools.islice(wl.batches(8, 1, 2, 0), 2)
    assert first is wl.batch and second is wl.batch
    assert wl.loss(wl.model, first).item() == pytest.approx((wl.model.a(x) * wl.model.b(y)).mean().item(), abs=0)
    wl = UserModel("users_models:linear")
    (x,) = wl.batch
    assert wl.loss(wl.model, wl.batch).item() == pytest.approx((x @ wl.model.weight.T + wl.model.bias).sum().item(),
                                                              rel=1e-6)
    # keyword arguments (a dict, as a tokenizer gives them); a dict with a scalar "loss" (as Hugging Face
    # models return given labels); else the sum of every floating-point tensor returned, at any depth
    wl = UserModel("users_models:keyed")
    x, labels = wl.batch[0]["x"], wl.batch[0]["labels"]
    model = wl.model
    assert wl.loss(model, wl.batch).item() == pytest.approx(
        nn.functional.cross_entropy(model.a(x), labels).item(), abs=0)
    wl = UserModel("users_models:nested")
    (x,) = wl.batch
    assert wl.loss(wl.model, wl.batch).item() == pytest.approx(
        (wl.model.a(x).sum() + 2 * wl.model.a(x).relu().sum()).item(), rel=1e-6)
    assert UserModel("users_models:nested").loss(wl.model, wl.batch).requires_grad
    wl = UserModel("users_models:encoded")      # a mapping that is no dict, as a tokenizer's BatchEncoding
    assert wl.keywords and wl.loss(wl.model, wl.batch).item() == pytest.approx(
        nn.functional.cross_entropy(wl.model.a(wl.batch[0]["x"]), wl.batch[0]["labels"]).item(), abs=0)
    with pytest.raises(ValueError, match="expected MODULE:FUNCTION"):
        UserModel("users_models")
    with pytest.raises(ValueError, match="has no function nope"):
        UserModel("users_models:nope")
    with pytest.raises(ValueError, match=r"must return \(nn.Module, example input\), got str"):
        UserModel("users_models:wrong")
