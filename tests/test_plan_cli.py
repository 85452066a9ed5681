"""`sparcoll plan`'s arguments and its user's model: what it refuses before any work starts, with a
clear error, what it reuses and what it measures again."""
import argparse
import json
import os
import re
import sys

import pytest

from sparcoll.plan import command
from support import sparcoll_here

TIMEOUT = 240
MODELS = (
    "import torch\nfrom torch import nn\n\n"
    "class Unused(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.a, self.spare, self.b = nn.Linear(8, 16), nn.Linear(8, 8), nn.Linear(16, 2)\n"
    "    def forward(self, x):\n        return self.b(torch.relu(self.a(x)))\n\n"
    "class Pair(nn.Module):\n"
    "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 2)\n"
    "    def forward(self, x):\n        return self.a(x), x\n\n"
    "def plain():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), torch.randn(4, 8)\n\n"
    "def unused():\n    torch.manual_seed(0)\n    return Unused(), torch.randn(4, 8)\n\n"
    "def tupled():\n    return Pair(), torch.randn(4, 8)\n\n"
    "def keyed():\n    return nn.Linear(8, 2), {'x': torch.randn(4, 8)}\n\n"
    "def double():\n    return nn.Linear(8, 2).double(), torch.randn(4, 8, dtype=torch.float64)\n\n"
    "def broken():\n    return nn.Linear(8, 2), torch.randn(4, 3)\n\n"
    "class Argmax(nn.Module):\n"
    "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 2)\n"
    "    def forward(self, x):\n        return self.a(x).argmax(1).float()\n\n"
    "def argmaxed():\n    return Argmax(), torch.randn(4, 8)\n\n"
    "def parameterless():\n    return nn.ReLU(), torch.randn(4, 8)\n\n"
    "def refusing():\n    raise ValueError('bad size')\n")


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """Modules written to tmp_path importable by `sparcoll plan` run in this process and by its
    workers, and forgotten after the test (a module imported once stays imported in this process)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def plan(capsys, *argv: str) -> tuple[int, str]:
    """run()'s exit status and stderr, in this process (no job starts for what it refuses)."""
    status = command.run(args_of("--workers", "2", "--network", "none", *argv))
    return status, capsys.readouterr().err


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Every test in its own directory: a default --profile, should one be written, goes there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)


@pytest.fixture
def models(tmp_path):
    """A module of users' models in the current directory (where the workers import it from), under a
    name of its own per test: a module imported once stays imported in this process."""
    name = f"users_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(MODELS)
    yield name
    sys.modules.pop(name, None)


def test_a_stored_profile_with_a_list_valued_workload_option_is_reused(tmp_path, monkeypatch, capsys):
    """`--workload-option hidden=64,32` is a tuple in the identity and a list in the stored JSON:
    they never compared equal, and every run measured the profile again (minutes of jobs)."""
    args = args_of("--workload", "deeplight", "--workload-option", "hidden=64,32", "--workers", "2",
                   "--network", "none")
    ident = command.identity(args)
    assert ident["options"] == {"hidden": (64, 32)}, ident
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({**ident, "model": {}, "fits": {"kept": 1}}))
    args.profile = str(profile)
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    assert command.load_or_measure(args, ident)["fits"] == {"kept": 1}


def test_an_edited_model_under_the_same_spec_is_profiled_again(tmp_path, monkeypatch, capsys):
    """A --model's profile was keyed on MODULE:FUNCTION alone: after the user changed the model, the
    plan listed the old model's tensors."""
    source = "import torch\nfrom torch import nn\n\ndef build():\n    return nn.Linear(8, {}), torch.randn(4, 8)\n"
    (tmp_path / "edited_model.py").write_text(source.format(16))
    args = args_of("--model", "edited_model:build", "--workers", "2", "--network", "none")
    before = command.identity(args)
    sys.modules.pop("edited_model")     # each run of sparcoll plan is a new process
    assert command.identity(args) == before
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({**before, "model": {}, "fits": {}}))
    args.profile = str(profile)
    assert command.load_or_measure(args, before)["fits"] == {}
    (tmp_path / "edited_model.py").write_text(source.format(32))
    sys.modules.pop("edited_model")
    after = command.identity(args)
    assert after != before and after["fingerprint"] != before["fingerprint"]
    monkeypatch.setattr(command, "measure", lambda ident, timeout: {**ident, "model": {}, "fits": {"new": 1}})
    assert command.load_or_measure(args, after)["fits"] == {"new": 1}
    assert "measured for another model" in capsys.readouterr().err
    assert json.loads(profile.read_text())["fingerprint"] == after["fingerprint"]
    sys.modules.pop("edited_model")


