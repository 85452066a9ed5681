"""`sparcoll train`: short runs of every workload and mode on loopback, checked through the JSON report,
and --compare's loss curves; plus the option parsing and the density measure."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from sparcoll.bench.launch import BenchError
from sparcoll.cli import main
from sparcoll.bench.memory import FAULTING_PAGES
from sparcoll.train.command import _option, load_plan, timed_steps, workload_options
from sparcoll.train.worker import GradientProbe, block_density, nonzero_elements, synchronization
from support import sparcoll_here

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)

TIMEOUT = 150
TINY = ["--workers", "2", "--network", "none", "--batch-size", "8", "--workload-option", "tiny=true"]


def train(tmp_path, capfd, *argv: str) -> dict:
    """Run the command (in this process: support.sparcoll_here); return its JSON report."""
    out = tmp_path / "out.json"
    proc = sparcoll_here(capfd, ["train", *argv, "--json", out], TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def check_run(run: dict, comm: str, steps: int) -> None:
    assert run["comm"] == comm
    assert len(run["loss"]) == steps and all(math.isfinite(x) for x in run["loss"])
    assert run["timed_steps"] == steps - 1 and run["samples_per_s"] > 0
    assert run["step_s"] == pytest.approx(run["compute_s"] + run["comm_s"])
    assert 0 <= run["comm_s"] <= run["step_s"] <= run["slowest_step_s"]     # the ranks' mean step, their slowest
    # densities are probed on the first step (the warm-up: no probed step is timed)
    assert run["per_step"]["probed"] == [True] + [False] * (steps - 1)
    assert 0 < run["per_step"]["density_local"][0] <= 1 and 0 < run["per_step"]["density_union"][0] <= 1
    assert run["per_step"]["density_local"][1:] == run["per_step"]["density_union"][1:] == [None] * (steps - 1)
    assert (run["density_local"], run["density_union"]) == \
        (run["per_step"]["density_local"][0], run["per_step"]["density_union"][0])
    faults = run["per_step"]["page_faults"]
    assert len(faults) == steps and all(isinstance(f, int) and f >= 0 for f in faults)
    timed = faults[1:]      # the first step is the warm-up and the probed one
    assert run["most_page_faults"] == max(timed)
    assert run["faulting_steps"] == sum(f >= FAULTING_PAGES for f in timed)
    # every step took some CPU on its busiest rank; the run's figure is the timed steps' mean
    cpu = run["per_step"]["cpu_s"]
    assert len(cpu) == steps and all(c > 0 for c in cpu)
    assert run["cpu_s"] == pytest.approx(sum(cpu[1:]) / (steps - 1))
    mean = run["per_step"]["cpu_mean_s"]      # the ranks' mean, at most the busiest rank's
    assert len(mean) == steps and all(0 < m <= c for m, c in zip(mean, cpu))
    thread = run["per_step"]["training_thread_cpu_s"]     # of it the training thread's: part of the process's
    assert len(thread) == steps and all(0 < t <= m + 1e-9 for t, m in zip(thread, mean))
    assert run["training_thread_cpu_s"] == pytest.approx(sum(thread[1:]) / (steps - 1))
    reference = run["per_step"]["reference_cpu_s"]
    assert len(reference) == steps and all(r > 0 for r in reference)


# ncf runs in the --compare test; cnn on the sparcoll backend also exercises the per-forward broadcast
# of BatchNorm buffers.
@pytest.mark.parametrize("workload, comm", [("deeplight", "agsparse"), ("lstm", "hook"), ("cnn", "sparcoll")])
def test_each_workload_trains(tmp_path, workload, comm, capfd):
    report = train(tmp_path, capfd, "--workload", workload, "--comm", comm, "--steps", "3", *TINY)
    assert report["workload"] == workload
    (run,) = report["runs"]
    check_run(run, comm, 3)


def test_compare_runs_sparcoll_and_ddp_to_the_same_losses(tmp_path, capfd):
    report = train(tmp_path, capfd, "--workload", "ncf", "--compare", "--steps", "4", *TINY,
                   "--workload-option", "num_users=3000", "--workload-option", "num_items=1000")
    sparcoll_run, ddp_run = report["runs"]
    check_run(sparcoll_run, "sparcoll", 4)
    check_run(ddp_run, "ddp", 4)
    assert sparcoll_run["density_union"] < 0.5          # block-sparse: the embedding rows looked up
    assert sparcoll_run["density_local"] <= sparcoll_run["density_union"]
    assert sparcoll_run["loss"] == pytest.approx(ddp_run["loss"], abs=1e-5)
    assert report["compare"]["baseline"] == "ddp"
    (versus,) = report["compare"]["modes"]
    assert versus["label"] == "sparcoll" and versus["max_loss_difference"] < 1e-5
    assert versus["speedup"] == pytest.approx(ddp_run["step_s"] / sparcoll_run["step_s"])
    # no held-out split: the final loss is the last tenth of the steps' training loss (1 of 4)
    assert ddp_run["final_loss"] == ddp_run["loss"][-1]
    assert ddp_run["final_loss_kind"] == "training, mean of the last 1 steps"
    assert abs(versus["final_loss_difference"]) < 1e-5


def test_final_loss_is_the_held_out_loss_where_the_workload_has_one(tmp_path, capfd):
    """gpt evaluates on its held-out split after the last step: the same parameters (DDP, the
    uncompressed hook) give the same held-out loss, which is none of the training losses."""
    from sparcoll.train.command import final_loss

    report = train(tmp_path, capfd, "--workload", "gpt", "--steps", "3", *TINY,
                   "--compare", "ddp,hook:compress=none,hook:compress=signsgd")
    ddp, plain, signs = report["runs"]
    assert ddp["final_loss_kind"] == "held-out" and math.isfinite(ddp["final_loss"])
    assert plain["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    assert ddp["final_loss"] not in ddp["loss"] and signs["final_loss"] != ddp["final_loss"]
    versus = {m["label"]: m for m in report["compare"]["modes"]}
    assert versus["hook:signsgd"]["final_loss_difference"] == pytest.approx(
        (signs["final_loss"] - ddp["final_loss"]) / ddp["final_loss"])
    assert final_loss([9.0] * 18 + [1.0, 2.0], None)[0] == 1.5     # the last tenth: 2 of 20


def test_compare_compressed_hooks_against_ddp(tmp_path, capfd):
    """--compare with compressors: each run says its spec; without compression ("none") the hook's
    losses equal DDP's, with error-feedback top-k they differ but stay finite."""
    report = train(tmp_path, capfd, "--workload", "ncf", "--steps", "3", *TINY, "--compare",
                   "ddp,hook:compress=none,hook:compress=topk:0.1,ef=on,hook:compress=blocktopk:0.1")
    labels = [r["label"] for r in report["runs"]]
    assert labels == ["ddp", "hook:none", "hook:topk:0.1,ef=on", "hook:blocktopk:0.1"]
    for run in report["runs"]:
        check_run(run, run["comm"], 3)
        assert run["bytes_sent_per_step"] is None          # loopback: no interface counters
    ddp, plain = report["runs"][:2]
    assert plain["compress"] == "none" and plain["loss"] == pytest.approx(ddp["loss"], abs=1e-5)
    assert [m["label"] for m in report["compare"]["modes"]] == labels[1:]


