"""Timed runs that no other process disturbed, for benchmarks on a shared machine.

On the 2-core development machine a run beside another process's compute can
take ten times as long (two programs whose OpenMP threads spin on the same two
cores: the example's step went from 0.4 s to 3-4 s and back within minutes),
so a timing taken then says nothing about teraio. ``timed(cmd)`` waits until
the rest of the machine is idle, runs the command, and counts the CPU time the
rest of the machine used meanwhile: ``/proc/stat``'s busy time less the
command's own (``getrusage`` of the waited-for children). A run from which the
others took more than ``MAX_OTHERS`` of a core on average is repeated, up to
``TRIES`` times; the last is kept and counted as disturbed. Waiting and
repeating spend at most ``BUDGET_S`` in all (then every run is kept as it is,
and counted), so a bench ends on a machine that is never idle too. Where
``/proc/stat`` is missing (not Linux) every run is kept as it is.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_OTHERS = 0.15  # cores, averaged over the run
TRIES = 8
WAIT_S = 60.0  # at most, for an idle machine before each run
BUDGET_S = 300.0  # at most, in all, waiting and repeating
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Tally:
    """What the gate did in this process."""

    runs: int = 0
    repeated: int = 0
    spent_s: float = 0.0  # waiting and repeating
    disturbed: list[str] = field(default_factory=list)  # kept although disturbed
    others: list[float] = field(default_factory=list)  # cores the others used, per kept run

    def line(self) -> str:
        worst = max(self.others, default=0.0)
        return (f"quiet gate: {self.runs} timed runs, {self.repeated} repeated as disturbed, {self.spent_s:.0f} s "
                f"spent waiting and repeating, "
                f"{len(self.disturbed)} kept disturbed; other processes used at most {worst:.2f} of a core "
                f"during a kept run (bench/quiet.py)")


TALLY = Tally()


def _busy_s() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _HZ


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wait_idle(max_s: float = WAIT_S) -> None:
    """Until the machine (this process aside) was idle for a second, or ``max_s`` passed."""
    start = time.monotonic()
    end = start + min(max_s, max(BUDGET_S - TALLY.spent_s, 0.0))
    while time.monotonic() < end:
        b0, s0 = _busy_s(), _self_s()
        if b0 is None:
            return
        time.sleep(1.0)
        b1, s1 = _busy_s(), _self_s()
        if b1 is not None and (b1 - b0) - (s1 - s0) < MAX_OTHERS:
            break
    TALLY.spent_s += time.monotonic() - start


def timed(cmd: list[str], label: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (captured) on an idle machine; see the module docstring. Raises on failure."""
    for attempt in range(TRIES):
        wait_idle()
        b0, c0, s0, t0 = _busy_s(), _children_s(), _self_s(), time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        b1, c1, s1, t1 = _busy_s(), _children_s(), _self_s(), time.monotonic()
        if r.returncode != 0:
            return r
        if b0 is None or b1 is None:
            TALLY.runs += 1
            return r
        others = max((b1 - b0) - (c1 - c0) - (s1 - s0), 0.0) / max(t1 - t0, 1e-9)
        if others <= MAX_OTHERS or attempt == TRIES - 1 or TALLY.spent_s >= BUDGET_S:
            TALLY.runs += 1
            TALLY.others.append(others)
            if others > MAX_OTHERS:
                TALLY.disturbed.append(label)
            return r
        TALLY.repeated += 1
        TALLY.spent_s += t1 - t0
    raise AssertionError("unreachable")


def sh(*args: str | Path, label: str = "") -> subprocess.CompletedProcess[str]:
    """``demo.sh`` for a timed step: gated as ``timed``, exits with the output on failure."""
    cmd = [str(a) for a in args]
    r = timed(cmd, label or " ".join(cmd[:4]))
    if r.returncode != 0:
        import sys

        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with exit status {r.returncode}")
    return r
