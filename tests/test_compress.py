"""sparcoll.compress in one process (a world of 1): specs, each compressor's round trip against its
documented error bound, unbiasedness, the error-feedback invariant, empty and sparse input."""
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparcoll.compress as sc
from sparcoll.compress import bits

SPECS = ["none", "fp16", "bf16", "topk:0.1", "randomk:0.1", "threshold:1.0", "dgc:0.1", "qsgd:16",
         "terngrad", "signsgd", "efsignsgd", "onebit", "powersgd:2", "blocktopk:0.25"]


def data(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def unpacked(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of one packed plane as bools: numpy's own decoder, the reference."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).view(np.bool_))


def round_trip(spec, x):
    """decompress(compress(x)) without error feedback: what one rank alone would apply."""
    return sc.Reducer(sc.parse(spec + ",ef=off") if "ef=" not in spec else spec).reduce(x, key="t")


# ---- specs ---------------------------------------------------------------------------------------

def test_specs_parse_and_print_back():
    assert sc.parse("topk:0.01") == sc.Spec("topk", 0.01, True, {})
    assert sc.parse("TopK:0.5, ef=off") == sc.Spec("topk", 0.5, False, {})
    assert sc.parse("qsgd:127").arg == 127 and not sc.parse("qsgd:127").ef
    assert sc.parse("randomk:0.1,seed=7").options == {"seed": 7}
    assert sc.parse("dgc:0.01,momentum=0").options == {"momentum": 0.0}
    assert sc.parse("topk:0.01:ef=off") == sc.parse("topk:0.01,ef=off")        # fits in CSV lists
    assert sc.parse("signsgd:ef=on") == sc.parse("signsgd,ef=on")
    # an option spelled out at its default is the same spec, printed alike (ranks compare them so)
    for short, spelled in (("randomk:0.1", "randomk:0.1,seed=0"), ("dgc:0.1", "dgc:0.1,momentum=0.9"),
                           ("powersgd:2", "powersgd:2,seed=0"), ("topk:0.1", "topk:0.10,ef=on")):
        assert sc.parse(short) == sc.parse(spelled) and str(sc.parse(spelled)) == short, spelled
    for spec in SPECS + ["topk:0.5,ef=off", "qsgd:4,ef=on", "powersgd:4,seed=3"]:
        assert sc.parse(str(sc.parse(spec))) == sc.parse(spec)
        assert type(sc.make(spec)).__name__ in repr(sc.make(spec))


def test_usage_names_every_form():
    assert all(name in sc.usage() for name in sc.KINDS) and "topk:RATIO" in sc.usage()


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown compressor 'zip'"),
    ("topk", "needs RATIO"),
    ("topk:", "needs RATIO"),
    ("topk:0", "ratio must be in"),
    ("topk:1.5", "ratio must be in"),
    ("topk:abc", "bad RATIO 'abc'"),
    ("threshold:-1", "positive"),
    ("qsgd:0", r"\[1, 32767\]"),
    ("qsgd:2.5", "bad LEVELS"),
    ("powersgd:0", "bad RANK"),
    ("fp16:3", "takes no argument"),
    ("topk:0.1,ef=maybe", "ef must be 'on' or 'off'"),
    ("topk:0.1:0.2", "expected KEY=VALUE"),
    ("signsgd:ef=on:3", "expected KEY=VALUE"),
    ("topk:0.1,seed=3", "option 'seed' does not apply to 'topk'"),
    ("topk:0.1,off", "expected KEY=VALUE"),
    ("randomk:0.1,seed=x", "bad seed"),
    ("dgc:0.1,momentum=nan", r"bad momentum 'nan'.*\[0, 1\)"),
    ("dgc:0.1,momentum=-5", r"momentum must be a number in \[0, 1\), got -5"),
    ("dgc:0.1,momentum=2", r"momentum must be a number in \[0, 1\)"),
    ("dgc:0.1,momentum=1", r"momentum must be a number in \[0, 1\)"),
    ("dgc:0.1,momentum=inf", r"momentum must be a number in \[0, 1\)"),
    ("dgc:0.1,momentum=fast", "bad momentum 'fast'"),
    ("dgc:0.1,ef=off,momentum=0.5", "dgc's momentum correction is its error feedback"),   # was parsed, then dropped
    ("dgc:0.1,ef=off", "with ef=off it would be topk without momentum anywhere"),    # a review
    ("topk:0.01,ef=off,ef=on", "option 'ef' is given twice"),      # the last won (a review)
    ("randomk:0.1,seed=1,seed=2", "option 'seed' is given twice"),
    (3, "a compressor spec is a string"),
])
def test_bad_specs_raise_value_errors_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        sc.make(spec)


# ---- round trips against documented bounds ---------------------------------------------------------

