"""Message layouts: a fixed header, then block indices, then block data. Pure bytes, no sockets.

Every message starts with the same 56-byte header so a receiver can validate it completely before it
reads (or allocates for) a single payload byte. Data messages carry the collective's descriptor
(numel, block size, dtype, op, tag) so an aggregator can detect ranks that disagree about the
collective (the tag is the caller's: which tensor of that size it is, Communicator.allreduce).

    CONTRIBUTE  worker -> aggregator   count int32 block indices, then count blocks of data
    RESULT      aggregator -> worker   same layout; `progress` is c, "every block below c is final"
    ERROR       either way             count bytes of UTF-8 text; fails the named collective, or
                                       with collective CONNECTION (aggregator -> worker) says why
                                       the aggregator closes this connection next
    BYE         worker -> aggregator   the worker leaves the job: on purpose (count 0), or after an
                                       error, count bytes of UTF-8 text saying which (the peers'
                                       collectives then fail with it: the root cause, not "left")

A receiver decodes the header (`decode_header`), then `read_body` reads what the header announces
and returns it as one of the message types below; the caller chooses where block data lands, so
receives stay zero-copy. The same types carry messages inside a process (a colocated aggregator and
its own worker), where no bytes move.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .blocks import block_count
from .errors import (AuthenticationError, CollectiveTimeout, MismatchError, PeerError, ProtocolError,
                     SparcollError)

MAGIC = b"SPCL"
VERSION = 2                 # 2: the op byte of a data message carries COO_OP
INDEX_DTYPE = np.int32
INDEX_BYTES = 4
MAX_BLOCKS = int(np.iinfo(INDEX_DTYPE).max) + 1    # a tensor's blocks, indexed from 0 by INDEX_DTYPE
MAX_BLOCK_SIZE = 1 << 16
MAX_ERROR_BYTES = 1 << 16
MAX_MESSAGE_BYTES = 64 << 20    # largest contribution an aggregator will allocate for
MAX_TAG = (1 << 16) - 1         # a collective's tag is a header's last 16 bits
CONNECTION = 0                  # an ERROR's collective id that names the connection (ids start at 1)


class Kind(enum.IntEnum):
    CONTRIBUTE = 1
    RESULT = 2
    ERROR = 3
    BYE = 4


class Op(enum.IntEnum):
    SUM = 0
    AVG = 1


OPS = {"sum": Op.SUM, "avg": Op.AVG}   # the reduction ops sparcoll offers, by their API names
COO_OP = 0x80   # set in a data message's op byte when the tensor is a sparse COO one: a dense tensor's
                # blocks and a COO tensor's of one shape must not be summed together


def base_op(code: int) -> int:
    """An op byte without its COO_OP flag: the reduction itself."""
    return code & ~COO_OP


def op_name(code: int) -> str:
    """An op byte (a data message's, or a ring check's) in words."""
    base = base_op(code)
    if base not in Op._value2member_map_:
        return f"code {code}"
    return Op(base).name.lower() + (" of a COO tensor" if code & COO_OP else "")


class ErrorCode(enum.IntEnum):
    """Carried in an ERROR message's `op` field (and a handshake's verdict) so the receiver raises
    the right exception type."""
    GENERIC = 0
    MISMATCH = 1
    PEER = 2
    PROTOCOL = 3
    AUTHENTICATION = 4
    TIMEOUT = 5         # a peer's collective timed out: a CollectiveTimeout here too (it was a bare
                        # SparcollError, which DataParallel did not take for one that ends the job)


_ERROR_TYPES = {ErrorCode.GENERIC: SparcollError, ErrorCode.MISMATCH: MismatchError,
                ErrorCode.PEER: PeerError, ErrorCode.PROTOCOL: ProtocolError,
                ErrorCode.AUTHENTICATION: AuthenticationError, ErrorCode.TIMEOUT: CollectiveTimeout}


def error_code(raw: int) -> ErrorCode:
    """A received error code; codes this version does not know read as GENERIC."""
    return ErrorCode(raw) if raw in ErrorCode._value2member_map_ else ErrorCode.GENERIC


def code_of(exc: BaseException) -> ErrorCode:
    """The code that makes a peer raise the same kind of error as `exc`."""
    for code, cls in reversed(_ERROR_TYPES.items()):
        if isinstance(exc, cls):
            return code
    return ErrorCode.GENERIC




# dtype code -> (torch dtype, accumulation dtype). Half types accumulate in float32.
DTYPES: dict[int, tuple[torch.dtype, torch.dtype]] = {
    0: (torch.float32, torch.float32),
    1: (torch.float16, torch.float32),
    2: (torch.bfloat16, torch.float32),
    3: (torch.float64, torch.float64),
}
DTYPE_CODES = {dt: code for code, (dt, _) in DTYPES.items()}

_HEADER = struct.Struct("<4sBBHQQIIQQIBBH")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class Header:
    kind: Kind
    stream: int = 0
    job: int = 0
    collective: int = 0
    seq: int = 0
    count: int = 0          # blocks (CONTRIBUTE/RESULT) or bytes of text (ERROR)
    progress: int = 0       # p (worker) or c (aggregator), a block index
    numel: int = 0
    block_size: int = 0
    dtype: int = 0
    op: int = 0
    tag: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def descriptor(self) -> tuple[int, int, int, int, int]:
        return (self.numel, self.block_size, self.dtype, self.op, self.tag)

    def payload_sizes(self) -> tuple[int, int]:
        """(index bytes, data bytes) that follow this header on the wire."""
        if self.kind in (Kind.CONTRIBUTE, Kind.RESULT):
            itemsize = self.torch_dtype.itemsize
            return self.count * INDEX_BYTES, self.count * self.block_size * itemsize
        if self.kind in TEXT_KINDS:
            return 0, self.count
        return 0, 0


# The tags the "sparcoll" torch backend gives the small allreduce it runs beside a barrier and beside
# an all_reduce it hands to gloo, so that a peer's call that went elsewhere fails at once.
BARRIER_TAG = MAX_TAG
DELEGATED_TAG = MAX_TAG - 1
_TAG_WORDS = {BARRIER_TAG: "the \"sparcoll\" backend's check of a barrier",
              DELEGATED_TAG: "the \"sparcoll\" backend's check beside an all_reduce it hands to gloo (an op "
                             "or dtype sparcoll does not reduce)"}


def tagged(tag: int) -> str:
    """A collective's tag in the words of an error message (nothing for the default, 0)."""
    if tag in _TAG_WORDS:
        return f", tag {tag}: {_TAG_WORDS[tag]}"
    return f", tag {tag}" if tag else ""


