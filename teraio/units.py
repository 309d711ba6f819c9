"""Sizes and bandwidths as users type them: `80G`, `512M`, `16` (GB/s)."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bandwidth", "parse_size"]

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """Bytes from `80G`, `1.5T`, `4096`: K/M/G/T are binary (powers of 1024).

    A trailing `B` or `iB` is accepted (`80GiB`, `512MB` both mean powers of 1024).
    """
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}: use a number of bytes or a number with K, M, G or T "
                         "(powers of 1024), e.g. 80G")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 0 or (value == 0 and not allow_zero) or value == float("inf"):
        raise ValueError(f"bad size {text!r}: must be positive")
    return int(value)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from GB/s (decimal: 16 means 16e9 bytes/s)."""
    try:
        value = float(str(text).strip().removesuffix("GB/s").strip())
        if value != value:  # NaN
            raise ValueError
    except ValueError:
        raise ValueError(f"bad bandwidth {text!r}: give GB/s as a number, e.g. 16") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"bad bandwidth {text!r}: must be a positive number of GB/s")
    return value * 1e9


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
