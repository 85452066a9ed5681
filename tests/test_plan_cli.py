"""`sparcoll plan`'s arguments and its user's model: what it refuses before any work starts, with a
clear error, what it reuses and what it measures again."""
import argparse
import hashlib
import json
import math
import os
import re
import sys

import pytest

from sparcoll.plan import command
from sparcoll.train import command as train_command
from sparcoll.workloads import user
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
    "class Indices(nn.Module):\n"
    "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 2)\n"
    "    def forward(self, x):\n        return {'classes': self.a(x).argmax(1)}\n\n"
    "def indices():\n    return Indices(), torch.randn(4, 8)\n\n"
    "def listed():\n    return nn.Linear(8, 2), {'input': [torch.randn(4, 8)]}\n\n"
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


TENSOR = {"numel": 4096, "shape": [64, 64], "linear": False, "rows": 0, "coo": False, "density": 1.0, "union": 1.0}
CURVE = [[1.0, 1e6], [1e-4, 1e-2]]      # 0.1 ms for a byte (or an element), 10 ms for a million


def measured(ident: dict, **model) -> dict:
    """A stored profile of `ident` (command.identity), made by hand: two tensors of 4096 elements,
    every collective and fp16 on CURVE; `model` replaces its measurements'."""
    return {**ident, "model": {"order": ["b", "a"], "ready": [0.001, 0.002], "backward_end": 0.003,
                               "optimizer": 0.001, "forward": 0.004, "cores_per_worker": 1.0,
                               "tensors": {"a": TENSOR, "b": TENSOR}, **model},
            "fits": {"collectives": dict.fromkeys(["ring", "ps", "allgather", "sparse"], CURVE),
                     "compress": {"fp16": CURVE}, "decompress": {"fp16": CURVE}}}


def test_a_stored_profile_with_a_list_valued_workload_option_is_reused(tmp_path, monkeypatch, capsys):
    """`--workload-option hidden=64,32` is a tuple in the identity and a list in the stored JSON:
    they never compared equal, and every run measured the profile again (minutes of jobs)."""
    args = args_of("--workload", "deeplight", "--workload-option", "hidden=64,32", "--workers", "2",
                   "--network", "none")
    ident = command.identity(args)
    assert ident["options"] == {"hidden": (64, 32)}, ident
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({**measured(ident), "kept": 1}))
    args.profile = str(profile)
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    assert command.load_or_measure(args, ident)["kept"] == 1


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
    profile.write_text(json.dumps(measured(before)))
    args.profile = str(profile)
    assert command.load_or_measure(args, before)["fingerprint"] == before["fingerprint"]
    (tmp_path / "edited_model.py").write_text(source.format(32))
    sys.modules.pop("edited_model")
    after = command.identity(args)
    assert after != before and after["fingerprint"] != before["fingerprint"]
    monkeypatch.setattr(command, "measure", lambda ident, timeout: {**ident, "model": {}, "fits": {"new": 1}})
    assert command.load_or_measure(args, after)["fits"] == {"new": 1}
    assert f"measured for fingerprint \"{before['fingerprint']}\" (this run: \"{after['fingerprint']}\")" \
        in capsys.readouterr().err
    assert json.loads(profile.read_text())["fingerprint"] == after["fingerprint"]
    sys.modules.pop("edited_model")


@pytest.mark.parametrize("function, says", [
    ("indices", "the model must return a scalar loss, or tensors whose sum is the loss (in a tuple, list or "
                "dict), got a dict of classes: Tensor with no floating-point tensor"),
    ("listed", "the example input must be a tensor, a tuple of tensors (the model's positional arguments) or a "
               "dict of tensors by name (its keyword arguments), got a dict of input: list"),
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
    # a review: ignored without a word (and not part of the stored profile's identity either)
    (["--model", "mymodel:build", "--batch-size", "7"], "--batch-size, --workload-option and --seed are --workload's"),
    (["--model", "mymodel:build", "--workload-option", "bogus=1"], "--workload-option and --seed are --workload's"),
    # a review: the plan overwrote the profile it was made from
    (["--json", "same.json", "--profile", "./same.json"], "--json and --profile both name same.json: --json would overwrite --profile"),
])
def test_contradictory_or_invalid_arguments_are_refused(capsys, argv, says):
    """Refused before anything runs (--network fast: before netem's check for root, which would say
    something else without root)."""
    status = command.run(args_of("--workers", "2", *(["--network", "none"] if "--network" not in argv else []),
                                 *argv))
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("sparcoll plan: error: ") and says in err and "Traceback" not in err, err