def encode_header(h: Header) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, h.kind, h.stream, h.job, h.collective, h.seq, h.count,
                        h.progress, h.numel, h.block_size, h.dtype, h.op, h.tag)


def decode_header(buf, max_blocks: int, expected_job: int) -> Header:
    """Parse and validate a header; `max_blocks` bounds what a peer may make us allocate."""
    if len(buf) != HEADER_BYTES:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_BYTES} bytes")
    (magic, version, kind, stream, job, collective, seq, count, progress, numel, block_size,
     dtype, op, tag) = _HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this is {VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None
    h = Header(kind, stream, job, collective, seq, count, progress, numel, block_size, dtype, op,
               tag)
    if kind in (Kind.CONTRIBUTE, Kind.RESULT):
        if dtype not in DTYPES:
            raise ProtocolError(f"unknown dtype code {dtype}")
        if base_op(op) not in Op._value2member_map_:
            raise ProtocolError(f"unknown op code {op}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ProtocolError(f"block size {block_size} out of range")
        if count > max_blocks:
            raise ProtocolError(f"message declares {count} blocks, limit is {max_blocks}")
        if kind is Kind.CONTRIBUTE and count * block_size * DTYPES[dtype][0].itemsize > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {count} blocks of {block_size} elements exceeds "
                                f"{MAX_MESSAGE_BYTES} bytes")
        nblocks = block_count(numel, block_size)
        if nblocks > MAX_BLOCKS:
            raise ProtocolError(f"a tensor of {numel} elements in blocks of {block_size} has {nblocks} blocks, "
                                f"more than block indices number ({MAX_BLOCKS})")
        if progress > nblocks:
            raise ProtocolError(f"progress {progress} beyond the {nblocks} blocks of the tensor")
    elif kind in TEXT_KINDS and count > MAX_ERROR_BYTES:
        raise ProtocolError(f"{kind.name} text of {count} bytes exceeds {MAX_ERROR_BYTES}")
    if job != expected_job:
        raise ProtocolError(f"message for job {job:#x} on a connection of job {expected_job:#x}")
    return h


# ---- messages ----------------------------------------------------------------------------------
DATA_KINDS = frozenset({Kind.CONTRIBUTE, Kind.RESULT})
TEXT_KINDS = frozenset({Kind.ERROR, Kind.BYE})


@dataclass(frozen=True)
class Blocks:
    """A CONTRIBUTE or RESULT message: its header and block indices (int64, as sent: sorted). Its
    data went where the reader's caller placed it."""
    header: Header
    indices: np.ndarray


@dataclass(frozen=True)
class Failure:
    """An ERROR message: collective `collective` failed, for the reason `text`."""
    collective: int
    code: ErrorCode
    text: str

    def exception(self) -> SparcollError:
        return _ERROR_TYPES[self.code](self.text)


@dataclass(frozen=True)
class Bye:
    """A BYE message: the worker leaves the job, on purpose (no text) or after the error `text`,
    which the collectives it leaves behind fail with (as exceptions of `code`)."""
    code: ErrorCode = ErrorCode.PEER
    text: str = ""


@dataclass(frozen=True)
class LocalResult:
    """A result handed by a colocated aggregator to its own worker (no bytes move): `result` is a
    protocol Result; `lease` goes back once the worker is done reading its rows."""
    collective: int
    stream: int
    result: Any
    lease: Any


Message = Blocks | Failure | Bye


def read_body(h: Header, recv_into: Callable[[memoryview], None], expected: frozenset,
              place: Callable[[Header, np.ndarray], list[memoryview]]) -> Message:
    """Read the body that follows header `h`. `recv_into(view)` fills a view exactly (a socket, or
    bytes in memory). For block messages, `place(h, indices)` is called once the indices are in
    and returns where the data goes: views whose lengths add up to the data bytes. Kinds outside
    `expected` raise ProtocolError before anything is read."""
    if h.kind not in expected:
        raise ProtocolError(f"unexpected {h.kind.name} message")
    index_bytes, data_bytes = h.payload_sizes()
    if h.kind in DATA_KINDS:
        raw = np.empty(h.count, dtype=INDEX_DTYPE)
        recv_into(memoryview(raw).cast("B"))
        indices = raw.astype(np.int64)
        views = place(h, indices)
        if sum(len(v) for v in views) != data_bytes:
            raise AssertionError(f"place() gave {sum(len(v) for v in views)} bytes of room for "
                                 f"{data_bytes} data bytes")
        for view in views:
            recv_into(view)
        return Blocks(h, indices)
    text = bytearray(data_bytes)
    recv_into(memoryview(text))
    if h.kind is Kind.ERROR:
        return Failure(h.collective, error_code(h.op), text.decode("utf-8", "replace"))
    return Bye(error_code(h.op), text.decode("utf-8", "replace"))


def data_header(kind: Kind, *, stream: int, job: int, collective: int, seq: int, count: int,
                progress: int, descriptor: tuple[int, int, int, int, int]) -> bytes:
    return encode_header(Header(kind, stream, job, collective, seq, count, progress, *descriptor))


def error_message(job: int, collective: int, text: str, code: ErrorCode) -> list[bytes]:
    raw = text.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    return [encode_header(Header(Kind.ERROR, job=job, collective=collective, count=len(raw),
                                 op=code)), raw]


def bye_message(job: int, reason: tuple[ErrorCode, str] | None = None) -> bytes:
    """A BYE; with `reason` (the code and text of the error) when the worker leaves after one."""
    code, text = reason or (ErrorCode.PEER, "")
    raw = text.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
    return encode_header(Header(Kind.BYE, job=job, count=len(raw), op=code)) + raw


# ---- handshake -----------------------------------------------------------------------------------
# client -> server  HELLO   job, rank, world, aggregator index, aggregator count, client nonce
# server -> client  CHALLENGE  server nonce, MAC proving the server holds the secret
# client -> server  PROOF   MAC proving the client holds the secret, and the job token
# server -> client  VERDICT  an error code and a reason length (0 = welcome), then the reason text
NONCE_BYTES = 32
MAC_BYTES = 32
_HELLO = struct.Struct("<4sBBQIIHHHHI32s")
_CHALLENGE = struct.Struct("<4sB32s32s")
_PROOF = struct.Struct("<4sB32s32s")
_VERDICT = struct.Struct("<4sBBH")
HELLO_BYTES, CHALLENGE_BYTES, PROOF_BYTES, VERDICT_BYTES = (
    _HELLO.size, _CHALLENGE.size, _PROOF.size, _VERDICT.size)


@dataclass(frozen=True)
class JobConfig:
    """What every connection of a job must agree on; the aggregator sizes its state from it."""
    world: int
    num_aggs: int
    streams: int
    credits: int
    message_blocks: int
    algorithm: int = 0      # index into ALGORITHMS: ranks that choose differently would wait forever

    LIMITS = dict(world=4096, num_aggs=4096, streams=64, credits=64, message_blocks=1 << 16)
    ALGORITHMS = ("auto", "sparse", "ring")     # sparcoll.algorithm.Algorithm's values

    def check(self) -> None:
        """ValueError naming the first field outside its limits (a caller's own option; a peer's
        HELLO with such a field is refused as a ProtocolError by Hello.decode)."""
        for name, limit in self.LIMITS.items():
            if not 1 <= getattr(self, name) <= limit:
                raise ValueError(f"{name}={getattr(self, name)} outside [1, {limit}]")
        if not 0 <= self.algorithm < len(self.ALGORITHMS):
            raise ValueError(f"algorithm code {self.algorithm} outside [0, {len(self.ALGORITHMS)})")


@dataclass(frozen=True)
class Hello:
    job: int
    rank: int
    agg_index: int
    config: JobConfig
    nonce: bytes

    def encode(self) -> bytes:
        c = self.config
        return _HELLO.pack(MAGIC, VERSION, c.algorithm, self.job, self.rank, c.world, self.agg_index,
                           c.num_aggs, c.streams, c.credits, c.message_blocks, self.nonce)

    @staticmethod
    def decode(buf) -> "Hello":
        if len(buf) != HELLO_BYTES:
            raise ProtocolError(f"truncated hello: {len(buf)} of {HELLO_BYTES} bytes")
        (magic, version, algorithm, job, rank, world, agg_index, num_aggs, streams, credits, message_blocks,
         nonce) = _HELLO.unpack(buf)
        _check_magic(magic, version)
        config = JobConfig(world, num_aggs, streams, credits, message_blocks, algorithm)
        try:
            config.check()
        except ValueError as exc:
            raise ProtocolError(f"hello with {exc}") from None
        if rank >= world or agg_index >= num_aggs:
            raise ProtocolError(f"inconsistent hello: rank {rank} of {world}, "
                                f"aggregator {agg_index} of {num_aggs}")
        return Hello(job, rank, agg_index, config, nonce)


def _check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} in handshake")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this is {VERSION})")


