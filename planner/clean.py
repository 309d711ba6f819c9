"""NOTE [ Copies kept ]: a parameter goes out after its forward use, comes back for its backward,
and goes out again, unchanged (NOTE [ Unchanged periods ] in ``planner.problem``). Writing it the
second time moves bytes its copy already holds: for Llama3-70B at batch 16 with host memory, the
parameters written again after use were 481 of the 1,020 GiB each micro-batch wrote. ZeRO-Infinity
never writes them (its master copy stays off the device, and a parameter is only dropped after
use); the planner should not either.

So once the moves are chosen, ``keep_copies`` marks, for each move of an unchanged period whose
previous period is moved to the same place, the previous move's prefetch to keep its copy
(``keep_copy``) and this move's offload to free the storage without writing (``reuse_copy``).
A copy kept in host memory holds it between the two periods too; a pair goes only where that fits
beside the host copies already held (largest first).

The runtime checks what the profile promised: it drops a kept copy the moment an op writes the
storage, and an offload whose copy is gone writes as any other (``runtime.executor``). So does the
simulator where no copy is kept yet, as in the first iteration (``planner.simulate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner.greedy import Move
from planner.problem import PlanProblem, previous_periods

__all__ = ["fold", "host_held", "host_span", "keep_copies", "take_host"]


def fold(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """The ops ``[lo, hi)`` of the unrolled axis (``0 <= hi - lo <= n``) folded into one iteration,
    empty pieces left out."""
    lo, hi = lo - (lo // n) * n, hi - (lo // n) * n
    pieces = [(lo, min(hi, n)), (0, hi - n)] if hi > n else [(lo, hi)]
    return [(a, b) for a, b in pieces if b > a]


def host_span(mv: Move, n: int) -> tuple[int, int]:
    """A move's host span on the unrolled axis, ``[lo, hi)``, at most one iteration long: from the op
    after ``start_op`` through ``end_op``, as the greedy's host stage counts it."""
    lo = mv.start_op + 1
    return lo, min(mv.end_op + 1, lo + n)


def take_host(held: np.ndarray, lo: int, hi: int, size: float, limit: float) -> bool:
    """Add ``size`` bytes to ``held`` (per op) over the ops ``[lo, hi)`` of the unrolled axis if that
    stays within ``limit`` everywhere; whether it did."""
    pieces = fold(lo, hi, len(held))
    if any(float(held[a:b].max()) + size > limit for a, b in pieces):
        return False
    for a, b in pieces:
        held[a:b] += size
    return True


def host_held(problem: PlanProblem, moves: Sequence[Move]) -> np.ndarray:
    """(num_ops,) float64: the bytes of host copies held at each op (``host_span``, folded into one
    iteration), with the copies kept between two periods (NOTE [ Copies kept ]) held between them too."""
    n = problem.num_ops
    held = np.zeros(n + 1)
    at = {mv.period: i for i, mv in enumerate(moves)}
    prev = previous_periods(problem.tensor_id, problem.start_op) if any(mv.reuse_copy for mv in moves) else None
    for mv in moves:
        if mv.target != "host":
            continue
        spans = [host_span(mv, n)]
        if mv.reuse_copy and prev is not None and (j := _moved_before(problem, prev, at, mv.period)) is not None:
            spans.append(_kept_span(moves[j], mv, n))
        for lo, hi in spans:
            for a, b in fold(lo, hi, n):
                held[a] += mv.size_bytes
                held[b] -= mv.size_bytes
    return np.cumsum(held)[:n]


def _kept_span(before: Move, mv: Move, n: int) -> tuple[int, int]:
    """The ops between ``before``'s period and ``mv``'s, where the copy ``before`` kept waits:
    ``[before.end_op + 1, mv.start_op + 1)`` on the unrolled axis (unmoved periods between included)."""
    lo = before.end_op + 1
    hi = mv.start_op + 1
    while lo > hi:
        lo -= n
    return lo, hi


def _moved_before(problem: PlanProblem, prev: np.ndarray, at: dict[int, int], period: int) -> int | None:
    """The move of the storage's last moved period before ``period`` if the storage is unchanged
    since it (``period`` and the unmoved ones between are all unchanged), else None; a storage
    unchanged all round is its own (``period``'s move, the copy kept an iteration)."""
    unchanged = problem.unchanged
    assert unchanged is not None
    p = period
    for _ in range(len(prev)):  # at most round the storage's periods once
        if not unchanged[p]:
            return None
        p = int(prev[p])
        if p in at:
            return at[p]
    return None


def keep_copies(problem: PlanProblem, moves: Sequence[Move], host_mem_bytes: float) -> list[Move]:
    """``moves`` with NOTE [ Copies kept ] marked where the profile allows and host memory has room."""
    out = list(moves)
    if problem.unchanged is None or not out:
        return out
    n = problem.num_ops
    prev = previous_periods(problem.tensor_id, problem.start_op)
    at = {mv.period: i for i, mv in enumerate(out)}
    held = host_held(problem, out)
    for i in sorted(range(len(out)), key=lambda i: -out[i].size_bytes):
        mv = out[i]
        j = _moved_before(problem, prev, at, mv.period)
        if j is None or out[j].target != mv.target or not out[j].reads_back:
            continue
        if mv.target == "host" and not take_host(held, *_kept_span(out[j], mv, n), mv.size_bytes, host_mem_bytes):
            continue
        out[j] = replace(out[j], keep_copy=True)
        out[i] = replace(out[i], reuse_copy=True)
    return out