def test_a_workload_and_a_model_together_are_refused_even_if_the_workload_is_the_default(capsys):
    """argparse lets a value equal to an option's default pass beside a mutually exclusive one:
    `--workload ncf --model m:f` planned m:f without a word (a review)."""
    for workload in ("ncf", "gpt"):
        with pytest.raises(SystemExit):
            args_of("--workload", workload, "--model", "mymodel:build")
        assert "--model: not allowed with argument --workload" in capsys.readouterr().err
    assert command.identity(args_of("--workers", "2", "--network", "none"))["workload"] == "ncf"


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
        assert "measuring again" not in done.stderr and "trial" not in json.loads(plan_file.read_text())
    # the trial's reference, DDP, once failed on such a model (it needs find_unused_parameters)
    done = sparcoll_here(capsys, argv + ["--trial", "1", "--trial-passes", "1"], TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"DDP on gloo \(the reference\) +measured +[0-9.]+ ms", done.stdout), done.stdout
    assert "failed" not in done.stdout, done.stdout


def test_a_stored_profile_is_reused_whatever_the_order_of_compressors_and_else_says_what_differs(
        tmp_path, monkeypatch, capsys):
    """--compressors fp16,topk:0.01 and topk:0.01,fp16 measure the same: the second measured again; and
    a profile of another worker count and network said "another model, worker count or network"."""
    args = args_of("--workers", "2", "--network", "none", "--compressors", "topk:0.01,fp16",
                   "--profile", str(tmp_path / "p.json"))
    ident = command.identity(args)
    assert ident == command.identity(args_of("--workers", "2", "--network", "none", "--compressors", "fp16,topk:0.01"))
    stored = measured(ident)
    (tmp_path / "p.json").write_text(json.dumps({**stored, "compressors": ["none", "topk:0.01", "fp16"]}))
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    assert command.load_or_measure(args, ident)["compressors"] == ["none", "topk:0.01", "fp16"]
    (tmp_path / "p.json").write_text(json.dumps({**stored, "workers": 4, "network": "1gbit"}))
    monkeypatch.setattr(command, "measure", lambda ident, timeout: measured(ident))
    command.load_or_measure(args, ident)
    err = capsys.readouterr().err
    assert f"{tmp_path / 'p.json'} was measured for workers 4 (this run: 2), network \"1gbit\" (this run: " \
           f"\"none\"); measuring again" in err, err


