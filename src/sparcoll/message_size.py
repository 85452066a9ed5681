"""How many blocks a rank puts in one message: adapted to the rate its links deliver.

On a fast link each message costs CPU (Python, thread wake-ups), so big messages win; on a slow one
big messages make every aggregator wait longer for the slowest worker's next message (measured at
1 Gbit/s: 2 MiB messages 10-15% slower than 256 KiB ones). So a message should take about
MESSAGE_SECONDS on the wire. No sockets here: the communicator reports what it measured.
"""
from __future__ import annotations

import math

MESSAGE_SECONDS = 0.004
ADAPT_MIN_BYTES = 8 << 20   # a collective that read less says too little about the rate


def fit_message_blocks(rate: float, block_bytes: int, limit: int) -> int:
    """Blocks per message for a link that delivered `rate` bytes/s: the largest power of two whose
    message takes at most MESSAGE_SECONDS, kept within [limit / 8, limit] (rounding down to a power
    of two keeps ranks that measure slightly different rates on the same size)."""
    fit = rate * MESSAGE_SECONDS / block_bytes
    size = 1 << math.floor(math.log2(fit)) if fit >= 1 else 1
    return max(1, limit >> 3, min(limit, size))


class MessageSizePolicy:
    """The message size of one rank, from the rates it observed."""

    def __init__(self, limit: int):
        # limits
        self.limit = limit          # the most blocks per message, agreed with the aggregators
        # internal state
        self.rate: float | None = None   # bytes/s of the last collective that said enough

    def observe(self, nbytes: int, seconds: float) -> None:
        """A collective read `nbytes` from the network (worker and aggregator) in `seconds`."""
        if nbytes >= ADAPT_MIN_BYTES:
            self.rate = nbytes / max(seconds, 1e-6)

    def blocks(self, block_bytes: int) -> int:
        """Blocks per message for blocks of `block_bytes`: the limit until a rate was observed."""
        if self.rate is None:
            return self.limit
        return fit_message_blocks(self.rate, block_bytes, self.limit)