def test_interleaved_modes_train_as_they_do_apart(tmp_path, capfd):
    """--interleave runs the modes in one job, a step of each in turn: every mode's losses equal its
    run in a job of its own (a lossy one's too, so no step of one mode counts as another's), and each
    mode is compared with the baseline step by step."""
    modes = "ddp,hook:compress=signsgd,poseidon:strategy=ring"
    apart = train(tmp_path, capfd, "--workload", "ncf", "--steps", "4", *TINY, "--compare", modes)
    (tmp_path / "out.json").unlink()
    together = train(tmp_path, capfd, "--workload", "ncf", "--steps", "4", *TINY, "--compare", modes,
                     "--interleave")
    assert together["interleaved"] and not apart["interleaved"]
    assert [r["label"] for r in together["runs"]] == ["ddp", "hook:signsgd", "poseidon:ring"]
    for one, other in zip(apart["runs"], together["runs"]):
        check_run(other, one["comm"], 4)
        assert other["loss"] == pytest.approx(one["loss"], abs=1e-6)
    ddp, signs, ring = together["runs"]
    assert signs["loss"] != pytest.approx(ddp["loss"], abs=1e-6)      # lossy: its own curve
    assert ring["trace"]["tensors"] and "trace" not in ddp
    for versus, run in zip(together["compare"]["modes"], (signs, ring)):
        paired = versus["paired"]
        base, mine = ddp["per_step"]["step_s"][1:], run["per_step"]["step_s"][1:]    # the timed steps
        ratios = [a / b for a, b in zip(base, mine)]
        assert paired["steps"] == 3 and paired["median"] == pytest.approx(sorted(ratios)[1])
        assert paired["ratio"] == pytest.approx(sum(base) / sum(mine))
        assert min(ratios) <= paired["low"] <= paired["ratio"] <= paired["high"] <= max(ratios)
    assert all("paired" not in m for m in apart["compare"]["modes"])


