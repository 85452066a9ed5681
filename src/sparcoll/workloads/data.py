"""Helpers shared by the workloads' synthetic generators and file readers.

Everything here is vectorized numpy and deterministic given a
``numpy.random.Generator``, so a global batch can be regenerated bit for bit
by every rank from ``(seed, step)`` alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator for one global batch; keyed on the pair so that
    ``(seed, step + 1)`` and ``(seed + 1, step)`` are unrelated streams."""
    return np.random.default_rng([seed, step])


def zipf(rng: np.random.Generator, n, size, exponent: float) -> np.ndarray:
    """Zipf-distributed ranks in ``[0, n)`` (rank 0 most frequent).

    Inverts the CDF of the continuous power law on ``[0.5, n + 0.5]`` and
    rounds, which tracks the discrete bounded Zipf law closely without a
    per-rank table, so ``n`` can be tens of millions and may be an array
    broadcast against ``size`` (one support size per column).
    """
    n = np.asarray(n, dtype=np.float64)
    u = rng.random(size)
    lo, hi = 0.5, n + 0.5
    if exponent == 1.0:
        x = lo * (hi / lo) ** u
    else:
        e = 1.0 - exponent
        x = (lo**e + u * (hi**e - lo**e)) ** (1.0 / e)
    return np.clip(np.rint(x).astype(np.int64) - 1, 0, n.astype(np.int64) - 1)


def hash64(values: np.ndarray, salt) -> np.ndarray:
    """SplitMix64 finalizer of ``values`` mixed with ``salt`` (uint64 result).

    Used to hash raw categorical values into embedding tables, so synthetic
    and file data map to rows the same way and popular values scatter over
    the table like hashed Criteo ids do.
    """
    with np.errstate(over="ignore"):
        z = np.asarray(values).astype(np.uint64) ^ ((np.asarray(salt, np.uint64) + np.uint64(1)) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def malformed(path: str | Path, lineno: int, problem: str) -> ValueError:
    """The error readers raise, naming the file and 1-based line number."""
    return ValueError(f"{path}, line {lineno}: {problem}")
