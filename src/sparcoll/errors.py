"""One exception hierarchy, so callers can catch everything sparcoll raises with one clause."""

REPORT_GRACE = 0.5      # seconds a collective that failed for a lost connection waits for a peer's
                        # report of why: a peer that refused its input announces it, then leaves,
                        # and its closed connection may be seen first
SETTLE_S = 1.0          # seconds a failed collective waits for what still writes or reads the caller's
                        # tensor (a result being placed, a message queued from it) before it raises


class SparcollError(RuntimeError):
    """Root of every error sparcoll raises on purpose."""


class ProtocolError(SparcollError):
    """A peer sent a message that breaks the protocol (malformed, out of order, over its credits)."""


class MismatchError(SparcollError):
    """Ranks called the same collective with different arguments (numel, dtype, op, block size)."""


class PeerError(SparcollError):
    """A peer (worker or aggregator) died, closed its connection or reported a failure."""


class AuthenticationError(SparcollError):
    """A connection failed the HMAC handshake."""


class CollectiveTimeout(SparcollError, TimeoutError):
    """A blocking step did not finish before its deadline."""


class PoisonedError(SparcollError):
    """The communicator had a failed collective; it must be re-created."""


class DivergedError(SparcollError):
    """The ranks of a DataParallel did not all drop the same step (a backward that raised on some
    ranks only, or at different points): their collectives no longer pair; the job must restart."""