FRESH_MEMORY = """
import torch
from sparcoll.bench.memory import minor_faults
before = minor_faults()
fresh = torch.empty(16 << 20)
fresh.fill_(1.0)
first = minor_faults() - before
before = minor_faults()
fresh.fill_(2.0)
print(first, minor_faults() - before)
"""


def test_minor_faults_count_the_pages_of_fresh_memory_written():
    """A 64 MiB tensor, above glibc's mmap threshold, is fresh memory: filling it faults each of its
    16384 pages of 4 KiB in (the count each step reports, the most over the ranks); written again, its
    pages are there. In a process of its own: this one may hold freed memory to reuse (a test that
    kept freed memory, sparcoll.allocator)."""
    proc = subprocess.run([sys.executable, "-c", FRESH_MEMORY], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again = map(int, proc.stdout.split())
    assert first >= 16000 and again < 100


def test_steps_that_took_fresh_memory_are_also_left_out_of_a_second_comparison():
    """Interleaved runs are compared over every timed step, and again over the steps in which neither
    took fresh memory (a heap that grew faults a large block in: the step is slow for that)."""
    from sparcoll.train.command import compare_paired, paired_steps

    def run(times, faults):
        return {"per_step": {"step_s": times, "probed": [True] + [False] * (len(times) - 1),
                             "page_faults": faults}}

    base = run([9.0, 2.0, 2.0, 2.0, 2.0], [30000, 5, 5, 5, 5])
    other = run([9.0, 1.0, 3.0, 1.0, 1.0], [30000, 5, FAULTING_PAGES, 5, 5])    # step 2 grew the heap
    assert paired_steps(base, other, 1) == ([2.0] * 4, [1.0, 3.0, 1.0, 1.0])
    assert paired_steps(base, other, 1, fresh_memory=False) == ([2.0] * 3, [1.0] * 3)
    both = compare_paired(base, other, 1)
    assert both["paired"]["ratio"] == pytest.approx(8 / 6)
    assert both["paired_without_fresh_memory"]["ratio"] == pytest.approx(2.0)
    assert both["paired_without_fresh_memory"]["steps"] == 3
    calm = run([9.0, 1.0, 1.0, 1.0, 1.0], [30000, 5, 5, 5, 5])
    assert set(compare_paired(base, calm, 1)) == {"paired"}     # nothing left out: one comparison


def test_paired_ratio_and_the_interleaved_order():
    from sparcoll.train.command import paired_ratio
    from sparcoll.train.worker import interleaved_order

    p = paired_ratio([2.0, 4.0, 6.0, 9.0], [1.0, 2.0, 2.0, 3.0])     # ratios 2, 2, 3, 3
    assert (p["steps"], p["ratio"], p["median"]) == (4, 21 / 8, 2.5)
    assert 2.0 <= p["low"] < p["ratio"] < p["high"] <= 3.0
    assert p == paired_ratio([2.0, 4.0, 6.0, 9.0], [1.0, 2.0, 2.0, 3.0])     # a fixed seed
    same = paired_ratio([1.1] * 5, [1.0] * 5)
    assert same["low"] == same["ratio"] == same["high"] == same["median"] == pytest.approx(1.1)
    orders = [interleaved_order(3, 7, step) for step in range(20)]
    assert all(sorted(o) == [0, 1, 2] for o in orders) and len({tuple(o) for o in orders}) > 1
    assert orders == [interleaved_order(3, 7, step) for step in range(20)]     # every rank alike
    assert orders != [interleaved_order(3, 8, step) for step in range(20)]


def test_modes_parse_and_refuse_what_cannot_run():
    from sparcoll.train.command import _split_modes, parse_mode

    assert _split_modes("ddp, hook:compress=topk:0.01,ef=off,sparcoll") == \
        [("ddp", None), ("hook", "topk:0.01,ef=off"), ("sparcoll", None)]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_mode("fast")
    with pytest.raises(ValueError, match="hook:compress"):
        parse_mode("sparcoll:compress=topk:0.01")
    with pytest.raises(ValueError, match="unknown compressor"):
        parse_mode("hook:compress=zip")
    assert _split_modes("ddp,poseidon:strategy=sfb,poseidon,poseidon:strategy=topk:0.1,ef=off") == \
        [("ddp", None), ("poseidon", "sfb"), ("poseidon", None), ("poseidon", "topk:0.1,ef=off")]
    with pytest.raises(ValueError, match="unknown compressor"):
        parse_mode("poseidon:strategy=zip")
    with pytest.raises(ValueError, match="poseidon:strategy"):
        parse_mode("ddp:strategy=sfb")


def test_bad_arguments_exit_with_2(capsys):
    assert main(["train", "--steps", "0", "--network", "none"]) == 2
    assert "--steps" in capsys.readouterr().err
    # before, each worker failed on these and the command printed every log's traceback
    assert main(["train", "--timeout", "nan", "--network", "none"]) == 2
    assert "--timeout a positive number of seconds" in capsys.readouterr().err
    assert main(["train", "--block-size", "131072", "--network", "none"]) == 2
    assert "--block-size must be at most 65536, got 131072" in capsys.readouterr().err
    assert main(["train", "--compare", "ddp,hook", "--compress", "topk:0.01", "--network", "none"]) == 2
    assert "--compress would be ignored: --compare names each mode" in capsys.readouterr().err
    assert main(["train", "--data", "/nonexistent/sparcoll-data.txt", "--network", "none"]) == 2
    assert "--data /nonexistent/sparcoll-data.txt: no such file" in capsys.readouterr().err
    assert main(["train", "--compress", "topk:0.01", "--network", "none"]) == 2
    assert "--comm hook" in capsys.readouterr().err
    # a review: the run's results overwrote the plan it ran
    assert main(["train", "--comm", "planned", "--plan", "p.json", "--json", "./p.json", "--network", "none"]) == 2
    assert "--json and --plan both name ./p.json: --json would overwrite --plan" in capsys.readouterr().err
    assert main(["train", "--interleave", "--network", "none"]) == 2
    assert "--interleave needs --compare with two modes" in capsys.readouterr().err
    assert main(["train", "--compare", "ddp,sparcoll", "--interleave", "--network", "none"]) == 2
    assert "--interleave cannot run the sparcoll mode" in capsys.readouterr().err
    # before: a traceback after running no job (an empty --compare); each worker's torch error, or
    # a run to a nan loss that exited 0 (--lr) (a review)
    for empty in ("", ","):
        assert main(["train", "--compare", empty, "--network", "none"]) == 2
        assert "no mode given" in capsys.readouterr().err
    for option, says in (("num_users=-5", "negative dimension -5"), ("dropout=2", "dropout must be in [0, 1)")):
        workload = "ncf" if "users" in option else "vgg"
        assert main(["train", "--workload", workload, "--workload-option", option, "--network", "none"]) == 2
        assert f"--workload-option {option}" in (err := capsys.readouterr().err) and says in err, err
    for lr in ("-1", "0", "nan"):
        assert main(["train", "--lr", lr, "--network", "none"]) == 2
        assert "--lr must be a positive number" in capsys.readouterr().err
    # the links' token bucket shapes an emulated network, of at least one 64 KiB packet (plan alike)
    for command in ("train", "plan"):
        assert main([command, "--link-burst", "128K", "--network", "none"]) == 2
        assert "--link-burst shapes the emulated links" in capsys.readouterr().err
        assert main([command, "--link-burst", "1500", "--network", "1gbit"]) == 2
        assert "at least 65536 bytes" in capsys.readouterr().err


def test_workload_options():
    assert _option("hidden=64,32") == ("hidden", (64, 32))
    assert _option("hidden=16,") == ("hidden", (16,))
    assert _option("tiny=true") == ("tiny", True)
    assert _option("zipf_exponent=1.2") == ("zipf_exponent", 1.2)
    assert _option("name=abc") == ("name", "abc")
    lstm = workload_options("lstm", [("embed_dim", 32)])
    assert lstm["tie_weights"] is False and lstm["vocab_size"] == 10_000 and lstm["embed_dim"] == 32
    assert "vocab_size" not in workload_options("lstm", [("tiny", True)])
    assert workload_options("ncf", []) == {}


def test_workload_options_are_checked_against_the_workload_before_any_worker_builds_it(capsys):
    """A field the workload's config lacks, or a value not of its type, is refused by name in the parent
    (a worker would fail with a TypeError, or take the string 'maybe' for a true bool)."""
    assert workload_options("ncf", [("tiny", "yes"), ("sparse_embeddings", 0), ("user_zipf", 1),
                                    ("mlp_layers", (8, 4)), ("max_rows", None)]) == \
        {"tiny": True, "sparse_embeddings": False, "user_zipf": 1.0, "mlp_layers": (8, 4), "max_rows": None}
    assert workload_options("vgg", [("hidden", (64, 32))]) == {"hidden": (64, 32)}
    with pytest.raises(ValueError, match="ncf has no such option; its options are tiny, sparse_embeddings, "
                                         "num_users"):
        workload_options("ncf", [("hidden", (64, 32))])
    for key, value, kind in (("tiny", "maybe", r"bool \(true or false\)"), ("num_users", 1.5, "int"),
                             ("num_users", True, "int"), ("mlp_layers", 64, r"tuple\[int, ...\] \(comma"),
                             ("max_rows", "all", r"int \| None"), ("sparse_embeddings", 2, "bool")):
        with pytest.raises(ValueError, match=f"--workload-option {key}={value!r}: ncf's {key} is of type {kind}"):
            workload_options("ncf", [(key, value)])
    assert main(["train", "--network", "none", "--workload-option", "hidden=64,32"]) == 2
    assert "sparcoll train: error: --workload-option hidden: ncf has no such option" in capsys.readouterr().err


def test_a_plan_is_refused_for_other_workload_options_or_for_a_users_model(tmp_path, capsys):
    """The planned mode runs a plan only on the model it was made for: the options are compared as the
    plan's JSON holds them (tuples as lists); a plan of `sparcoll plan --model` is not a workload's."""
    from argparse import Namespace

    args = Namespace(plan=str(tmp_path / "plan.json"), workload="ncf", workers=2, batch_size=8, json=None)
    planned = [("planned", None)]

    def plan_for(**made) -> None:
        (tmp_path / "plan.json").write_text(json.dumps({"workers": 2, "tensors": [], **made}))

    tiny = [("tiny", True), ("mlp_layers", (8, 4))]
    plan_for(workload="ncf", batch_size=8, options=workload_options("ncf", tiny))
    assert load_plan(args, planned, workload_options("ncf", tiny))["workload"] == "ncf"
    with pytest.raises(ValueError, match="made with the workload options tiny=True, mlp_layers=\\[8, 4\\], this "
                                         "run has tiny=True, mlp_layers=\\[8, 4\\], sparse_embeddings=True"):
        load_plan(args, planned, workload_options("ncf", tiny + [("sparse_embeddings", True)]))
    with pytest.raises(ValueError, match="this run has none"):
        load_plan(args, planned, workload_options("ncf", []))
    plan_for(model_spec="mymodels:build")
    with pytest.raises(ValueError, match="made for the model mymodels:build \\(sparcoll plan --model\\), this "
                                         "run trains the workload ncf"):
        load_plan(args, planned, {})
    # in the parent, before any worker: bad arguments
    assert main(["train", "--comm", "planned", "--plan", args.plan, "--workers", "2", "--network", "none"]) == 2
    assert "was made for the model mymodels:build" in capsys.readouterr().err


def test_a_json_report_in_a_missing_directory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from sparcoll.train import command

    monkeypatch.setattr(command, "run_job", FakeJobs(4, crashes=0))
    missing = tmp_path / "no" / "r.json"
    assert main(["train", "--network", "none", "--steps", "4", "--json", str(missing)]) == 2
    assert f"--json {missing}: directory {missing.parent} does not exist" in capsys.readouterr().err
    assert main(["train", "--network", "none", "--steps", "4", "--json", str(tmp_path / "r.json")]) == 0
    assert len(json.loads((tmp_path / "r.json").read_text())["runs"][0]["loss"]) == 4


def test_a_warm_up_that_leaves_no_step_to_time_is_refused(capsys):
    for warmup in ("3", "5"):
        assert main(["train", "--network", "none", "--steps", "3", "--warmup", warmup]) == 2
        assert f"--warmup {warmup} leaves none of the --steps 3 to time" in capsys.readouterr().err


def test_one_step_runs_and_is_timed_without_a_warmup_given(tmp_path, monkeypatch):
    """The default warm-up (1 step) leaves a one-step run (a smoke test) its step, not an error."""
    from sparcoll.train import command

    for steps, warmup in ((1, 0), (2, 1)):
        monkeypatch.setattr(command, "run_job", FakeJobs(steps, crashes=0))
        out = tmp_path / f"{steps}.json"
        assert main(["train", "--network", "none", "--steps", str(steps), "--json", str(out)]) == 0
        assert json.loads(out.read_text())["warmup"] == warmup


def test_a_misspelled_mode_among_several_is_named_alone(capsys):
    """A comma continues a mode's spec only after a mode with one (hook:compress=topk:0.01,ef=off)."""
    from sparcoll.train.command import _split_modes

    for modes in ("ddp,posiedon", "posiedon,ddp", "hook:compress=none,ddp,posiedon", "poseidon:strategy=sfb,posiedon",
                  "hook:compress=topk:0.01,ef=off,posiedon"):
        with pytest.raises(ValueError, match="^unknown mode 'posiedon'; modes are sparcoll, ddp, hook"):
            _split_modes(modes)
    assert main(["train", "--network", "none", "--compare", "ddp,posiedon"]) == 2
    assert "error: unknown mode 'posiedon';" in capsys.readouterr().err


def test_the_gradient_probe_leaves_frozen_parameters_out():
    """A frozen parameter has no gradient to hook or to send (`sparcoll plan --model`'s trial trains
    a user's model with one): the probe sees the trained ones, and its densities are theirs alone."""
    model = torch.nn.Linear(4, 1)
    model.weight.requires_grad_(False)
    probe = GradientProbe(list(model.parameters()), 1)
    probe.reset(marking=True)
    model(torch.ones(2, 4)).sum().backward()
    assert probe.params == [model.bias] and probe.last_gradient is not None
    assert probe.local_density() == probe.reduced_density() == 1.0     # the bias's one element, not 1 of 5


def test_the_gradient_probe_leaves_out_a_gradient_that_came_without_a_local_one():
    """An SFB weight: autograd never computes its local gradient (the factors' average is set as its
    gradient), so its hook never fires; it read as all zeros, a density of 0.4% for a head of 99%.
    An unused parameter, which got no gradient at all, still counts as zeros."""
    used, sfb, unused = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
    probe = GradientProbe([used, sfb, unused], 4)
    probe.reset(marking=True)
    used.sum().backward()
    sfb.grad = torch.ones(4)            # as DataParallel sets an SFB layer's weight after backward
    assert probe.local_density() == probe.reduced_density() == 0.5     # used's block, unused's none


def test_a_diverged_run_is_not_reported_level_with_the_baseline():
    """max() skips NaN: a run whose loss became NaN after step 1 had a largest loss difference of
    0.1 (the steps before it), and its JSON report was not JSON (NaN)."""
    from sparcoll.train.command import compare, _finite
    base = {"comm": "ddp", "label": "ddp", "step_s": 1.0, "loss": [0.69, 0.60, 0.50], "final_loss": 0.5}
    diverged = {"comm": "hook", "label": "hook", "step_s": 0.5, "loss": [0.69, 0.70, math.nan],
                "final_loss": math.nan}
    mode = compare([diverged, base])["modes"][0]
    assert mode["max_loss_difference"] == math.inf
    assert json.loads(json.dumps(_finite({"loss": diverged["loss"]}), allow_nan=False)) == {"loss": [0.69, 0.7, None]}


def test_workload_options_are_checked_with_the_users_data(tmp_path):
    """The check built gpt without --data, on its fallback corpus: a seq_len that the user's file
    allows was refused (a review of the change)."""
    from sparcoll.train.command import check_builds, workload_options
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"word{i % 997} line {i % 13}" for i in range(200000)))
    given = [("seq_len", 2048), ("eval_fraction", 0.01)]
    options = workload_options("gpt", given)
    with pytest.raises(ValueError, match="held-out split has"):
        check_builds("gpt", options, given)         # the fallback corpus is too short for it
    check_builds("gpt", options, given, data=str(text))


