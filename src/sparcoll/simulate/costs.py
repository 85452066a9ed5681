"""The measured costs the simulator is built from, and where they are kept.

Per-byte costs are CPU seconds per byte on one core; `message_s` is the CPU a sparcoll message costs each
side beyond its bytes (Python protocol, header, thread hand-off), `collective_s` what a collective costs
a worker besides its messages; `gloo_step_s` the CPU of one step of gloo's C++ collectives. `latency_s` is one-way: a message's trip through the kernel, a wake-up included.
`goodput` is the payload share of a shaped link's rate (TCP/IP headers; measured 0.96 at 1 Gbit/s).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

#: The costs measured on the machine this project is developed on (`sparcoll simulate --calibrate`).
DEFAULT_PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Costs:
    scan_s_per_byte: float       # sparcoll's non-zero block scan of a dense tensor
    add_s_per_byte: float        # dst += src, per byte of src
    copy_s_per_byte: float       # gathering or scattering blocks between a tensor and a buffer
    socket_s_per_byte: float     # a byte through TCP: the sender's and the receiver's CPU together
    coalesce_s_per_byte: float   # torch's sparse coalesce (gloo's sparse allreduce), per byte of values
    message_s: float             # sparcoll's CPU per message per side, beyond its bytes
    collective_s: float          # sparcoll's CPU per collective per worker: its set-up and completion
    gloo_step_s: float           # gloo's CPU per step of a collective, beyond its bytes
    latency_s: float             # one way, per message
    goodput: float               # payload bytes per byte of link rate
    note: str = ""               # how and where they were measured

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> "Costs":
        """The costs in `path`; a ValueError naming the file if it is not a calibration (a JSON object
        of numbers, as `sparcoll simulate --calibrate` writes)."""
        expected = "a JSON object of costs, as sparcoll simulate --calibrate writes"
        with open(path) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: not JSON ({exc}); expected {expected}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: holds a JSON {type(data).__name__}; expected {expected}")
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(data) - {"note"})
        if missing:
            raise ValueError(f"{path}: calibration lacks {', '.join(missing)}")
        bad = sorted(name for name in names - {"note"}
                     if isinstance(data[name], bool) or not isinstance(data[name], (int, float)))
        if bad:
            raise ValueError(f"{path}: {', '.join(bad)} must be numbers; expected {expected}")
        negative = sorted(name for name in names - {"note"} if not 0 <= data[name] < math.inf)
        if negative:
            raise ValueError(f"{path}: {', '.join(negative)} must be finite and at least 0")
        if not 0 < data["goodput"] <= 1:
            raise ValueError(f"{path}: goodput {data['goodput']} outside (0, 1]: payload bytes per byte of link rate")
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)
            f.write("\n")