def test_casts():
    x = data(5000)
    assert torch.equal(round_trip("none", x), x)
    assert ((round_trip("fp16", x) - x).abs() <= x.abs() * 2 ** -11 + 2 ** -24).all()
    assert ((round_trip("bf16", x) - x).abs() <= x.abs() * 2 ** -8).all()


def test_topk_keeps_the_k_largest_exactly():
    x = data(1000)
    y = round_trip("topk:0.05", x)
    kept = y != 0
    assert kept.sum() == 50 and torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[~kept].abs().max()


@pytest.mark.parametrize("ratio, numel, k", [(0.1, 15, 2), (0.01, 15, 1), (0.34, 3, 2), (1.0, 7, 7)])
def test_topk_keeps_ratio_times_numel_rounded_up(ratio, numel, k):
    x = data(numel)
    y = round_trip(f"topk:{ratio}", x)
    kept = y != 0
    assert int(kept.sum()) == k and torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= torch.cat([x[~kept].abs(), torch.zeros(1)]).max()


@pytest.mark.parametrize("spec", ["blocktopk:0.25", "topk:0.1", "dgc:0.1", "threshold:0.5"])
@pytest.mark.parametrize("special", [float("nan"), float("inf")])
def test_a_nan_or_inf_in_a_gradient_is_sent(spec, special):
    """As in gloo's sum, a non-finite gradient reaches the result (NaN checks and GradScaler see it);
    blocktopk dropped a NaN block's norm with the empty ones and kept it in its residual for good."""
    x = data(64 * 16)
    x[100] = special
    y = sc.Reducer(spec).reduce(x, key="t")
    assert y[100].isnan() if special != special else y[100] == special


def test_topk_on_large_tensors_is_exact():
    """Above 100k elements topk searches among the elements over a sampled threshold."""
    n = 300_000
    g = torch.Generator().manual_seed(5)
    x = (torch.randperm(n, generator=g) + 1.0) * (torch.randint(2, (n,), generator=g) * 2 - 1)  # no ties
    for ratio in (0.001, 0.01, 0.1):
        idx, vals = sc.make(f"topk:{ratio}").compress(x).parts
        k = math.ceil(ratio * n)
        assert set(idx.tolist()) == set(x.abs().topk(k).indices.tolist())
        assert torch.equal(vals, x[idx.long()])
    spiky = torch.zeros(n)
    spiky[::1000] = torch.arange(1.0, 301.0)                # fewer non-zeros than k
    assert sc.make("topk:0.01").compress(spiky).parts[0].numel() == 300


def test_threshold_error_is_at_most_the_threshold():
    x = data(1000)
    y = round_trip("threshold:0.8", x)
    assert ((y - x).abs() <= 0.8).all()
    assert torch.equal(y[x.abs() > 0.8], x[x.abs() > 0.8])


def test_dgc_sends_at_most_k_exact_values_near_the_top():
    x = data(10000)
    y = sc.Reducer("dgc:0.01").reduce(x, key="t")      # a first step: its velocity and residual are x
    kept = y != 0
    assert 0 < kept.sum() <= 100 and torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x.abs().quantile(0.95)       # a sampled threshold, near the top 1%


def test_randomk_with_feedback_sends_k_unscaled_values():
    x = data(1000)
    y = sc.Reducer("randomk:0.05").reduce(x, key="t")
    kept = y != 0
    assert 0 < kept.sum() <= 50 and torch.equal(y[kept], x[kept])


def test_qsgd_error_is_at_most_norm_over_levels():
    x = data(2000)
    for levels in (1, 16, 300):
        assert ((round_trip(f"qsgd:{levels}", x) - x).abs() <= x.norm() / levels * (1 + 1e-5)).all()


def test_qsgd_keeps_a_lone_element_exactly_at_the_top_level():
    x = torch.tensor([0.0, -3.0, 0.0])          # |x| / ||x|| = 1: level 127 must not become 128
    for _ in range(20):
        assert torch.equal(round_trip("qsgd:127", x), x)


def test_terngrad_values_are_ternary_and_within_the_scale():
    x = data(2000)
    y = round_trip("terngrad", x)
    scale = x.abs().max()
    assert set(y.unique().tolist()) <= {-scale.item(), 0.0, scale.item()}
    assert ((y - x).abs() <= scale).all() and (y * x >= 0).all()


def test_sign_scale_is_accurate_on_large_tensors():
    x = data(4_000_000)
    scale = sc.make("efsignsgd").compress(x).parts[0][0]
    assert abs(scale.item() / x.double().abs().mean().item() - 1) < 1e-5


def test_sign_compressors():
    x = data(999)
    expected = torch.where(x < 0, -1.0, 1.0) * x.abs().mean()
    assert torch.allclose(round_trip("signsgd", x), expected)
    assert torch.allclose(round_trip("efsignsgd", x), expected)
    y = round_trip("onebit", x)
    assert torch.allclose(y[x < 0], x[x < 0].mean().expand((x < 0).sum()))
    assert torch.allclose(y[x >= 0], x[x >= 0].mean().expand((x >= 0).sum()))
    assert torch.allclose(y.sum(), x.sum(), atol=1e-3)      # 1-bit SGD keeps each sign group's sum


