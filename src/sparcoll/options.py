"""A communicator's options: the caller's arguments, else the environment, else the defaults.

Checked before anything is built: a bad option is the caller's own mistake, so it raises ValueError
naming the option (errors that peers cause are SparcollErrors).
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass, field, replace
from typing import Callable

from . import transport, wire
from .algorithm import Algorithm
from .secret import shared_secret

DEFAULT_BLOCK_SIZE = 256
DEFAULT_STREAMS = 1
DEFAULT_MESSAGE_BLOCKS = 2048
DEFAULT_CREDITS = 2     # messages in flight per stream; more only queue up in the links (docs/benchmarks-log.md)
DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Options:
    block_size: int                     # elements per block
    aggregators: tuple[str, ...] | None  # host:port of dedicated aggregators; None: colocated
    streams: int                        # ranges per aggregator shard
    message_blocks: int                 # the most blocks per message (each rank adapts below it)
    credits: int                        # messages in flight per stream
    timeout: float                      # seconds for init and for every collective
    host: str | None                    # address peers reach this rank's aggregator at
    algorithm: Algorithm                # auto (the default), sparse or ring: see algorithm.py
    secret: bytes = field(default=b"", repr=False)  # of dedicated aggregators ($SPARCOLL_SECRET)

    @classmethod
    def resolve(cls, *, block_size: int | None = None, aggregators: list[str] | None = None,
                streams: int | None = None, message_blocks: int | None = None,
                credits: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                host: str | None = None, algorithm: str | None = None) -> "Options":
        block_size = _given_or_env("block_size", block_size, _block_size, DEFAULT_BLOCK_SIZE)
        options = cls(
            block_size=block_size,
            aggregators=_given_or_env("aggregators", aggregators, _addresses, None),
            streams=_given_or_env("streams", streams, _up_to("streams"), DEFAULT_STREAMS),
            message_blocks=_given_or_env("message_blocks", message_blocks, _up_to("message_blocks"),
                                         default_message_blocks(block_size)),
            credits=_given_or_env("credits", credits, _up_to("credits"), DEFAULT_CREDITS),
            timeout=timeout, host=_given_or_env("host", host, _host, None),
            algorithm=_given_or_env("algorithm", algorithm, Algorithm.parse, Algorithm.AUTO))
        if options.aggregators:
            options = replace(options, secret=shared_secret())
        options._check()
        return options

    def _check(self) -> None:
        if self.message_blocks * self.block_size * 8 > wire.MAX_MESSAGE_BYTES:
            raise ValueError(f"message_blocks {self.message_blocks} x block_size {self.block_size} "
                             f"x 8 bytes exceeds the {wire.MAX_MESSAGE_BYTES}-byte message limit; "
                             f"at most {wire.MAX_MESSAGE_BYTES // (self.block_size * 8)} blocks "
                             f"per message fit")
        check_timeout(self.timeout)

    def job_config(self, world: int) -> wire.JobConfig:
        """What every rank and aggregator of the job must agree on (ValueError if out of range)."""
        num_aggs = len(self.aggregators) if self.aggregators else world
        config = wire.JobConfig(world, num_aggs, self.streams, self.credits, self.message_blocks,
                                wire.JobConfig.ALGORITHMS.index(self.algorithm.value))
        config.check()
        return config


def env_block_size() -> int:
    """The block size of a communicator whose init names none: $SPARCOLL_BLOCK_SIZE's, else the default."""
    return _given_or_env("block_size", None, _block_size, DEFAULT_BLOCK_SIZE)


def default_message_blocks(block_size: int) -> int:
    """DEFAULT_MESSAGE_BLOCKS, or for large blocks the largest power of two whose message of
    float64 blocks fits the message limit."""
    fits = max(1, wire.MAX_MESSAGE_BYTES // (max(1, block_size) * 8))
    return min(DEFAULT_MESSAGE_BLOCKS, 1 << (fits.bit_length() - 1))


def check_timeout(timeout) -> None:
    """ValueError unless `timeout` is a positive, finite number of seconds."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def check_tag(tag) -> None:
    """ValueError unless `tag` is a whole number a header's tag field holds (0 to wire.MAX_TAG)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= wire.MAX_TAG:
        raise ValueError(f"tag must be a whole number from 0 to {wire.MAX_TAG}, got {tag!r}")


def _given_or_env(option: str, value, parse: Callable, default):
    """The argument if given, else $SPARCOLL_<OPTION> if set, else the default."""
    if value is not None:
        return parse(value, option)
    variable = f"SPARCOLL_{option.upper()}"
    raw = os.environ.get(variable, "").strip()
    return parse(raw, f"${variable}") if raw else default


def _integer(value, name: str) -> int:
    """An integer argument, or the text of one (from the environment); 256.7 or True are refused, not
    truncated to 256 or 1."""
    try:
        if isinstance(value, str):
            return int(value)
        if not isinstance(value, bool):
            return operator.index(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{name} must be an integer, got {value!r}")


def _block_size(value, name: str) -> int:
    number = _integer(value, name)
    if not 1 <= number <= wire.MAX_BLOCK_SIZE:
        raise ValueError(f"{name}={number} outside [1, {wire.MAX_BLOCK_SIZE}]")
    return number


def _host(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a host name or address, got {value!r}")
    return value.strip()


def _up_to(option: str) -> Callable:
    """A parser of an integer from 1 to the job's limit for `option` (wire.JobConfig.LIMITS), whose
    error names it as the caller gave it: `credits`, or `$SPARCOLL_CREDITS` from the environment."""
    limit = wire.JobConfig.LIMITS[option]

    def parse(value, name: str) -> int:
        number = _integer(value, name)
        if not 1 <= number <= limit:
            raise ValueError(f"{name}={number} outside [1, {limit}]")
        return number
    return parse


def _addresses(value, name: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = tuple(a.strip() for a in items if a.strip())
    if not addresses:
        raise ValueError(f"{name} lists no address; leave it unset (None) for colocated aggregators")
    endpoints = [transport.parse_address(a) for a in addresses]     # "[::1]:7000" is "::1:7000"
    twice = list(dict.fromkeys(a for a, e in zip(addresses, endpoints) if endpoints.count(e) > 1))
    if twice:
        raise ValueError(f"{name}: {', '.join(twice)} listed more than once (one aggregator per address)")
    return addresses
