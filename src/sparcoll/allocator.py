"""Freed memory kept for the next step instead of going back to the kernel.

glibc's malloc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it when freed. A gradient that large is allocated anew by every backward (an embedding's
dense gradient, a wide layer's), and each of its pages then faults and is zeroed by the kernel
before torch writes it again. deeplight's 68 MB embedding gradient: one process's backward took
34-41 ms that way, 12-14 ms with the memory kept (measured on this project's machine); 4 workers on
2 cores, a step of its plan went from 161-168 ms to 128-135 (docs/benchmarks-log.md, section 4).
Tuned CPU training avoids this with another allocator (jemalloc, tcmalloc); this keeps glibc and
tells it to serve every block from its heap (no mmap) and to keep the heap's free top (no trim), so
a freed gradient's pages serve the next one.

And there is one arena for every thread: a thread's own arena holds at most 64 MiB, so without mmap
each larger block a thread asked for failed there first and was then served by the main arena (vgg's
first step under sufficient factors, whose synchronization thread allocates its 341 and 392 MB
gradients, took 8.0-9.1 s that way against 3.3-4.7 before, and 2.7-3.1 with one arena). The price:
the process keeps its peak heap (a 64 MiB embedding trained 200 steps with SGD: 871 MB at its peak
against 425), and its threads share one arena's lock. A process that goes through phases of
different sizes (`sparcoll plan --profile`) hands what a finished phase freed back with
release_freed_memory: vgg's four profiling workers, each keeping every phase's peak, ran a 24 GB
machine out of memory.

Under glibc before 2.38 that was not enough: torch allocates with posix_memalign, which takes a
chunk larger by the alignment and frees the few bytes left over behind the block. Those land in the
thread's cache (tcache) or a fastbin, which count as in use, so the freed block cannot merge with the
free space past them and the next request, again larger than the block, does not fit: the heap grew
by the block now and then, at any step (4 vgg workers: one grew by 392 MB at 5 of 14 iterations,
each time faulting the block in during backward). So fastbins are off too (mallopt) and so is the
tcache, which only the environment a process starts with can turn off (GLIBC_TUNABLES, the
TUNABLES of `startup_environment`): the workers sparcoll starts get it; a user's own script needs it
from its launcher. A small block then costs a lock of the one arena: no cost seen in the bench's
loopback collectives, where the protocol's Python allocates the most, nor in DDP's training steps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import warnings

M_MXFAST = 1              # mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
KEEP_TOP = 2**31 - 1      # bytes of free heap top kept before any goes back: the most mallopt's int holds
TUNABLES = "glibc.malloc.tcache_count=0"    # no per-thread cache of freed small blocks


def _libc():
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed memory for reuse (see above); False where the C library
    has no glibc mallopt (nothing changed). Call it at the start of a training process, before its
    threads: it applies to the blocks allocated after it, and a thread that already has an arena
    keeps it. Warns if the process did not start with TUNABLES (see above)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(parameter, value) for parameter, value in
            ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_TOP), (M_MXFAST, 0))]
    if not started_with_tunables():
        warnings.warn(f"this process started with glibc's thread cache on: its heap may grow by a large "
                      f"block now and then instead of reusing a freed one; launch it with "
                      f"GLIBC_TUNABLES={TUNABLES}", RuntimeWarning, stacklevel=2)
    return all(result == 1 for result in done)


def startup_environment(env: dict) -> dict:
    """`env` with TUNABLES added to GLIBC_TUNABLES (the others kept; a tcache setting of the caller's
    wins): the environment to start a process in that will keep freed memory."""
    present = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count=" in present:
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{present}:{TUNABLES}" if present else TUNABLES}


def started_with_tunables() -> bool:
    """Whether this process started with TUNABLES: glibc reads them at start, so the environment
    the process was started in counts (/proc/self/environ), not a later change of os.environ."""
    try:
        with open("/proc/self/environ", "rb") as f:
            start = f.read().split(b"\0")
    except OSError:
        return False
    tunables = [v for v in start if v.startswith(b"GLIBC_TUNABLES=")]
    return bool(tunables) and TUNABLES.encode() in tunables[-1].split(b"=", 1)[1].split(b":")


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc's malloc_trim), keeping what is in
    use; False where the C library has no malloc_trim. The next blocks fault their pages in again:
    call it between phases, not between the steps of one."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