def test_powersgd_is_a_contraction_and_exact_on_low_rank():
    x = data(64, 48)
    y = round_trip("powersgd:4", x)
    assert (y - x).norm() <= x.norm()
    low = data(64, 3, seed=1) @ data(3, 48, seed=2)
    assert torch.allclose(round_trip("powersgd:4", low), low, atol=1e-4)
    flat = low.reshape(-1)[:3000]              # 1-D: a padded square matrix
    assert round_trip("powersgd:4", flat).shape == flat.shape


def test_powersgd_warm_start_is_power_iteration_across_steps():
    """One power-iteration step a call, warm-started with the last Q: on the same matrix step after
    step (ef=off), the approximation's error falls to the best rank-r one (the SVD's); from a fresh
    Q each step it would stay at the first step's (a review's mutation, the start kept for good,
    passed every test)."""
    x = data(64, 48)
    reducer = sc.Reducer("powersgd:2,ef=off")
    errors = [(reducer.reduce(x, key="w") - x).norm().item() for _ in range(30)]
    singular = torch.linalg.svdvals(x.double())
    best = singular[2:].square().sum().sqrt().item()     # Eckart-Young: the best rank-2 error
    assert errors[0] > 1.005 * best, (errors[0], best)
    assert errors[-1] == pytest.approx(best, rel=2e-3), (errors[-1], best)


def test_a_nan_or_inf_gradient_does_not_spoil_powersgds_later_steps():
    """Its averaged Q is the next step's start: a NaN in one gradient (a loss scaler's overflow
    step, which it skips) made Q NaN, and every later step's approximation NaN, with ef=off too (a
    review: 256 NaN elements in each of the next 5 clean steps)."""
    for bad in (math.nan, math.inf):
        reducer = sc.Reducer("powersgd:2,ef=off")
        reducer.reduce(data(16, 16), key="w")
        spoiled = data(16, 16, seed=1)
        spoiled[3, 4] = bad
        reducer.reduce(spoiled, key="w")
        for step in range(3):
            assert reducer.reduce(data(16, 16, seed=2 + step), key="w").isfinite().all(), (bad, step)


def test_a_key_given_a_tensor_of_another_size_is_refused_before_its_state_changes():
    """A broadcasting add changed the residual before the call failed with torch's "The size of tensor
    a (64) must match ..." (a review)."""
    for spec in ("topk:0.25", "dgc:0.25", "efsignsgd"):
        reducer = sc.Reducer(spec)
        reducer.reduce(data(8, 8), key="w")
        held = reducer.memory.residual("w").clone()
        for other in (data(4, 4), data(1)):
            with pytest.raises(ValueError, match=re.escape("key 'w' holds the error feedback of a tensor of "
                                                           "shape (64,) (flattened), now given one of")):
                reducer.reduce(other, key="w")
            assert torch.equal(reducer.memory.residual("w"), held), spec
        reducer.reduce(data(64), key="w")          # the same elements, flattened alike: its own
    # in one call, every key is looked at before any tensor is compensated: a refusal of the second
    # left the first's residual changed, and a caller that tried again counted its gradient twice
    reducer = sc.Reducer("topk:0.5")
    reducer.reduce_many([data(8), data(6, seed=1)], ["a", "b"])
    held = reducer.memory.residual("a").clone()
    with pytest.raises(ValueError, match="key 'b' holds the error feedback of a tensor of shape \\(6,\\)"):
        reducer.reduce_many([data(8, seed=2), data(10)], ["a", "b"])
    assert torch.equal(reducer.memory.residual("a"), held)


def test_an_integer_tensor_is_refused():
    """It was averaged in float32 and truncated back without a word ([0, 0, 2, 3, 4], a review)."""
    for spec in ("none", "topk:0.5"):
        with pytest.raises(TypeError, match="a Reducer averages floating-point tensors, got torch.int64"):
            sc.Reducer(spec).reduce(torch.arange(5), key="i")


def test_blocktopk_keeps_whole_blocks_of_largest_norm():
    bs = 256
    x = data(40 * bs + 100)                    # 41 blocks, the last one short
    x[:bs] *= 10                               # block 0 must be kept
    compressor = sc.make("blocktopk:0.25")
    y = compressor.decompress(*_parts(compressor.compress(x)))
    blocks = torch.nn.functional.pad(y, (0, bs - 100)).view(41, bs)
    source = torch.nn.functional.pad(x, (0, bs - 100)).view(41, bs)
    kept = blocks.ne(0).any(dim=1)
    assert kept.sum() == math.ceil(0.25 * 41) and kept[0]
    assert torch.equal(blocks[kept], source[kept])
    norms = source.norm(dim=1)
    assert norms[kept].min() >= norms[~kept].max()
    x[-100:] = 100.0                           # the short last block
    assert (compressor.decompress(*_parts(compressor.compress(x)))[-100:] == 100.0).all()


