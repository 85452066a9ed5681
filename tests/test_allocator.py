"""sparcoll.keep_freed_memory: a large gradient allocated anew by every backward reuses the pages the
last one freed, instead of faulting every page in again (glibc unmaps blocks above 32 MiB)."""
import json
import os
import subprocess
import sys

STEPS = """
import json, resource, sys, torch
import sparcoll
kept = sys.argv[1] == "keep" and sparcoll.keep_freed_memory()
table = torch.nn.Embedding(1 << 20, 16)          # a dense 64 MiB gradient every backward
ids = torch.randint(0, 1 << 20, (4096,))
faults = []
for _ in range(32):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    table.weight.grad = None                      # as optimizer.zero_grad() leaves it
    table(ids).sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""
PAGES = (64 << 20) // os.sysconf("SC_PAGE_SIZE")


def _steps(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_large_gradient_reuses_the_pages_of_the_last_one():
    kept, default = _steps("keep"), _steps("default")
    assert kept["kept"], "glibc's mallopt was not found"
    # glibc as it comes: every step faults the whole gradient in again (the measure sees them)
    assert min(default["faults"][-16:]) > PAGES // 2, json.dumps(default)
    # kept: the heap grows for the first steps (up to 10 of them, in runs here), then the next
    # gradients are served from it; it may still grow now and then (8 steps of 200 with an
    # optimizer; its peak memory 871 MB against 425)
    assert sum(kept["faults"][-16:]) < 4 * PAGES, json.dumps(kept)


RELEASE = """
import json, sys, torch
from sparcoll import allocator
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
allocator.keep_freed_memory()
big = torch.ones(1 << 26)                       # 256 MiB, written
del big
kept = rss()
released = allocator.release_freed_memory()
print(json.dumps({"kept": kept, "after": rss(), "released": released}))
"""


def test_freed_memory_goes_back_to_the_kernel_when_released():
    """keep_freed_memory keeps a freed block's pages; release_freed_memory hands them back."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["released"]
    assert result["kept"] - result["after"] > 200 << 20, result      # most of the 256 MiB
