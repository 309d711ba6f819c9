"""Process memory on CPU: give freed blocks back to the OS, and read peak RSS.

NOTE [ malloc on CPU ]: the memory an offload frees goes back to glibc's free
lists and the next allocations reuse it, so peak RSS falls with the tracked
peak without tuning malloc, though by less: example GPT at a 50% budget, peak
RSS per iteration 712.6 MiB against 793.0 MiB plain while the tracked peak
halves (BENCHMARKS.md). A small fixed mmap threshold (MALLOC_MMAP_THRESHOLD_ =
64 KiB) returns every block to the OS at once, but each allocation then
faults in fresh zeroed pages: the plain example's steps went from 0.36-0.50 s
to 0.50-0.61 s with it (one run each). So we trim (malloc_trim(3)) at iteration boundaries
instead: without it the heap grows with the offload pattern's fragmentation
(per-iteration peak RSS about 820 MiB against about 730 MiB with it, iterations 2-7); it costs
about 64 ms an iteration on that example (387 against 451 ms, empty plan), as
later allocations fault their pages in again. The per-iteration peaks are read
from VmHWM, which ``reset_peak_rss`` restarts at each boundary (proc(5)).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

__all__ = ["peak_rss_bytes", "peak_rss_since_reset", "reset_peak_rss", "trim"]

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name or "libc.so.6")
            lib.mallopt  # noqa: B018 - glibc only
            _libc = lib
        except (OSError, AttributeError):
            return None
    return _libc


def trim() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (Linux >= 4.0: writing 5 to
    /proc/self/clear_refs, proc(5)). True if it took effect."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int | None:
    """Peak RSS since the last ``reset_peak_rss`` (VmHWM), in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
