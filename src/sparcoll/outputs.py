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


def check_figure_path(path: str | None, option: str, keeps: dict[str, str | None] | None = None) -> None:
    """check_output_path, and a name whose extension is a format matplotlib writes here (it picks the
    format by the extension: x.json failed once the work was done, and a name without one was
    written to name.png). A small figure is written in that format to memory, as some need more
    than matplotlib (pgf: a TeX installation)."""
    check_output_path(path, option, keeps)
    if path is None:
        return
    import io

    from matplotlib.figure import Figure   # no pyplot, no backend chosen: a figure of its own

    figure = Figure(figsize=(1, 1))
    formats = figure.canvas.get_supported_filetypes()
    names = ", ".join(f".{name}" for name in sorted(formats))
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if not extension:
        raise ValueError(f"{option} {path}: no extension to tell the figure's format; end the name with one of {names}")
    if extension not in formats:
        raise ValueError(f"{option} {path}: matplotlib writes no .{extension} figure; end the name with one of {names}")
    figure.text(0.5, 0.5, "sparcoll")
    try:
        figure.savefig(io.BytesIO(), format=extension)
    except Exception as exc:  # noqa: BLE001 - whatever stops this format here stops the real figure
        raise ValueError(f"{option} {path}: matplotlib cannot write .{extension} figures here ({exc})") from None