@settings(max_examples=60, deadline=None)
@given(numel=st.sampled_from([1, 100, 256, 384, 512, 1000, 2048 + 7, (1 << 16) + 300]),
       ratio=st.sampled_from([0.01, 0.3, 1.0]), zero_blocks=st.integers(0, 3), seed=st.integers(0, 10**6),
       pad_whole=st.booleans())
def test_blocktopk_payload_and_what_it_sent_against_a_reference(numel, ratio, zero_blocks, seed, pad_whole):
    """Either way of padding a short last block (the whole tensor copied, or the block alone) keeps
    the blocks a plain reference picks, and `sent` names exactly their elements inside the tensor."""
    from sparcoll.compress import blocktopk
    bs = 256
    x = data(numel, seed=seed)
    nblocks = -(-numel // bs)
    for b in range(min(zero_blocks, nblocks)):
        x[b * bs:(b + 1) * bs] = 0.0
    compressor = sc.make(f"blocktopk:{ratio}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocktopk, "WHOLE_COPY_MOST", 1 << 30 if pad_whole else 0)
        payload = compressor.compress(x)
    indices, rows = payload.parts
    padded = torch.cat([x, torch.zeros(nblocks * bs - numel)]).view(nblocks, bs)
    norms = padded.norm(dim=1)
    want = min(max(1, math.ceil(ratio * nblocks)), int((norms > 0).sum()))
    assert indices.tolist() == sorted(set(indices.tolist())) and len(indices) == want
    assert torch.equal(rows, padded[indices])
    if 0 < want < nblocks:
        dropped = torch.ones(nblocks, dtype=torch.bool)
        dropped[indices] = False
        assert norms[indices].min() >= norms[dropped].max()
    entries = compressor.sent(payload, numel)
    positions = [i * bs + j for i in indices.tolist() for j in range(bs) if i * bs + j < numel]
    assert entries.idx.tolist() == positions


def _parts(payload):
    return payload.parts, payload.ctx


@pytest.mark.parametrize("spec", SPECS)
def test_reduce_many_equals_one_by_one(spec):
    tensors = [data(30, 20, seed=1), data(50, seed=2), data(7, 3, 2, seed=3), embedding_grad(4)]
    keys = ["a", "b", "c", "d"]
    together, alone = sc.Reducer(spec), sc.Reducer(spec)
    for _ in range(2):       # the second step with error feedback and warm starts
        many = together.reduce_many(tensors, keys)
        for t, k, m in zip(tensors, keys, many):
            one = alone.reduce(t, key=k)
            assert m.shape == t.shape and m.is_sparse == one.is_sparse
            assert torch.allclose(m.to_dense() if m.is_sparse else m,
                                  one.to_dense() if one.is_sparse else one, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS + ["dgc:0.1,momentum=0.5", "fp16,ef=on"])
def test_the_input_is_never_modified(spec):
    x = data(40, 30)
    original = x.clone()
    reducer = sc.Reducer(spec)
    for _ in range(3):
        reducer.reduce(x, key="t")
    assert torch.equal(x, original)


@pytest.mark.parametrize("spec", SPECS)
def test_payload_bytes_are_known_before_sending(spec):
    x = data(3000, seed=3)
    compressor = sc.make(spec)
    if spec.startswith("powersgd"):
        assert compressor.payload_bytes(3000, (60, 50)) == 4 * 2 * (60 + 50)
        assert compressor.payload_bytes(64, (64, 1)) == compressor.payload_bytes(9, (3, 3)) // 9 * 64 == 4 * 64
        return
    payload = compressor.compress(x)
    sent = sum(p.numel() * p.element_size() for p in payload.parts)
    if spec.startswith("blocktopk"):       # sparcoll sends the non-zero blocks, an index each
        dense = compressor.decompress(payload.parts, payload.ctx)
        nonzero = torch.nn.functional.pad(dense, (0, 72)).view(-1, 256).ne(0).any(dim=1).sum()
        assert compressor.payload_bytes(3000) == nonzero * (256 * 4 + 4) == 3 * (256 * 4 + 4)
        assert sent == 3 * (256 * 4 + 8)   # the payload itself: int64 indices, the rows
    elif compressor.variable:
        assert sent <= compressor.payload_bytes(3000)
    else:
        assert sent == compressor.payload_bytes(3000)


@pytest.mark.parametrize("spec", ["fp16", "qsgd:8", "onebit", "powersgd:2", "blocktopk:0.25"])
def test_reducer_counts_the_bytes_it_sent(spec):
    reducer, x = sc.Reducer(spec), data(60, 50)
    reducer.reduce(x, key="a")
    reducer.reduce(x, key="b")
    assert reducer.sent_bytes == 2 * reducer.payload_bytes(x)


def test_gathered_bytes_split_into_parts_of_any_alignment():
    from sparcoll.compress.channel import _split
    parts = (torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([1.5, -2.0]))
    buf = torch.cat([p.view(torch.uint8) for p in parts] + [torch.zeros(5, dtype=torch.uint8)])
    got = _split(buf, torch.tensor([3, 2]), parts)
    assert all(torch.equal(a, b) for a, b in zip(got, parts))


def test_bits_round_trip_any_length():
    for n in (0, 1, 7, 8, 9, 1001):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
        packed = bits.pack(mask)
        assert packed.numel() == bits.packed_bytes(n) and torch.equal(unpacked(packed, n), mask)
        levels = torch.tensor([2.0, -3.0])
        assert torch.equal(bits.decode(packed, n, levels), levels[mask.long()])
        other = torch.rand(n, generator=torch.Generator().manual_seed(n + 1)) < 0.5
        packed = bits.pack(mask, other)
        assert packed.numel() == bits.packed_bytes(n, width=2)
        levels = torch.tensor([0.5, 1.5, 2.5, 3.5])
        assert torch.equal(bits.decode(packed, n, levels), levels[2 * mask.long() + other.long()])
        out = torch.full((n,), math.nan)
        assert bits.decode(packed, n, levels, out) is out
        assert torch.equal(out, levels[2 * mask.long() + other.long()])
        strided = torch.full((2 * n,), math.nan)[::2]
        assert bits.decode(packed, n, levels, strided) is strided
        assert torch.equal(strided, levels[2 * mask.long() + other.long()])


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith("powersgd")])
def test_decompressing_and_combining_into_a_tensor_overwrite_it_with_the_same_values(spec):
    """The executors decompress into the gradient itself (`out`): whatever it held, the result is
    what a new tensor would hold. The average over ranks is computed apart, from each rank's parts
    decompressed alone (signsgd: the majority vote from the unpacked bits); sizes of a partial last
    byte and block, and a smaller tensor between two larger ones (the reused scratch buffer)."""
    compressor = sc.make(spec)
    for n in (1001, 37, 2050):
        payloads = [compressor.compress(data(n, seed=seed)) for seed in range(3)]
        for payload in payloads:
            out = torch.full((n,), math.nan)
            assert compressor.decompress(payload.parts, payload.ctx, out) is out
            assert torch.equal(out, compressor.decompress(payload.parts, payload.ctx))
        if compressor.scheme != "allgather":
            continue
        gathered = [payload.parts for payload in payloads]
        out = torch.full((n,), math.nan)
        assert compressor.combine(gathered, payloads[0].ctx, out) is out
        alone = torch.stack([compressor.decompress(parts, payloads[0].ctx) for parts in gathered])
        if spec == "signsgd":
            signs = torch.stack([1 - 2 * unpacked(packed, n).float() for _, packed in gathered])
            scale = torch.stack([levels[0] for levels, _ in gathered]).mean()
            expected = signs.sum(0).sign() * scale
        else:
            expected = alone.mean(0)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(compressor.combine(gathered, payloads[0].ctx), expected,
                                   rtol=1e-6, atol=1e-7)