def mac(secret: bytes, role: bytes, hello: Hello, server_nonce: bytes) -> bytes:
    """HMAC-SHA256 binding both nonces, the role and every HELLO field, so nothing can be replayed."""
    return hmac.new(secret, role + hello.encode() + server_nonce, hashlib.sha256).digest()


def encode_challenge(server_nonce: bytes, server_mac: bytes) -> bytes:
    return _CHALLENGE.pack(MAGIC, VERSION, server_nonce, server_mac)


def decode_challenge(buf) -> tuple[bytes, bytes]:
    """(server nonce, server MAC)."""
    if len(buf) != CHALLENGE_BYTES:
        raise ProtocolError(f"challenge of {len(buf)} bytes, expected {CHALLENGE_BYTES}")
    magic, version, nonce, server_mac = _CHALLENGE.unpack(buf)
    _check_magic(magic, version)
    return nonce, server_mac


def job_token(job_secret: bytes) -> bytes:
    """What a job's ranks show an aggregator besides the aggregator's own secret: derived from the job
    secret in the job's Store, so another job holding the same aggregator secret cannot join it."""
    return hmac.new(job_secret, b"sparcoll job token", hashlib.sha256).digest()


def encode_proof(client_mac: bytes, token: bytes = bytes(MAC_BYTES)) -> bytes:
    return _PROOF.pack(MAGIC, VERSION, client_mac, token)


