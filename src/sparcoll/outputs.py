"""The commands' output files, checked before any work: a run should not fail only once its results
are in (a --json or --plot into a missing directory once lost a whole benchmark)."""
from __future__ import annotations

import os


def check_output_path(path: str | None, option: str) -> None:
    """A ValueError naming `option` if `path` cannot be written (None: no such output)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {path}: directory {folder} is not writable")
