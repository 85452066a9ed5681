"""How the benchmarks see memory: the pages a process faults in for the first time (a step that wrote
fresh memory, as a heap that grew does, is slow for that, not for its communication) and how much
memory the host has (Linux's /proc/meminfo)."""
from __future__ import annotations

import resource

FAULTING_PAGES = 4096   # a step in which some rank faulted this many pages in (16 MB of 4 KiB pages)
                        # took fresh memory


def minor_faults() -> int:
    """The page faults this process has taken without I/O: a heap that grows faults each fresh page in
    when it is first written (deeplight's 68 MB gradient: 16.5k of them, 150-180 ms on 4 processes on
    2 cores)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def took_fresh_memory(page_faults: float) -> bool:
    """Whether a step whose busiest rank faulted `page_faults` pages in took fresh memory."""
    return page_faults >= FAULTING_PAGES


def meminfo(field: str) -> int | None:
    """Bytes of /proc/meminfo's `field` ("MemTotal", "MemAvailable"), None where unknown."""
    try:
        with open("/proc/meminfo") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