@pytest.mark.parametrize("damage, says", [
    (lambda p: p["model"].update(ready=[math.nan, 0.002]), "model.ready[0] is nan, not a finite number >= 0"),
    (lambda p: p["model"].pop("order"), "model.order is missing"),
    (lambda p: p["model"].update(backward_end="0.003"), 'model.backward_end is "0.003", not a number'),
    (lambda p: p.update(fits={}), "fits.collectives is missing"),
    (lambda p: p["model"]["ready"].pop(), "model.ready has 1 times for 2 tensors"),
    (lambda p: p["model"]["tensors"].update(a={**TENSOR, "numel": -5}), "model.tensors.a.numel is -5"),
    (lambda p: p["model"].update(order=["b", "b"]), "model.order lists 2 tensors and model.tensors 2, not each once"),
    (lambda p: p["fits"]["collectives"].update(ring=[[1.0, 2.0], [1e-4]]), "fits.collectives.ring is not a curve"),
    # a review: these went into the decision, or the plan, without a word
    (lambda p: p["model"]["tensors"].update(a={**TENSOR, "density": 7.5}),
     "model.tensors.a.density is 7.5, not a share between 0 and 1"),
    (lambda p: p["model"]["tensors"].update(a={**TENSOR, "numel": 1000}),
     "model.tensors.a.numel is 1000, its shape [64, 64] holds 4096"),
    (lambda p: p["model"].update(cores_per_worker=0), "model.cores_per_worker is 0, not a share of the cores above 0"),
])
def test_a_damaged_stored_profile_is_refused_naming_what_is_wrong(tmp_path, monkeypatch, capsys, damage, says):
    """A stored profile of the right identity edited by hand or damaged: before, NaN ready times made a
    plan of NaN with exit status 0, the others a traceback (KeyError, TypeError, IndexError, math domain
    error). Neither measured again nor overwritten; --reprofile measures it again."""
    argv = ["--workload", "ncf", "--compressors", "fp16", "--trial", "0", "--profile", str(tmp_path / "p.json"),
            "--json", str(tmp_path / "plan.json")]
    ident = command.identity(args_of("--workers", "2", "--network", "none", *argv))
    (tmp_path / "p.json").write_text(json.dumps(measured(ident)))
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    status, err = plan(capsys, *argv)
    assert status == 0 and json.loads((tmp_path / "plan.json").read_text())["predicted_step_s"] > 0, err
    profile = measured(ident)
    damage(profile)
    text = json.dumps(profile)
    (tmp_path / "p.json").write_text(text)
    status, err = plan(capsys, *argv)
    assert status == 2 and f"sparcoll plan: error: {tmp_path / 'p.json'} is not a valid sparcoll profile: {says}" \
        in err and err.rstrip().endswith("; run with --reprofile") and "Traceback" not in err, err
    assert (tmp_path / "p.json").read_text() == text
    monkeypatch.setattr(command, "measure", lambda ident, timeout: measured(ident))
    assert plan(capsys, *argv, "--reprofile")[0] == 0
    assert json.loads((tmp_path / "p.json").read_text()) == measured(ident)


def test_a_stored_profile_without_a_collective_the_plan_prices_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    """From a review: a TypeError's traceback from the cost model."""
    argv = ["--workload", "ncf", "--compressors", "fp16", "--trial", "0", "--profile", str(tmp_path / "p.json")]
    profile = measured(command.identity(args_of("--workers", "2", "--network", "none", *argv)))
    del profile["fits"]["collectives"]["ring"]
    (tmp_path / "p.json").write_text(json.dumps(profile))
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    status, err = plan(capsys, *argv)
    assert status == 2 and "sparcoll plan: error: the profile has no measurement of the ring collective " \
                           "(fits.collectives.ring): edited or damaged? run with --reprofile" in err, err
    assert "Traceback" not in err


def test_a_profile_measured_at_another_block_size_is_measured_again(tmp_path, monkeypatch, capsys):
    """From a review: one measured with $SPARCOLL_BLOCK_SIZE=512 was reused without it, and its plan
    then refused by `sparcoll train` ("made for block_size 512") though nobody had asked for 512. One
    stored before the block size was part of its identity is known by its model's."""
    args = args_of("--workers", "2", "--network", "none", "--profile", str(tmp_path / "p.json"))
    monkeypatch.delenv("SPARCOLL_BLOCK_SIZE", raising=False)
    ident = command.identity(args)
    stored = measured(ident, block_size=256)
    older = {k: v for k, v in stored.items() if k != "block_size"}
    (tmp_path / "p.json").write_text(json.dumps(older))
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    assert command.load_or_measure(args, ident) == older
    monkeypatch.setenv("SPARCOLL_BLOCK_SIZE", "512")
    monkeypatch.setattr(command, "measure", lambda ident, timeout: measured(ident))
    assert command.load_or_measure(args, command.identity(args))["block_size"] == 512
    assert "was measured for block_size 256 (this run: 512); measuring again" in capsys.readouterr().err


def test_a_profile_reused_on_a_machine_with_other_cores_per_worker_says_so(tmp_path, monkeypatch, capsys):
    """From a review: a profile from another machine (a shared home directory's default path) was
    reused without a word, its CPU bound another machine's."""
    args = args_of("--workers", "2", "--network", "none", "--profile", str(tmp_path / "p.json"))
    ident = command.identity(args)
    here = len(os.sched_getaffinity(0)) / 2
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("measured again"))
    for cores, noted in ((here, False), (here * 3, True)):
        (tmp_path / "p.json").write_text(json.dumps(measured(ident, cores_per_worker=cores)))
        assert command.load_or_measure(args, ident)["model"]["cores_per_worker"] == cores
        err = capsys.readouterr().err
        assert (f"was measured with {cores:g} cores per worker, this machine has {here:g}" in err) == noted, err


