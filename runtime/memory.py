"""Process memory on CPU: give freed blocks back to the OS, and read peak RSS.

glibc keeps freed heap memory unless told otherwise, and its mmap threshold
grows after large frees, so without tuning, RSS never shows an offload. With
a fixed 64 KiB mmap threshold every tensor-sized block is its own mapping and
``free`` unmaps it (mallopt(3): M_MMAP_THRESHOLD, M_TRIM_THRESHOLD).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

__all__ = ["peak_rss_bytes", "trim", "tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
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


def tune_malloc(mmap_threshold: int = 64 << 10) -> bool:
    """Make glibc return freed tensor memory to the OS. True if it took effect."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 20) == 1)


def trim() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
