"""The commands' output files, checked before any work: a run should not fail only once its results
are in (a --json or --plot into a missing directory once lost a whole benchmark)."""
from __future__ import annotations

import os


def check_output_path(path: str | None, option: str, keeps: dict[str, str | None] | None = None) -> None:
    """A ValueError naming `option` if `path` cannot be written (None: no such output), or names a
    file the command needs kept: `keeps` maps options to their files (a plan written over its
    profile lost the profile)."""
    if path is None:
        return
    for kept_option, kept in (keeps or {}).items():
        if kept is not None and os.path.realpath(path) == os.path.realpath(kept):
            raise ValueError(f"{option} and {kept_option} both name {path}: {option} would overwrite {kept_option}")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {path}: directory {folder} is not writable")
