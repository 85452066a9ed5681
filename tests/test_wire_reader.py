"""Message bodies read in memory through wire.read_body, the one reader both sides use: every kind
round-trips, block data lands where the caller places it, and arbitrary bytes give a message that
matches its header or a ProtocolError, never anything else."""
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparcoll import errors, wire

JOB = 0x5EC
ALL_KINDS = frozenset(wire.Kind)


class Truncated(Exception):
    pass


def source(raw: bytes):
    """recv_into over bytes in memory, failing like a closed socket when they run out."""
    stream = io.BytesIO(raw)

    def recv_into(view: memoryview) -> None:
        if stream.readinto(view) != len(view):
            raise Truncated
    return recv_into


def read(raw: bytes, expected=ALL_KINDS, max_blocks=1 << 16):
    header, body = raw[:wire.HEADER_BYTES], raw[wire.HEADER_BYTES:]
    h = wire.decode_header(header, max_blocks, JOB)
    landed = []

    def place(h, indices):
        landed.append(torch.empty(h.payload_sizes()[1], dtype=torch.uint8))
        return [memoryview(landed[-1].numpy())]
    return h, wire.read_body(h, source(body), expected, place), landed


def encoded_blocks(kind, indices, rows, descriptor):
    header = wire.data_header(kind, stream=1, job=JOB, collective=7, seq=3, count=len(indices),
                              progress=int(indices[-1]) + 1 if len(indices) else 1,
                              descriptor=descriptor)
    data = rows.contiguous().view(torch.uint8).numpy().tobytes()   # bfloat16 has no numpy type
    return header + np.asarray(indices, dtype=wire.INDEX_DTYPE).tobytes() + data


@pytest.mark.parametrize("kind", [wire.Kind.CONTRIBUTE, wire.Kind.RESULT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_block_messages_round_trip_into_the_placed_memory(kind, dtype):
    indices = [0, 5, 6, 40]
    rows = torch.arange(4 * 8, dtype=torch.float32).view(4, 8).to(dtype)
    descriptor = (41 * 8, 8, wire.DTYPE_CODES[dtype], 0, wire.MAX_TAG)    # the tag's every bit
    h, message, landed = read(encoded_blocks(kind, indices, rows, descriptor))
    assert h.descriptor == descriptor
    assert isinstance(message, wire.Blocks) and message.header == h
    assert message.indices.dtype == np.int64 and message.indices.tolist() == indices
    assert torch.equal(landed[0].view(dtype).view(4, 8), rows)


def test_error_and_bye_messages():
    for code in wire.ErrorCode:
        raw = b"".join(wire.error_message(JOB, 9, "caf\u00e9 failed", code))
        _, message, _ = read(raw)
        assert message == wire.Failure(9, code, "caf\u00e9 failed")
        assert type(message.exception()).__name__ == {
            wire.ErrorCode.GENERIC: "SparcollError", wire.ErrorCode.MISMATCH: "MismatchError",
            wire.ErrorCode.PEER: "PeerError", wire.ErrorCode.PROTOCOL: "ProtocolError",
            wire.ErrorCode.AUTHENTICATION: "AuthenticationError", wire.ErrorCode.TIMEOUT: "CollectiveTimeout"}[code]
    _, message, _ = read(wire.bye_message(JOB))
    assert message == wire.Bye() and not message.text
    _, message, _ = read(wire.bye_message(JOB, (wire.ErrorCode.MISMATCH, "rank 2 left: caf\u00e9")))
    assert message == wire.Bye(wire.ErrorCode.MISMATCH, "rank 2 left: caf\u00e9")


def test_error_codes_round_trip_and_unknown_codes_read_as_generic():
    for cls in (errors.MismatchError, errors.PeerError, errors.ProtocolError,
                errors.AuthenticationError, errors.SparcollError, errors.CollectiveTimeout):
        failure = wire.Failure(1, wire.code_of(cls("x")), "x")
        assert type(failure.exception()) is cls
    assert wire.code_of(ValueError("not ours")) is wire.ErrorCode.GENERIC
    assert wire.error_code(200) is wire.ErrorCode.GENERIC


def test_unexpected_kinds_are_refused_before_the_body_is_read():
    raw = encoded_blocks(wire.Kind.CONTRIBUTE, [1], torch.ones(1, 4), (8, 4, 0, 0))
    with pytest.raises(errors.ProtocolError, match="unexpected CONTRIBUTE"):
        read(raw, expected=frozenset({wire.Kind.RESULT, wire.Kind.ERROR}))
    with pytest.raises(errors.ProtocolError, match="unexpected BYE"):
        read(wire.bye_message(JOB), expected=frozenset({wire.Kind.RESULT}))


def test_a_short_body_is_reported_by_the_source():
    raw = encoded_blocks(wire.Kind.RESULT, [1, 2], torch.ones(2, 4), (12, 4, 0, 0))
    with pytest.raises(Truncated):
        read(raw[:-1])


HEADER_FIELDS = st.tuples(st.sampled_from([1, 2, 3, 4, 9]), st.integers(0, 3), st.integers(0, 40),
                          st.integers(0, 100), st.integers(0, 1 << 12), st.integers(0, 16),
                          st.integers(0, 5), st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(HEADER_FIELDS, st.binary(max_size=2048))
def test_arbitrary_bodies_give_a_matching_message_or_a_clean_error(fields, body):
    kind, stream, count, progress, numel, block_size, dtype, op = fields
    header = wire._HEADER.pack(wire.MAGIC, wire.VERSION, kind, stream, JOB, 1, 0, count, progress,
                               numel, block_size, dtype, op, 0)
    try:
        h, message, landed = read(header + body, max_blocks=32)
    except (errors.ProtocolError, Truncated):
        return
    index_bytes, data_bytes = h.payload_sizes()
    if isinstance(message, wire.Blocks):
        assert message.indices.tolist() == np.frombuffer(body[:index_bytes],
                                                         dtype=wire.INDEX_DTYPE).tolist()
        assert bytes(landed[0].numpy()) == body[index_bytes:index_bytes + data_bytes]
    else:
        assert isinstance(message, wire.Failure if h.kind is wire.Kind.ERROR else wire.Bye)
        assert message.text == body[:data_bytes].decode("utf-8", "replace")
