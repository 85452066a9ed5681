"""The shared secret of dedicated aggregators, read the same way by `sparcoll aggregator` and workers.

One reader, so both ends strip it alike (a trailing newline in a file or a variable must not make the
two ends disagree) and neither accepts a guessable one: whitespace only, or shorter than 16 bytes.
"""
from __future__ import annotations

import os

ENV = "SPARCOLL_SECRET"
MIN_BYTES = 16
HOW_TO_MAKE = ("generate one with: python -c \"import secrets; print(secrets.token_hex(32))\" "
               "> secret")


def shared_secret(path: str | None = None) -> bytes:
    """The secret in the file `path`, else in $SPARCOLL_SECRET, stripped of surrounding whitespace.

    b"" when there is none (no `path`, the variable unset or empty): only loopback may run so.
    ValueError naming the source when the file cannot be read, or when what it or the variable holds
    is shorter than 16 bytes once stripped (whitespace only included)."""
    if path is not None:
        source = f"the secret file {path}"
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read {source}: {exc.strerror or exc}") from None
    else:
        source = f"${ENV}"
        raw = os.environ.get(ENV, "").encode()
        if not raw:
            return b""
    secret = raw.strip()
    if len(secret) < MIN_BYTES:
        what = ("no secret (it is empty or whitespace only)" if not secret
                else f"a secret of {len(secret)} bytes")
        raise ValueError(f"{source} holds {what}; a shared secret must have at least {MIN_BYTES} "
                         f"bytes ({HOW_TO_MAKE})")
    return secret
