"""`sparcoll demo`: it picks the emulated network only where it can be built and says which setting it
ran in; a small run on loopback prints a verdict per density, the training comparison with DDP's
communication share, and writes its table, plot and training results."""
import pytest

from sparcoll import demo
from support import sparcoll_here

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)


def test_auto_picks_the_emulated_network_only_where_it_can_be_built(monkeypatch):
    monkeypatch.setattr("sparcoll.bench.netns.netem_problems", lambda: [])
    network, why = demo.choose_network("auto")
    assert network == "1gbit" and "1 Gbit/s" in why
    monkeypatch.setattr("sparcoll.bench.netns.netem_problems", lambda: ["not running as root"])
    network, why = demo.choose_network("auto")
    assert network == "none" and "not running as root" in why and "CPU-bound" in why
    assert demo.choose_network("10gbit") == ("10gbit", "as requested")


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


def test_an_out_that_cannot_be_a_directory_is_refused_in_one_line(tmp_path, capsys):
    """A file of that name: one line and exit status 2 (before, FileExistsError's traceback)."""
    from sparcoll.cli import main
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["demo", "--out", str(taken), "--network", "none"]) == 2
    err = capsys.readouterr().err
    assert f"sparcoll demo: error: --out {taken}: cannot make that directory" in err and "Traceback" not in err
