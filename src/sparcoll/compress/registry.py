"""Which class implements which spec name, and `make`, the one way to build a compressor."""
from __future__ import annotations

from .base import Compressor
from .blocktopk import BlockTopK
from .powersgd import PowerSGD
from .quantize import QSGD, Cast, TernGrad
from .sign import OneBit, Sign
from .sparsify import DGC, RandomK, Threshold, TopK
from .spec import KINDS, Spec, parse

CLASSES = {"none": Cast, "fp16": Cast, "bf16": Cast, "topk": TopK, "randomk": RandomK,
           "threshold": Threshold, "dgc": DGC, "qsgd": QSGD, "terngrad": TernGrad,
           "signsgd": Sign, "efsignsgd": Sign, "onebit": OneBit, "powersgd": PowerSGD,
           "blocktopk": BlockTopK}
assert CLASSES.keys() == KINDS.keys()


def make(spec: str | Spec) -> Compressor:
    """The compressor a spec names; ValueError naming what is wrong with a bad spec."""
    spec = parse(spec)
    return CLASSES[spec.name](spec)
