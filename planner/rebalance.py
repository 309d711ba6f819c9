"""NOTE [ Host memory left idle ]: the greedy sends a period to the SSD while any candidate fits
the SSD's bandwidth, and to host memory only for the excess left after that (``planner.greedy``).
Where a phase is bound by the SSD, that can leave host memory idle beside it: for Llama3-70B at
batch 1 with 512 GiB of host memory, the optimizer step read 572 GiB from the SSD (38 s at 16
GB/s) while host memory held 417 GiB when it began, and the step took 38.8 s against the 31.1 s
its bytes need with the host filled.

So once the moves are chosen, ``fill_host`` takes the phase windows (``planner.bound``) that the
simulation finds furthest above their bound, and in each, the SSD moves that read back (and then
those that write out) in it, the largest first, to host memory wherever the host copy fits beside
the others for its whole span (the span and the limit of the greedy's host stage). Each such
batch is kept only if the simulated iteration gets faster and still fits. The moves keep their
triggers: host memory's link is the faster one in every setting the issue names, and where it is
not, the simulation refuses the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from planner.bound import Bound
from planner.greedy import Move
from planner.hardware import Hardware
from planner.problem import PlanProblem
from planner.simulate import SimResult

__all__ = ["fill_host"]

# Windows tried, the furthest above their bound first; each costs up to two simulations.
MAX_WINDOWS = 3


def _host_held(problem: PlanProblem, moves: Sequence[Move]) -> np.ndarray:
    """(num_ops,) float64: the bytes of host copies held at each op, counted as the greedy's host
    stage counts them (from the op after ``start_op`` through ``end_op``, folded into one iteration)."""
    n = problem.num_ops
    diff = np.zeros(2 * n + 2)
    for mv in moves:
        if mv.target == "host":
            lo, hi = _span(mv, n)
            diff[lo] += mv.size_bytes
            diff[hi] -= mv.size_bytes
    held = np.cumsum(diff)[:2 * n]
    return held[:n] + held[n:]


def _span(mv: Move, n: int) -> tuple[int, int]:
    """A move's host span on the unrolled axis, ``[lo, hi)``, at most one iteration long."""
    lo = mv.start_op + 1
    return lo, min(mv.end_op + 1, lo + n)


def _to_host(problem: PlanProblem, moves: list[Move], chosen: Sequence[int], host_mem_bytes: float) -> int:
    """Send each of ``chosen`` (in order) to host memory where it fits; returns the bytes sent."""
    n = problem.num_ops
    held = _host_held(problem, moves)
    sent = 0
    for i in chosen:
        mv = moves[i]
        lo, hi = _span(mv, n)
        pieces = [(lo, min(hi, n)), (max(lo, n) - n, hi - n)] if hi > n else [(lo, hi)]
        pieces = [(a, b) for a, b in pieces if b > a]
        if any(float(held[a:b].max()) + mv.size_bytes > host_mem_bytes for a, b in pieces):
            continue
        for a, b in pieces:
            held[a:b] += mv.size_bytes
        moves[i] = replace(mv, target="host")
        sent += mv.size_bytes
    return sent


def window_times_us(sim: SimResult, first_ops: np.ndarray) -> np.ndarray:
    """(num_windows,) float64: how long each window of ops took in ``sim``, its first op's stall in it."""
    began = sim.op_start_us - sim.stall_us_before
    starts = began[first_ops]
    return np.diff(np.r_[starts, sim.iteration_us])


def fill_host(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware, bound: Bound,
              simulate: Callable[[Sequence[Move]], SimResult]) -> tuple[list[Move], SimResult]:
    """NOTE [ Host memory left idle ]: ``moves`` with SSD moves sent to host memory where that makes
    the simulated iteration (``simulate``, of which ``sim`` is ``moves``'s) faster, and its simulation."""
    best, best_sim = list(moves), sim
    if hw.host_mem_bytes <= 0 or problem.num_ops == 0 or not any(mv.target == "ssd" for mv in moves):
        return best, best_sim
    n, first_ops = problem.num_ops, bound.window_first_op
    gap = window_times_us(sim, first_ops) - bound.window_us
    for w in np.argsort(-gap, kind="stable")[:MAX_WINDOWS].tolist():
        if gap[w] <= 0:
            break
        lo, hi = int(first_ops[w]), int(first_ops[w + 1]) if w + 1 < len(first_ops) else n
        for side in ("read", "write"):
            at = [(mv.end_op if side == "read" else mv.start_op + 1) % n for mv in best]
            chosen = sorted((i for i, mv in enumerate(best)
                             if mv.target == "ssd" and lo <= at[i] < hi and (mv.reads_back or side == "write")),
                            key=lambda i: -best[i].size_bytes)
            trial = list(best)
            if not chosen or not _to_host(problem, trial, chosen, hw.host_mem_bytes):
                continue
            trial_sim = simulate(trial)
            if (trial_sim.fits and trial_sim.host_peak_bytes <= hw.host_mem_bytes
                    and trial_sim.iteration_us < best_sim.iteration_us):
                best, best_sim = trial, trial_sim
    return best, best_sim