def test_sparse_embeddings_on_a_tied_softmax_are_refused_before_any_worker(capsys):
    """gpt ties its softmax to its embedding by default: each worker of the agsparse mode raised in a
    traceback, and the modes that had run were lost."""
    assert main(["train", "--workload", "gpt", "--workload-option", "tiny=true", "--compare", "ddp,agsparse",
                 "--network", "none"]) == 2
    assert "add --workload-option tie_weights=false" in capsys.readouterr().err
    assert main(["train", "--workload", "gpt", "--workload-option", "sparse_embeddings=true", "--network",
                 "none"]) == 2
    assert "tie_weights=false" in capsys.readouterr().err


def test_density_counts_blocks_with_a_nonzero_element():
    dense = torch.zeros(10)
    dense[7] = -2.0
    dense[9] = -0.0
    assert nonzero_elements(dense).nonzero().flatten().tolist() == [7]
    rows = torch.sparse_coo_tensor([[3, 1, 3]], torch.ones(3, 2), (5, 2), check_invariants=True)
    assert nonzero_elements(rows).nonzero().flatten().tolist() == [2, 3, 6, 7]
    # 20 elements in blocks of 4: element 7 (dense), then 12, 13, 16, 17 (rows) -> blocks 1, 3 and 4
    assert block_density([nonzero_elements(dense), nonzero_elements(rows)], 4) == pytest.approx(3 / 5)


