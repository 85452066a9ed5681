"""What the summary scripts share: a range as the tables print it, and how far a run's losses drift
from the baseline's. Imported by scripts run as `python3 benchmarks/NAME.py` (no package needed)."""
from __future__ import annotations

import math


def span(values: list[float], form: str = "{:.1f}") -> str:
    """'low-high', or one value where both print alike."""
    low, high = form.format(min(values)), form.format(max(values))
    return low if low == high else f"{low}-{high}"


def loss_difference(losses: list, base: list) -> float:
    """The largest |loss - base's| over the steps; infinite where a loss diverged (null in the JSON, or
    not finite: max() would skip a NaN)."""
    return max((abs(a - b) if a is not None and b is not None and math.isfinite(a - b) else math.inf
                for a, b in zip(losses, base)), default=0.0)
