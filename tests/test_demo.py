"""`sparcoll demo`: it picks the emulated network only where it can be built and says which setting it
ran in; a small run on loopback prints a verdict per density, the training comparison with DDP's
communication share, and writes its table, plot and training results."""
import json

import pytest

from sparcoll import demo
from support import sparcoll_here

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)


def test_auto_picks_the_emulated_network_only_where_it_can_be_built(monkeypatch):
    monkeypatch.setattr("sparcoll.bench.netns.netem_problems", lambda: [])
    network, why = demo.choose_network("auto")
    assert network == "1gbit" and "1 Gbit/s" in why
    assert demo.choose_network("auto", workers=2)[1].startswith("2 emulated hosts")    # it said 4 for any
    monkeypatch.setattr("sparcoll.bench.netns.netem_problems", lambda: ["not running as root"])
    network, why = demo.choose_network("auto")
    assert network == "none" and "not running as root" in why and "CPU-bound" in why
    # an explicit network is named, as the automatic choice is (it said "as requested": a review)
    assert demo.choose_network("10gbit") == ("10gbit", "an emulated 10gbit network, as asked (--network 10gbit)")
    network, why = demo.choose_network("none")
    assert network == "none" and why.startswith("loopback, as asked")


def test_a_small_demo_on_loopback(tmp_path, capfd):
    out = tmp_path / "out"
    done = sparcoll_here(capfd, ["demo", "--network", "none", "--numel", "64K", "--repeat", "1", "--steps", "3",
                                 "--out", out], 300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    glance = lines.index("At a glance:")
    assert [line.split(":")[0].split()[-1] for line in lines[glance + 1:glance + 4]] == \
        ["1%", "10%", "100%"], done.stdout
    assert any(line.startswith("DDP on gloo spent ") and "% of each step communicating" in line
               for line in lines), done.stdout
    assert {p.name for p in out.iterdir()} == {"demo.json", "demo.png", "demo-train.json"}
    assert lines[-1] == f"Results in {out}/: demo.json, demo.png (the plot), demo-train.json.", done.stdout


def test_an_out_that_cannot_be_a_directory_is_refused_in_one_line(tmp_path, capsys):
    """A file of that name: one line and exit status 2 (before, FileExistsError's traceback)."""
    from sparcoll.cli import main
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["demo", "--out", str(taken), "--network", "none"]) == 2
    err = capsys.readouterr().err
    assert f"sparcoll demo: error: --out {taken}: cannot make that directory" in err and "Traceback" not in err


def test_a_list_of_workers_is_refused_before_anything_runs(capsys):
    """The demo runs one setting: `--workers 2,4` had run the whole bench, paired the 2-worker speedups
    with the 4-worker ones, then failed in the training part under train's usage text."""
    from sparcoll.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--workers", "2,4", "--network", "none"])
    assert exit_.value.code == 2
    assert "--workers: invalid number '2,4': one whole number" in capsys.readouterr().err


def test_the_verdicts_show_a_small_density_as_it_is(tmp_path):
    records = [{"input": "dense", "algo": algo, "density": 0.004, "speedup_vs_ring": speedup}
               for algo, speedup in (("sparcoll", 20.0), ("sparse", 21.0))]
    (tmp_path / "demo.json").write_text(json.dumps(records))
    assert demo.verdicts(str(tmp_path / "demo.json")) == [
        "  block density  0.4%: sparcoll 20.00x as fast as gloo's ring all_reduce (its sparse AllReduce alone: 21.00x)"]


def test_bad_arguments_leave_no_folder_and_are_said_under_the_demos_name(tmp_path, capsys):
    """A density the bench refuses was reported as `sparcoll bench: error`, after --out was made
    (an empty folder left behind; a review)."""
    from sparcoll.cli import main
    out = tmp_path / "out"
    assert main(["demo", "--density", "2", "--network", "none", "--out", str(out)]) == 2
    assert "sparcoll demo: error: --density values must be in (0, 1]" in capsys.readouterr().err
    assert not out.exists()


def test_a_density_given_twice_is_refused_by_the_demos_own_parser(tmp_path, capsys):
    """Once bench refused repeated densities, the demo passed them on: bench's usage came out under
    the demo's name, listing bench's options, and an empty --out folder was left (a review)."""
    import pytest
    from sparcoll.cli import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--density", "0.1,0.1", "--network", "none", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "0.1 given twice" in err and "--launcher" not in err, err
    assert not out.exists()