# ---- unbiasedness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["randomk:0.25,ef=off", "qsgd:2", "terngrad"])
def test_unbiased_in_expectation(spec):
    """The mean of 3000 draws is within 5 standard errors of x for each of 32 elements. For an
    unbiased compressor that fails with probability < 32 * 6e-7 = 2e-5 (99.998% confidence, normal
    approximation); the seeds are fixed, so the outcome is reproducible."""
    x = data(32, seed=4)
    reducer = sc.Reducer(spec)
    draws = torch.stack([reducer.reduce(x, key="t") for _ in range(3000)])
    stderr = draws.std(dim=0) / math.sqrt(len(draws))
    assert ((draws.mean(dim=0) - x).abs() <= 5 * stderr + 1e-6).all()


def test_randomk_with_feedback_off_is_scaled_and_draws_change_every_call():
    x = data(100)
    reducer = sc.Reducer("randomk:0.1,ef=off")
    first, second = reducer.reduce(x, key="t"), reducer.reduce(x, key="t")
    assert not torch.equal(first != 0, second != 0)
    assert (first[first != 0].abs() > x[first != 0].abs()).all()


# ---- error feedback ------------------------------------------------------------------------------------

EF_SPECS = ["topk:0.05", "randomk:0.05", "threshold:1.5", "dgc:0.05,momentum=0", "efsignsgd",
            "onebit", "powersgd:1", "blocktopk:0.1", "fp16,ef=on", "qsgd:4,ef=on", "terngrad,ef=on"]


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_loses_nothing(spec):
    """Over 40 steps: sum of what was applied + the residual == sum of the gradients, to float
    rounding of the largest term (qsgd's residual grows to ~1e4: it is not a contraction, which is
    why its error feedback is off by default)."""
    reducer = sc.Reducer(spec)
    applied, grads = torch.zeros(30, 40), torch.zeros(30, 40)
    for step in range(40):
        g = data(30, 40, seed=100 + step)
        grads += g
        applied += reducer.reduce(g, key="w")
    residual = reducer.memory.residual("w").view(30, 40)
    scale = max(1.0, residual.abs().max().item(), applied.abs().max().item())
    assert torch.allclose(applied + residual, grads, atol=1e-5 * scale)


