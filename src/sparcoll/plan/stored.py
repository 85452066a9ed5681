"""A profile stored at `sparcoll plan --profile`: told from another file (never overwritten), reused
only for the run it was measured for (`differing` names what is not), and checked before a plan reads
it (`invalid`): a profile edited by hand or damaged would otherwise end in a traceback, or in a plan
that predicts NaN without a word."""
from __future__ import annotations

import json
import math
from pathlib import Path


PROFILE_KEYS = ("version", "model", "fits")     # what tells a stored profile from another file


def stored_profile(path: Path) -> dict | None:
    """The profile stored at `path`, None if there is no file; a ValueError naming it if the file is
    not a sparcoll profile (a plan, say), which is then never overwritten."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--profile {path}: not a sparcoll profile (unreadable as JSON: {exc}); remove it or "
                         f"give another path") from None
    if not (isinstance(stored, dict) and all(k in stored for k in PROFILE_KEYS)):
        raise ValueError(f"--profile {path}: not a sparcoll profile (a JSON object with {', '.join(PROFILE_KEYS)}); "
                         f"remove it or give another path")
    return stored


def differing(stored: dict, ident: dict) -> list[str]:
    """The fields of `ident` (identity) a stored profile was measured for otherwise, each with its
    stored value and ours (compressors in any order: a profile stored before they were sorted too)."""
    wanted = json.loads(json.dumps(ident))      # as stored: tuples are lists
    had = {k: stored.get(k) for k in wanted}
    if had.get("block_size") is None and isinstance(stored.get("model"), dict):    # stored before it was identity
        had["block_size"] = stored["model"].get("block_size")
    if isinstance(had["compressors"], list):
        had["compressors"] = sorted(had["compressors"], key=str)
    return [f"{k} {json.dumps(had[k])} (this run: {json.dumps(wanted[k])})" for k in wanted if had[k] != wanted[k]]


NUMBER = (int, float)
NULLABLE = (int, float, type(None))
# What a plan reads of a stored profile (tensors_of, Costing): each key's type ([T]: a list of T), "?"
# after an optional key's name; `invalid` also checks the backward order and ready times against the
# tensors, each curve's points, and that every number is finite and not negative.
MODEL_KEYS = {"order": [str], "ready": [NUMBER], "tensors": dict, "backward_end": NUMBER, "optimizer": NUMBER,
              "forward": NUMBER, "cores_per_worker": NUMBER, "cpu?": NUMBER, "unused?": [str],
              "block_size?": int}
TENSOR_KEYS = {"numel": int, "shape": [int], "linear": bool, "rows": NUMBER, "coo": bool, "density": NUMBER,
               "union": NUMBER, "rebuild_loaded?": NULLABLE, "rebuild_cpu_loaded?": NULLABLE,
               **{f"{k}?": NUMBER for k in ("node", "spared", "rebuild", "rebuild_slowdown", "rebuild_cpu",
                                            "lookup_spared", "lookup_spared_cpu")}}
CURVES = ("collectives", "compress", "decompress", "compress_cpu", "decompress_cpu", "loaded", "slowdown", "held",
          "cpu", "cpu_loaded")      # fits of [xs, ys] by name (costs.Curve); Costing needs the first three
FITS_KEYS = {**{k if k in CURVES[:3] else f"{k}?": dict for k in CURVES}, "grids?": dict}


def _is(value, kind) -> bool:
    """isinstance, a bool being no number, [T] a list of T."""
    if isinstance(kind, list):
        return isinstance(value, list) and all(_is(v, kind[0]) for v in value)
    return isinstance(value, bool) if kind is bool else isinstance(value, kind) and not isinstance(value, bool)


def _wrong(where: str, given, keys: dict) -> str | None:
    """The first key of `keys` that `given` lacks or holds a value of another type in."""
    if not isinstance(given, dict):
        return f"{where} is not an object"
    for key, kind in keys.items():
        name = key.rstrip("?")
        if name not in given and not key.endswith("?"):
            return f"{where}.{name} is missing"
        if name in given and not _is(given[name], kind):
            return f"{where}.{name} is {json.dumps(given[name])[:60]}, not {_type_name(kind)}"
    return None


def _type_name(kind) -> str:
    """A kind of MODEL_KEYS' as the error names it."""
    if isinstance(kind, list):
        return f"a list of {_type_name(kind[0])}"
    return {dict: "an object", str: "a string", bool: "true or false", int: "an integer"}.get(kind, "a number")


def _bad_number(value, where: str) -> str | None:
    """The first number in `value` (nested) that is not finite or is negative."""
    if isinstance(value, dict):
        return next(filter(None, (_bad_number(v, f"{where}.{k}") for k, v in value.items())), None)
    if isinstance(value, list):
        return next(filter(None, (_bad_number(v, f"{where}[{i}]") for i, v in enumerate(value))), None)
    if _is(value, NUMBER) and not (math.isfinite(value) and value >= 0):
        return f"{where} is {value}, not a finite number >= 0"
    return None


def _inconsistent(name: str, tensor: dict) -> str | None:
    """A tensor whose elements are not its shape's, or whose densities are no shares (a review: a
    density of 7.5 changed the decision, a numel unlike the shape's went into the plan)."""
    held = math.prod(tensor["shape"])
    if tensor["numel"] != held:
        return f"model.tensors.{name}.numel is {tensor['numel']}, its shape {tensor['shape']} holds {held}"
    wrong = next((k for k in ("density", "union") if not 0 <= tensor[k] <= 1), None)
    return None if wrong is None else f"model.tensors.{name}.{wrong} is {tensor[wrong]}, not a share between 0 and 1"


def invalid(profile: dict) -> str | None:
    """What makes a stored profile of the right identity unusable (edited by hand, or damaged), None
    if nothing: the plan would otherwise fail in a traceback, or predict NaN without a word."""
    model, fits = profile["model"], profile["fits"]
    problem = _wrong("model", model, MODEL_KEYS) or _wrong("fits", fits, FITS_KEYS)
    if problem:
        return problem
    order, tensors = model["order"], model["tensors"]
    if sorted(order) != sorted(tensors):
        return f"model.order lists {len(order)} tensors and model.tensors {len(tensors)}, not each once"
    if len(model["ready"]) != len(order):
        return f"model.ready has {len(model['ready'])} times for {len(order)} tensors"
    problem = next(filter(None, (_wrong(f"model.tensors.{name}", t, TENSOR_KEYS) or _inconsistent(name, t)
                                 for name, t in tensors.items())), None)
    if problem:
        return problem
    if not model["cores_per_worker"] > 0:
        return f"model.cores_per_worker is {model['cores_per_worker']}, not a share of the cores above 0"
    for key in (k for k in CURVES if k in fits):
        for name, curve in fits[key].items():
            if not (_is(curve, [[NUMBER]]) and len(curve) == 2 and len(curve[0]) == len(curve[1]) > 0):
                return f"fits.{key}.{name} is not a curve (a list of xs and one of as many ys)"
    for quantity, by_name in fits.get("grids", {}).items():
        if not isinstance(by_name, dict):
            return f"fits.grids.{quantity} is not an object"
        for name, rows in by_name.items():
            if not (isinstance(rows, list) and rows and all(
                    isinstance(r, list) and len(r) == 3 and _is(r[0], NUMBER) and _is(r[1:], [[NUMBER]])
                    and len(r[1]) == len(r[2]) > 0 for r in rows)):
                return f"fits.grids.{quantity}.{name} is not a grid (rows of elements, shares and as many times)"
    return _bad_number(model, "model") or _bad_number(fits, "fits")
