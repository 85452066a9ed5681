"""Compressor specs: the one string format users, the DDP hook and the CLI share.

    NAME[:ARG][,KEY=VALUE]...      e.g. "topk:0.01", "topk:0.01,ef=off", "randomk:0.1,seed=7"

A colon may stand for any comma ("topk:0.01:ef=off"), so a spec fits in a comma-separated list
such as the train command's --compare.

ARG is what the compressor needs (a ratio in (0, 1], a threshold, a level count, a rank); KEY=VALUE
options are `ef=on|off` (error feedback, every compressor; the default is on where it is standard),
`seed=INT` (randomk, powersgd: all ranks must use the same one) and `momentum=FLOAT` (dgc). A bad spec
is a ValueError that names the problem, raised before anything is sent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"must be a positive finite number, got {text}")
    return value


def _int_in(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be an integer in [{low}, {high}], got {text}")
        return value
    return parse


# name -> (argument parser or None when the compressor takes none, what the argument is,
#          error feedback by default, options beyond `ef` it accepts)
KINDS: dict[str, tuple] = {
    "none": (None, None, False, ()),
    "fp16": (None, None, False, ()),
    "bf16": (None, None, False, ()),
    "topk": (_ratio, "RATIO", True, ()),
    "randomk": (_ratio, "RATIO", True, ("seed",)),
    "threshold": (_positive_float, "VALUE", True, ()),
    "dgc": (_ratio, "RATIO", True, ("momentum",)),
    "qsgd": (_int_in(1, 32767), "LEVELS", False, ()),
    "terngrad": (None, None, False, ()),
    "signsgd": (None, None, False, ()),
    "efsignsgd": (None, None, True, ()),
    "onebit": (None, None, True, ()),
    "powersgd": (_int_in(1, 1 << 16), "RANK", True, ("seed",)),
    "blocktopk": (_ratio, "RATIO", True, ()),
}


def _momentum(text: str) -> float:
    """A factor in [0, 1): at 1 or more (or NaN) the velocity grows without bound or turns NaN."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"momentum must be a number in [0, 1), got {text}")
    return value


_OPTIONS = {"seed": _int_in(0, (1 << 63) - 1), "momentum": _momentum}
OPTION_DEFAULTS = {"seed": 0, "momentum": 0.9}


@dataclass(frozen=True)
class Spec:
    """A parsed spec: `arg` is None for compressors without one; `ef` is resolved (default applied);
    `options` holds those not at their default (OPTION_DEFAULTS), so that specs which mean the same
    are equal and print alike (ranks compare them as printed: "randomk:0.1" on one rank and
    "randomk:0.1,seed=0" on another were refused as different settings)."""
    name: str
    arg: float | int | None
    ef: bool
    options: dict = field(default_factory=dict)

    def __str__(self) -> str:
        text = self.name if self.arg is None else f"{self.name}:{self.arg}"
        if self.ef != KINDS[self.name][2]:
            text += f",ef={'on' if self.ef else 'off'}"
        return text + "".join(f",{k}={v}" for k, v in sorted(self.options.items()))


def usage() -> str:
    """The spec forms in one line, for a command's help."""
    forms = ", ".join(name if arg is None else f"{name}:{arg}"
                      for name, (_, arg, _, _) in KINDS.items())
    return (f"{forms}; options after a comma or colon: ef=on|off, seed=INT (randomk, powersgd), "
            f"momentum=FLOAT (dgc)")


def parse(spec: str | Spec) -> Spec:
    """Parse `spec` (a Spec passes through); ValueError naming what is wrong."""
    if isinstance(spec, Spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a compressor spec is a string such as 'topk:0.01', got {spec!r}")
    name, *rest = [part.strip() for part in re.split(r"[,:]", spec.strip())]
    name = name.lower()
    arg_text = rest.pop(0) if rest and "=" not in rest[0] else ""
    extras = rest
    if name not in KINDS:
        raise ValueError(f"unknown compressor {name!r} in spec {spec!r}; known: {', '.join(KINDS)}")
    arg_parser, arg_name, ef_default, allowed = KINDS[name]
    if arg_parser is None and arg_text:
        raise ValueError(f"compressor {name!r} takes no argument, got {arg_text!r} in {spec!r}")
    if arg_parser is not None and not arg_text:
        raise ValueError(f"compressor {name!r} needs {arg_name}, e.g. '{name}:{_EXAMPLES[name]}'")
    try:
        arg = arg_parser(arg_text) if arg_parser else None
    except ValueError as exc:
        raise ValueError(f"bad {arg_name} {arg_text!r} for {name!r} in spec {spec!r}: {exc}") from None
    ef, options, given = ef_default, {}, set()
    for extra in extras:
        key, eq, value = extra.partition("=")
        key = key.strip().lower()
        if not eq:
            raise ValueError(f"expected KEY=VALUE after the argument in spec {spec!r}, got {extra!r}")
        if key in given:    # the last one won without a word (a review: 'topk:0.01,ef=off,ef=on')
            raise ValueError(f"option {key!r} is given twice in spec {spec!r}")
        given.add(key)
        if key == "ef":
            if value.strip().lower() not in ("on", "off"):
                raise ValueError(f"ef must be 'on' or 'off', got {value!r} in spec {spec!r}")
            ef = value.strip().lower() == "on"
        elif key in allowed:
            try:
                options[key] = _OPTIONS[key](value)
            except ValueError as exc:
                raise ValueError(f"bad {key} {value!r} in spec {spec!r}: {exc}") from None
        else:
            known = ", ".join(("ef",) + allowed)
            raise ValueError(f"option {key!r} does not apply to {name!r} (it takes: {known}) "
                             f"in spec {spec!r}")
    if name == "dgc" and not ef:    # its momentum correction lives in its error-feedback memory
        raise ValueError(f"dgc's momentum correction is its error feedback: with ef=off it would be topk "
                         f"without momentum anywhere (the optimizer runs without it under dgc); drop ef=off, "
                         f"or use topk:{arg},ef=off, in spec {spec!r}")
    return Spec(name, arg, ef, {k: v for k, v in options.items() if v != OPTION_DEFAULTS[k]})


_EXAMPLES = {"topk": "0.01", "randomk": "0.01", "threshold": "0.001", "dgc": "0.001",
             "qsgd": "127", "powersgd": "4", "blocktopk": "0.01"}