@pytest.mark.parametrize("spec", ["efsignsgd", "fp16,ef=on"])
def test_what_error_feedback_subtracts_lands_in_a_buffer_each_thread_keeps(spec):
    """A dense `sent` goes into one buffer per thread (no gradient-sized tensor per step): tensors of
    two sizes in turn still lose nothing, and another thread (an offload lane) gets its own."""
    import threading
    reducer = sc.Reducer(spec)
    shapes = {"large": (30, 40), "small": (7, 9)}
    applied = {key: torch.zeros(shape) for key, shape in shapes.items()}
    grads = {key: torch.zeros(shape) for key, shape in shapes.items()}
    for step in range(20):
        for key, shape in shapes.items():
            g = data(*shape, seed=300 + step)
            grads[key] += g
            applied[key] += reducer.reduce(g, key=key)
    for key, shape in shapes.items():
        total = applied[key] + reducer.memory.residual(key).view(shape)
        assert torch.allclose(total, grads[key], atol=1e-5 * max(1.0, applied[key].abs().max().item())), key
    c = reducer.compressor
    payload = c.compress(data(30, 40, seed=1))
    mine = c.sent(payload, 1200)
    assert torch.equal(mine, c.decompress(payload.parts, payload.ctx))
    assert c.sent(c.compress(data(7, 9, seed=2)), 63).data_ptr() == mine.data_ptr()
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(c.sent(payload, 1200).data_ptr()))
    thread.start()
    thread.join(10)
    assert theirs and theirs[0] != mine.data_ptr()


@pytest.mark.parametrize("spec", ["powersgd:2", "blocktopk:0.1", "topk:0.05"])
def test_averages_written_into_the_gradient_itself_lose_nothing(spec):
    """`into` may be the input itself (DDP's bucket, DataParallel's flat gradient): the average lands
    there, equal to what a reducer without `into` returns, and error feedback still loses nothing
    (PowerSGD writes its product there before the residual is updated)."""
    reducer, reference = sc.Reducer(spec), sc.Reducer(spec)
    applied, grads = torch.zeros(30, 40), torch.zeros(30, 40)
    for step in range(20):
        g = data(30, 40, seed=200 + step)
        grads += g
        expected = reference.reduce(g, key="w")
        flat = g.clone().view(-1)
        reducer.reduce_many([flat.view(30, 40)], ["w"], into=[flat])
        assert torch.allclose(flat.view(30, 40), expected, atol=1e-6)
        applied += flat.view(30, 40)
    residual = reducer.memory.residual("w").view(30, 40)
    assert torch.allclose(applied + residual, grads, atol=1e-5 * max(1.0, applied.abs().max().item()))


def test_error_feedback_on_sparse_coo_keeps_a_sparse_residual():
    reducer = sc.Reducer("topk:0.02")
    applied, grads = torch.zeros(100, 8), torch.zeros(100, 8)
    for step in range(20):
        g = embedding_grad(step)
        grads += g.to_dense()
        out = reducer.reduce(g, key="emb")
        assert out.is_sparse and out.sparse_dim() == 1
        applied += out.to_dense()
    residual = reducer.memory.residual("emb")
    assert residual.is_sparse
    assert torch.allclose(applied + residual.to_dense(), grads, atol=1e-5)


@pytest.mark.parametrize("spec", ["threshold:0.5", "blocktopk:0.25", "topk:0.1", "fp16,ef=on"])
def test_an_infinity_in_a_coo_gradient_is_sent_once_then_forgotten(spec):
    """One overflow step (GradScaler skips it), then finite ones: what was sent of the inf left NaN in
    the COO residual, which went out again every step (a review)."""
    reducer = sc.Reducer(spec)
    finite = []
    for step in range(5):
        values = torch.ones(4, 8)
        values[1, 3] = float("inf") if step == 0 else 1.0
        g = torch.sparse_coo_tensor(torch.tensor([[1, 5, 9, 30]]), values, (40, 8), check_invariants=True)
        finite.append(bool(reducer.reduce(g, key="emb").to_dense().isfinite().all()))
    assert finite == [False, True, True, True, True], finite
    assert reducer.memory.residual("emb").to_dense().isfinite().all()