def test_a_repeated_without_and_a_collective_in_capitals_are_read_as_meant():
    args = args_of("--workers", "2", "--network", "none", "--trial", "0", "--uniform", " Ring", "--without", "offload",
                   "--without", "offload")
    command.check(args)
    assert args.uniform == "ring" and args.without == ["offload"]


def test_uniform_none_is_refused_before_the_profile_naming_the_uncompressed_uniform_strategies(
        monkeypatch, capsys):
    """--uniform none passed the checks and was refused only after the profile's minutes, as "no
    tensor of this model can take it": the uncompressed uniform strategies go by their collective."""
    monkeypatch.setattr(command, "measure", lambda ident, timeout: pytest.fail("profiled"))
    status, err = plan(capsys, "--workload", "ncf", "--uniform", "none")
    assert status == 2 and "sparcoll plan: error: --uniform none: every tensor uncompressed is --uniform ring " \
                           "(or another collective: ps, sparse, sfb)" in err, err


EMBEDDINGS = ("import torch\nfrom torch import nn\n\n"
              "def build(sparse):\n"
              "    torch.manual_seed(0)\n"
              "    model = nn.Sequential(nn.Embedding(100, 8, sparse=sparse), nn.Linear(8, 1))\n"
              "    return model, torch.randint(0, 100, (4,))\n"
              "\ndef dense():\n    return build(False)\n\ndef sparse():\n    return build(True)\n")


def test_a_models_fingerprint_tells_sparse_embedding_gradients_from_dense(importable):
    """nn.Embedding(sparse=True) and (sparse=False) have the same names, shapes and dtypes: a profile of
    the dense model was reused for the sparse one, whose embedding travels as COO rows. A dense
    model's fingerprint stays as it was (its stored profile still matches): the hash of each
    parameter's name, shape, dtype and requires_grad and the input's shapes and dtypes."""
    (importable / "embedded.py").write_text(EMBEDDINGS)
    dense, sparse = (user.checked_here(f"embedded:{f}") for f in ("dense", "sparse"))
    assert user.fingerprint(dense) != user.fingerprint(sparse)
    described = [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in dense.model.named_parameters()]
    described.append([[list(x.shape), str(x.dtype)] for x in dense.batch])
    assert user.fingerprint(dense) == hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def test_a_plan_records_the_network_burst_and_block_size_it_was_priced_at_and_train_refuses_others(tmp_path):
    """`sparcoll train --comm planned` compared only the workload, workers and batch size: a plan
    priced on another network, link burst or block size ran without a word. A plan of an older
    sparcoll, without those fields, still runs."""
    ident = command.identity(args_of("--workload", "ncf", "--workers", "2", "--network", "1gbit",
                                     "--link-burst", "128K"))
    made = command.make_plan(measured(ident, block_size=512), ["none"])
    assert (made["network"], made["link_burst"], made["block_size"]) == ("1gbit", 131072, 512)
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    path = tmp_path / "plan.json"

    def load(plan: dict, *argv: str) -> dict:
        path.write_text(json.dumps(plan))
        args = parser.parse_args(["--comm", "planned", "--plan", str(path), "--workers", "2", "--batch-size", "256",
                                  *argv])
        return train_command.load_plan(args, [("planned", None)], train_command.workload_options("ncf", []))

    assert load(made, "--network", "1gbit", "--link-burst", "128K", "--block-size", "512") is not None
    for argv, says in ((["--network", "none", "--block-size", "512"], "made for network 1gbit, this run has none"),
                       (["--block-size", "512"], "made for link_burst 131072, this run has the default"),
                       (["--link-burst", "128K", "--block-size", "256"], "made for block_size 512, this run has 256")):
        with pytest.raises(ValueError, match=f"^{re.escape(f'{path} was {says}')}$"):
            load(made, *argv)
    old = {k: v for k, v in made.items() if k not in ("network", "link_burst", "block_size")}
    assert load(old, "--network", "none")["tensors"] == made["tensors"]