@pytest.mark.parametrize("function, says", [
    ("tupled", "the model must return a tensor (a scalar loss or an output whose sum is the loss), got tuple"),
    ("keyed", "the example input must be a tensor or a tuple of tensors (the model's positional arguments), "
              "got dict"),
    ("double", "parameter weight is torch.float64"),
    ("broken", "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ("missing", "has no function missing"),
    ("argmaxed", "the loss does not depend on any parameter to train"),
    ("parameterless", "the model has no parameter to train"),
    ("refusing", "failed: ValueError: bad size")])
def test_a_model_the_workers_cannot_train_is_refused_before_any_starts(models, tmp_path, capsys, function, says):
    status, err = plan(capsys, "--model", f"{models}:{function}", "--profile", str(tmp_path / "p.json"))
    assert status == 2 and f"sparcoll plan: error: --model '{models}:{function}'" in err and says in err, err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()
    status, err = plan(capsys, "--model", "no_such_module_here:build")
    assert status == 2 and "cannot import no_such_module_here" in err, err


def test_a_model_module_whose_own_import_fails_is_not_said_to_be_missing(importable, capsys):
    """The module is there; a package it imports is not: the error says so, not to fix PYTHONPATH."""
    (importable / "needs_a_package.py").write_text("import no_such_package_anywhere\n")
    status, err = plan(capsys, "--model", "needs_a_package:build")
    assert status == 2 and "importing needs_a_package failed: No module named 'no_such_package_anywhere'" in err
    assert "PYTHONPATH" not in err, err


@pytest.mark.parametrize("text", ["", '{"version": 37, "model": {', "[1, 2]", '{"workers": 2, "tensors": []}'])
def test_a_profile_file_that_is_not_a_profile_is_refused_and_kept(models, tmp_path, capsys, text):
    """Truncated JSON, an empty file, a list or a plan given as --profile: a traceback, or the plan
    overwritten by a profile."""
    path = tmp_path / "not-a-profile.json"
    path.write_text(text)
    for again in ([], ["--reprofile"]):
        status, err = plan(capsys, "--model", f"{models}:plain", "--profile", str(path), "--trial", "0", *again)
        assert status == 2 and f"sparcoll plan: error: --profile {path}: not a sparcoll profile" in err, err
        assert path.read_text() == text


@pytest.mark.parametrize("option", ["--json", "--profile"])
def test_a_file_in_a_missing_directory_is_refused_before_the_work(tmp_path, capsys, option):
    path = tmp_path / "missing" / "file.json"
    status, err = plan(capsys, option, str(path))
    assert status == 2 and f"sparcoll plan: error: {option} {path}: directory {path.parent} does not exist" in err, err


@pytest.mark.parametrize("argv, says", [
    (["--timeout", "0"], "--timeout a positive number of seconds"),
    (["--timeout", "-5"], "--timeout a positive number of seconds"),
    (["--timeout", "inf"], "--timeout a positive number of seconds"),
    (["--network", "fast"], "--network: invalid rate 'fast'"),
    (["--without", "compression", "--uniform", "fp16"], "--uniform fp16 compresses: --without compression"),
    (["--without", "collective", "--uniform", "sparse"], "--uniform sparse is not the ring"),
    # before the profile (before: refused by the plan's making, after minutes of profiling)
    (["--uniform", "topk:0.01"], "no uniform strategy 'topk:0.01': not among --compressors (none, fp16"),
])
def test_contradictory_or_invalid_arguments_are_refused(capsys, argv, says):
    """Refused before anything runs (--network fast: before netem's check for root, which would say
    something else without root)."""
    status = command.run(args_of("--workers", "2", *(["--network", "none"] if "--network" not in argv else []),
                                 *argv))
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("sparcoll plan: error: ") and says in err and "Traceback" not in err, err


def test_an_unused_parameter_is_left_out_of_the_plan_and_named(models, importable, tmp_path, capsys):
    """A parameter forward never uses gets no gradient: the profile crashed on it ('NoneType' object
    has no attribute 'is_sparse'); the plan leaves it out, and says so. A --trial with --uniform is
    not run, and says so too."""
    plan_file, profile = tmp_path / "plan.json", tmp_path / "p.json"
    argv = ["plan", "--model", f"{models}:unused", "--workers", "2", "--network", "none", "--compressors", "none",
            "--profile", profile, "--json", plan_file]
    done = sparcoll_here(capsys, argv + ["--trial", "0"], TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left out of the plan, as backward gives them no gradient (unused in forward): spare.weight, " \
           "spare.bias" in done.stderr
    names = {t["name"] for t in json.loads(plan_file.read_text())["tensors"]}
    assert names == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert json.loads(profile.read_text())["model"]["unused"] == ["spare.weight", "spare.bias"]
    for trial, noted in ((["--trial", "2"], True), ([], False)):    # the stored profile: no job, in this process
        done = sparcoll_here(capsys, argv + ["--uniform", "ring", *trial], TIMEOUT)
        assert done.returncode == 0 and "uniform ring" in done.stdout, done.stderr[-3000:]
        assert ("--trial is not run with --uniform or --without" in done.stderr) == noted, done.stderr
        assert "measured for another model" not in done.stderr and "trial" not in json.loads(plan_file.read_text())
    # the trial's reference, DDP, once failed on such a model (it needs find_unused_parameters)
    done = sparcoll_here(capsys, argv + ["--trial", "1", "--trial-passes", "1"], TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"DDP on gloo \(the reference\) +measured +[0-9.]+ ms", done.stdout), done.stdout
    assert "failed" not in done.stdout, done.stdout