def random_coo(shape, sparse_dims, nnz, seed):
    """A coalesced COO tensor of `nnz` random entries (0: none, as an embedding no row looked up)."""
    g = torch.Generator().manual_seed(seed)
    coords = torch.stack([torch.randint(shape[d], (nnz,), generator=g) for d in range(sparse_dims)])
    values = torch.randn((nnz,) + tuple(shape[sparse_dims:]), generator=g)
    return torch.sparse_coo_tensor(coords, values, shape, check_invariants=True).coalesce()


@pytest.mark.parametrize("sparse_dims", [1, 2])
@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_on_empty_sparse_coo(spec, sparse_dims):
    """A COO gradient with no entries (rows of 3, or plain entries) reduces to an all-zero result, and
    the steps around it still lose nothing: sum of what was applied + the residual == sum of the
    gradients."""
    reducer, shape = sc.Reducer(spec), (6, 3)
    applied, grads = torch.zeros(shape), torch.zeros(shape)
    for step, nnz in enumerate([0, 5, 0, 4]):
        g = random_coo(shape, sparse_dims, nnz, seed=step)
        out = reducer.reduce(g, key="emb")
        assert out.shape == shape
        if step == 0:
            assert not out.to_dense().any()
        applied += out.to_dense()
        grads += g.to_dense()
    residual = reducer.memory.residual("emb")
    residual = residual.to_dense() if residual.is_sparse else residual.view(shape)
    assert torch.allclose(applied + residual, grads, atol=1e-5 * max(1.0, applied.abs().max().item()))


@pytest.mark.parametrize("momentum", ["0", "0.5", "0.999"])
def test_dgc_momentum_in_range_is_taken(momentum):
    assert sc.parse(f"dgc:0.1,momentum={momentum}").options == {"momentum": float(momentum)}
    assert sc.make(f"dgc:0.1,momentum={momentum}")


def test_dgc_momentum_correction_accumulates_velocity_and_masks_what_was_sent():
    reducer = sc.Reducer("dgc:0.1,momentum=0.5")
    g = data(200)
    first = reducer.reduce(g, key="w")
    second = reducer.reduce(g, key="w")
    u = reducer.memory.velocity["w"]
    sent_first, sent_second = first != 0, second != 0
    assert not u[sent_second].any()                                 # masked after step 2
    assert torch.equal(u[sent_first & ~sent_second], g[sent_first & ~sent_second])   # u = g again
    neither = ~sent_first & ~sent_second
    assert neither.any() and torch.allclose(u[neither], 1.5 * g[neither])  # u = 0.5 g + g


# ---- empty, zero and sparse input ------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (300,), (20, 15)])
def test_empty_and_all_zero_tensors(spec, shape):
    out = sc.Reducer(spec).reduce(torch.zeros(shape), key="z")
    assert out.shape == shape and not out.any()


def test_threshold_payload_is_empty_when_nothing_is_above():
    payload = sc.make("threshold:10").compress(data(1000))
    assert [p.numel() for p in payload.parts] == [0, 0]


def test_mostly_zero_dense_input_sends_only_its_non_zeros():
    x = torch.zeros(100_000)
    x[[5, 70_000, 99_999]] = torch.tensor([1.0, -2.0, 3.0])
    idx, vals = sc.make("topk:0.01").compress(x).parts
    assert set(idx.tolist()) == {5, 70_000, 99_999} and idx.dtype == torch.int32
    blocks = sc.make("blocktopk:0.5")
    assert torch.equal(blocks.decompress(*_parts(blocks.compress(x))), x)


def embedding_grad(seed):
    emb = torch.nn.Embedding(100, 8, sparse=True)
    torch.nn.init.normal_(emb.weight, generator=torch.Generator().manual_seed(seed))
    rows = torch.randint(100, (12,), generator=torch.Generator().manual_seed(seed))
    emb(rows).pow(2).sum().backward()
    return emb.weight.grad


@pytest.mark.parametrize("spec", ["none", "fp16", "topk:0.01", "threshold:0.5", "blocktopk:0.5"])
def test_sparse_coo_input_is_compressed_without_densifying(spec, monkeypatch):
    g = embedding_grad(1)
    dense = round_trip(spec, g.to_dense())
    monkeypatch.setattr(torch.Tensor, "to_dense", lambda self, *a, **k: pytest.fail("densified"))
    out = round_trip(spec, g)
    assert out.is_sparse and out.sparse_dim() == g.sparse_dim() and out.shape == g.shape
    monkeypatch.undo()
    assert torch.equal(out.to_dense(), dense)


