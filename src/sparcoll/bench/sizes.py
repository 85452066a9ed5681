"""Element counts as people write them: 16M, 1M, 64K, 65536 (binary multiples, as tensor sizes are), and
the comma lists the commands sweep over (2,4,8)."""
from __future__ import annotations

import argparse
import re
from typing import Callable

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_COUNT_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """'16M' -> 16777216, '64k' -> 65536, '65536' -> 65536. Raises ValueError otherwise."""
    m = _COUNT_RE.match(text)
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"invalid count {text!r}: expected a positive integer with an optional K, M or G suffix")
    return int(m.group(1)) * _SUFFIXES[m.group(2).upper()]


def count_argument(text: str) -> int:
    """parse_count as an argparse type: its error message shown as it is."""
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_count(n: int) -> str:
    """The shortest exact form: 16777216 -> '16M', 4096 -> '4K', 1000 -> '1000'."""
    for suffix in ("G", "M", "K"):
        if n % _SUFFIXES[suffix] == 0:
            return f"{n // _SUFFIXES[suffix]}{suffix}"
    return str(n)


def comma_list(convert: Callable, unique: bool = False) -> Callable[[str], list]:
    """An argparse type: a comma list of `convert`'s values (items stripped; an empty list refused;
    with `unique`, a value given twice refused: a sweep would run and report it twice)."""
    def parse(text: str) -> list:
        try:
            items = [(item.strip(), convert(item.strip())) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid list {text!r}: {exc}") from None
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        if unique:
            first: dict = {}
            for item, value in items:
                if value in first:
                    same = "" if item == first[value] else f" (the same as {first[value]})"
                    raise argparse.ArgumentTypeError(f"invalid list {text!r}: {item} given twice{same}")
                first[value] = item
        return [value for _, value in items]
    return parse
