"""The README's usage examples run as written, under torchrun as a user starts them: every ```python
block of its Usage section, and the DDP hook line of its prose (after the first block's imports).

torch 2.13's gloo sometimes aborts a process at exit after DDP ("terminate called without an active
exception", exit -6), with or without sparcoll: a plain gloo DDP script measured 5 of 16 torchrun jobs
so. Success is therefore judged from what each rank reports once its work is done (a line printed
after the last collective); such an abort at exit is tolerated, nothing else."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import kill_tree

pytestmark = pytest.mark.auto_algorithm   # as users get it (conftest.py)

README = Path(__file__).resolve().parent.parent / "README.md"
LIMIT = 180     # seconds for one torchrun job of 2 ranks
EXIT_ABORT = "terminate called without an active exception"


def usage_section() -> str:
    text = README.read_text()
    return text[text.index("## Usage"):text.index("## What is where")]


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", usage_section(), re.S)


def hook_script() -> str:
    """The first block's set-up, a DDP model, the README's hook line, one backward step."""
    line = re.search(r"`(ddp\.register_comm_hook\(.*?\))`", usage_section(), re.S).group(1)
    return ("import torch, torch.distributed as dist\nimport sparcoll\n\n"
            "dist.init_process_group('gloo')\n"
            "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1000, 10))\n"
            + " ".join(line.split()) + "\n"
            "ddp(torch.randn(32, 1000)).sum().backward()\n"
            "print('hook ok', ddp.module.weight.grad.abs().sum().item() > 0)\n"
            "dist.destroy_process_group()\n")


def torchrun(script: str, tmp_path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `script` on 2 ranks; the job, and each rank's stdout (its own file: printed lines of two
    processes on one pipe can interleave)."""
    path = tmp_path / "example.py"
    path.write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--log-dir", str(tmp_path / "logs"), "--redirects", "1", str(path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                          stdin=subprocess.DEVNULL) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=LIMIT)
        except BaseException:
            kill_tree(proc)     # torchrun's workers run in sessions of their own
            raise
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    outputs = [f.read_text() for f in sorted((tmp_path / "logs").rglob("stdout.log"))]
    return done, outputs


def check_finished(done: subprocess.CompletedProcess, outputs: list[str], marker: str) -> None:
    """Both ranks printed `marker` (their work is done); the job exited 0 or only aborted at exit."""
    assert len(outputs) == 2 and all(marker in out for out in outputs), (outputs, done.stderr[-3000:])
    assert done.returncode == 0 or EXIT_ABORT in done.stderr, done.stderr[-3000:]


def test_the_usage_section_has_the_examples():
    assert len(blocks()) == 2 and "register_comm_hook" in hook_script()


@pytest.mark.parametrize("index", [0, 1], ids=["allreduce", "ddp-backend"])
def test_readme_block_runs_under_torchrun(tmp_path, index):
    script = blocks()[index]
    marker = "README example finished"
    done, outputs = torchrun(script + f"print({marker!r})\n", tmp_path)
    check_finished(done, outputs, marker)
    if index == 0:
        # Each rank prints bytes and blocks it sent. The 1000 non-zero elements fill blocks 0-3,
        # rank 0's shard: rank 0 hands them to its own aggregator (no wire), rank 1 sends its 4 in
        # each of the two allreduces, as the README's comment says ("~4 blocks ... on the wire").
        counts = [out.split()[:2] for out in outputs]
        assert sum(int(c[1]) for c in counts) == 8, outputs


def test_readme_hook_line_runs_after_a_plain_import(tmp_path):
    done, outputs = torchrun(hook_script(), tmp_path)
    check_finished(done, outputs, "hook ok True")