def test_reduce_many_refuses_keys_and_targets_that_do_not_match_its_tensors():
    """Fewer keys gave an AttributeError, more were ignored, a key shared by two tensors of one error-
    feedback compressor mixed their residuals (a RuntimeError on sizes), and blocktopk decompressed
    into a shorter `into` silently truncated."""
    four, six = torch.ones(4), torch.ones(6)
    for spec, keys in (("topk:0.5", ["a"]), ("topk:0.5", ["a", "b", "c"]), ("topk:0.5", ["a", "a"]),
                       ("powersgd:1", ["a", "a"])):
        with pytest.raises(ValueError, match="reduce_many takes one key per tensor"):
            sc.Reducer(spec).reduce_many([four.view(2, 2), six.view(2, 3)], keys)
    out = sc.Reducer("fp16").reduce_many([four, six], [None, None])     # no state: keys may repeat
    assert torch.equal(out[0], four) and torch.equal(out[1], six)
    with pytest.raises(ValueError, match=r"`into` holds tensors of \[3\] elements for inputs of \[4\]"):
        sc.Reducer("blocktopk:0.5").reduce_many([four], ["a"], into=[torch.empty(3)])


@pytest.mark.parametrize("spec", ["terngrad", "efsignsgd", "onebit", "topk:0.5", "none"])
def test_a_tensor_that_requires_grad_is_reduced_as_data(spec):
    """terngrad, efsignsgd and onebit failed on one ("Can't call numpy() on Tensor that requires grad")
    where the other compressors took it."""
    x = torch.randn(64, requires_grad=True)
    out = sc.Reducer(spec).reduce(x, "k")
    assert out.shape == x.shape and not out.requires_grad
    if spec == "none":
        assert torch.equal(out, x.detach())


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_reducer_names_the_layouts_it_takes():
    with pytest.raises(TypeError, match="dense or sparse COO tensors, got torch.sparse_csr"):
        sc.Reducer("fp16").reduce(torch.eye(3).to_sparse_csr())


@pytest.mark.parametrize("spec", ["topk:0.1", "efsignsgd", "powersgd:2", "dgc:0.1"])
def test_a_compressor_that_keeps_state_needs_a_key_per_tensor(spec):
    """Without a key, every tensor's residual (or PowerSGD's warm start) was one: a tensor of the
    same size got the previous one's residual added silently."""
    reducer = sc.Reducer(spec)
    with pytest.raises(ValueError, match="keeps state per tensor"):
        reducer.reduce(data(10, 10))
    if reducer.splits:
        with pytest.raises(ValueError, match="keeps state per tensor"):
            reducer.compress(data(10, 10))
    assert torch.equal(sc.Reducer("fp16").reduce(torch.ones(4)), torch.ones(4))     # no state: no key


@pytest.mark.parametrize("spec", ["topk:0.1", "threshold:0.5", "blocktopk:0.5", "randomk:0.5", "dgc:0.5"])
def test_an_infinity_that_was_sent_leaves_no_nan_in_error_feedback(spec):
    """An overflow step (a loss scaler's) sends its infinity; the residual there is 0, as for any
    value sent. Subtracting it left inf - inf = NaN for good: topk then sent NaN every step, and
    blocktopk never sent that block again."""
    x = data(2048, seed=4)
    sent_first = sc.make(spec).compress(x).ctx[0][0] if spec.startswith("randomk") else 0
    x[sent_first] = math.inf
    reducer = sc.Reducer(spec)
    first = reducer.reduce(x, key="w")
    assert first[sent_first] == math.inf
    assert reducer.memory.residual("w").isfinite().all()
    after = [reducer.reduce(data(2048, seed=5 + step), key="w") for step in range(3)]
    assert all(out.isfinite().all() for out in after)


def test_powersgd_keeps_its_warm_start_through_a_zero_gradient():
    """A step with a zero gradient (a parameter unused that step) made Q = 0, and the next step's
    approximation from it lost most of a gradient of rank <= r (a relative error of 0.97)."""
    low = data(40, 2, seed=1) @ data(2, 30, seed=2)
    reducer = sc.Reducer("powersgd:2,ef=off")
    assert torch.allclose(reducer.reduce(low, key="w"), low, atol=1e-4)
    assert not reducer.reduce(torch.zeros(40, 30), key="w").any()
    assert torch.allclose(reducer.reduce(low, key="w"), low, atol=1e-4)


@pytest.mark.parametrize("shape", [(64, 1), (1, 512), (3, 3), (4, 4), (7,)])
def test_powersgd_sends_a_tensor_its_factors_would_not_shrink_as_it_is(shape):
    """Thin and small matrices: rank-2 factors of (64, 1) hold 130 floats for 64, and were still sent
    (an approximation, bigger than the tensor). They are averaged as they are, exact, with nothing
    left to feed back, beside the others in one collective."""
    x, big = data(*shape, seed=7), data(40, 30, seed=8)
    reducer = sc.Reducer("powersgd:2")
    for step in range(2):
        thin, approx = reducer.reduce_many([x, big], ["x", "big"])
        assert torch.equal(thin, x)
        assert not reducer.memory.residual("x").any()
    assert reducer.compressor.payload_bytes(x.numel(), shape) == 4 * x.numel()
    assert not torch.equal(approx, big) and reducer.memory.residual("big").any()