def test_synchronization_counts_a_shared_collective_once():
    """A bucket's members share one collective's span: the synchronization thread's busy time is the
    union of the spans (overlaps counted once), and the hidden part is what lies before backward's
    end. Checked against a millisecond grid of the same spans."""
    from types import SimpleNamespace
    from sparcoll.torch.parallel import Event
    spans = [(1, 4), (1, 4), (1, 4), (3, 6), (8, 9), (8.5, 8.7)]       # ms; a unit of three, overlaps
    model = SimpleNamespace(trace=[Event(f"t{i}", "ring", 0.0, s / 1e3, e / 1e3) for i, (s, e) in enumerate(spans)],
                            backward_end=5e-3, strategy=lambda: {"t0": {"predicted_bytes": 10.0}, "t1": {}})
    grid = torch.arange(0, 10, 0.001) + 0.0005
    busy = torch.zeros_like(grid, dtype=torch.bool)
    for s, e in spans:
        busy |= (grid > s) & (grid < e)
    predicted, total, hidden = synchronization(model)
    assert math.isnan(predicted)                       # a compressed tensor's bytes are not predicted
    assert total == pytest.approx(busy.sum().item() * 1e-6, abs=1e-8) == pytest.approx(6e-3)
    assert hidden == pytest.approx((busy & (grid < 5)).sum().item() * 1e-6, abs=1e-8) == pytest.approx(4e-3)