def decode_proof(buf) -> tuple[bytes, bytes]:
    """(client MAC, job token)."""
    if len(buf) != PROOF_BYTES:
        raise ProtocolError(f"proof of {len(buf)} bytes, expected {PROOF_BYTES}")
    magic, version, client_mac, token = _PROOF.unpack(buf)
    _check_magic(magic, version)
    return client_mac, token


def encode_verdict(reason: str = "", code: ErrorCode = ErrorCode.AUTHENTICATION) -> bytes:
    """Welcome (no reason), or a refusal: `code` says which error the client raises."""
    raw = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    return _VERDICT.pack(MAGIC, VERSION, code, len(raw)) + raw


MAX_REASON_BYTES = 1024


def refusal_bytes(head: bytes) -> int | None:
    """The length of the refusal verdict `head` begins (from a server of any version), None if it
    begins none: a server that cannot read a HELLO (another version, limits out of range) answers
    with one where the client expects the challenge."""
    if len(head) < VERDICT_BYTES:
        return None
    magic, _version, code, length = _VERDICT.unpack_from(head)
    if magic != MAGIC or code not in ErrorCode._value2member_map_ or not 0 < length <= MAX_REASON_BYTES:
        return None
    return VERDICT_BYTES + length


def decode_refusal(data: bytes) -> tuple[ErrorCode, str] | None:
    """(the error code, the reason) of a whole refusal verdict, else None."""
    if refusal_bytes(data) != len(data):
        return None
    code = _VERDICT.unpack_from(data)[2]
    return ErrorCode(code), data[VERDICT_BYTES:].decode("utf-8", "replace")


def decode_verdict(buf) -> tuple[ErrorCode, int]:
    """(the refusal's error code, the length of the reason text that follows; 0: welcome)."""
    if len(buf) != VERDICT_BYTES:
        raise ProtocolError(f"verdict of {len(buf)} bytes, expected {VERDICT_BYTES}")
    magic, version, code, length = _VERDICT.unpack(buf)
    _check_magic(magic, version)
    return error_code(code), length