def test_timed_steps_leave_out_the_warm_up_and_the_probed_steps():
    steps = [{"step": i, "probed": i % 3 == 0} for i in range(7)]     # probed: 0, 3, 6
    assert [s["step"] for s in timed_steps(steps, 1)] == [1, 2, 4, 5]
    assert [s["step"] for s in timed_steps(steps, 2)] == [2, 4, 5]
    only_probed = [{"step": 0, "probed": True}, {"step": 1, "probed": True}]
    assert [s["step"] for s in timed_steps(only_probed, 1)] == [1]     # nothing else to time
    assert [s["step"] for s in timed_steps(only_probed[:1], 1)] == [0]


def test_plain_ddp_on_sparse_gradients_is_what_gets_run_again_after_a_crash(tmp_path, monkeypatch):
    """torch 2.13's gloo crashes now and then under DDP's sparse all_reduce (docs/reliability.md)."""
    from sparcoll.train.worker import plain_ddp_on_sparse_gradients as plain

    job = {"comm": "ddp", "options": {}}
    assert not plain(job)
    assert plain({**job, "comm": "agsparse"}) and plain({**job, "options": {"sparse_embeddings": True}})
    # the hook sends sparse gradients through sparcoll, mode sparcoll is DDP on sparcoll's backend
    assert not plain({"comm": "hook", "options": {"sparse_embeddings": True}})
    assert not plain({"comm": "sparcoll", "options": {"sparse_embeddings": True}})
    (tmp_path / "tables.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def sparse():\n    return nn.EmbeddingBag(10, 4, sparse=True), torch.tensor([[1, 2]])\n"
        "def dense():\n    return nn.EmbeddingBag(10, 4), torch.tensor([[1, 2]])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plain({**job, "model_spec": "tables:sparse"}) and not plain({**job, "model_spec": "tables:dense"})


def _step(step: int, loss: float) -> dict:
    return {"event": "step", "step": step, "probed": step == 0, "loss": loss, "step_s": 0.02, "comm_s": 0.01,
            "compute_s": 0.01, "cpu_s": 0.015, "cpu_mean_s": 0.012, "training_thread_cpu_s": 0.01,
            "reference_cpu_s": 0.003, "density_local": 0.5, "density_union": 0.5,
            "bytes_sent": None, "page_faults": 3}


class FakeJobs:
    """run_job for command.launch: each job emits `steps` steps; the first `crashes` jobs stop after
    two of them with the given failure."""

    def __init__(self, steps: int, crashes: int, crashed=("worker 1 (signal SIGABRT)",)):
        self.steps, self.crashes, self.crashed, self.jobs = steps, crashes, crashed, 0

    def __call__(self, job, on_event):
        self.jobs += 1
        for step in range(self.steps):
            if self.jobs <= self.crashes and step == 2:
                failure = BenchError("worker 1 exited (signal SIGABRT) before finishing")
                failure.crashed = self.crashed
                raise failure
            on_event(_step(step, 1.0 / (step + 1) + 10 * (self.jobs <= self.crashes)))


def test_a_crash_of_plain_ddp_on_sparse_gradients_runs_it_again(tmp_path, monkeypatch, capsys):
    from sparcoll.train import command

    sparse = ["--workload-option", "tiny=true", "--workload-option", "sparse_embeddings=true"]
    argv = ["train", "--workload", "ncf", "--workers", "2", "--network", "none", "--steps", "4", "--json"]
    fake = FakeJobs(4, crashes=1)
    monkeypatch.setattr(command, "run_job", fake)
    assert main([*argv, str(tmp_path / "r.json"), *sparse, "--comm", "ddp"]) == 0
    assert fake.jobs == 2 and "crashed in native code: worker 1 (signal SIGABRT);" in capsys.readouterr().err
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["loss"] == [1.0, 0.5, 1 / 3, 0.25] and run["crashed_runs"] == [["worker 1 (signal SIGABRT)"]]  # the second run's alone
    fake = FakeJobs(4, crashes=command.CRASH_RETRIES + 1)           # it keeps crashing: the job fails
    monkeypatch.setattr(command, "run_job", fake)
    assert main([*argv, str(tmp_path / "s.json"), *sparse, "--comm", "ddp"]) == 1
    assert fake.jobs == command.CRASH_RETRIES + 1
    for failing in (FakeJobs(4, crashes=1, crashed=()),                # not a crash: no second run
                    FakeJobs(4, crashes=1)):                           # dense gradients: not this crash
        monkeypatch.setattr(command, "run_job", failing)
        options = sparse if not failing.crashed else sparse[:2]
        assert main([*argv, str(tmp_path / "t.json"), *options, "--comm", "ddp"]) == 1
        assert failing.jobs == 1
