"""NOTE [ Host memory left idle ]: the greedy sends a period to the SSD while any candidate fits
the SSD's bandwidth, and to host memory only for the excess left after that (``planner.greedy``).
Where a phase is bound by the SSD, that can leave host memory idle beside it: for Llama3-70B at
batch 1 with 512 GiB of host memory, the optimizer step read 572 GiB from the SSD (38 s at 16
GB/s) while host memory held 417 GiB when it began, and the step took 38.8 s against the 31.1 s
its bytes need with the host filled.

So once the moves are chosen, ``fill_host`` sends SSD moves to host memory in batches, each
kept only if the simulated iteration gets faster, still fits, and keeps host memory within its
limit. A move goes wherever its host copy fits beside the others for its whole span (the span
and the limit of the greedy's host stage). Per round and per side (the moves due in a window
for reads, those offloaded in it for writes), two batches are tried, from the phase windows
(``planner.bound``) that the simulation finds above their bound:

- *balancing*: in every such window, the largest SSD moves until its SSD and host channels of
  that side would finish the window's bytes together;
- *the worst window's*: every SSD move of the window furthest above its bound, the largest first.

Rounds go on while one is kept, up to ``MAX_ROUNDS``. The first batch is what a batch of 16
micro-batches needs: for Llama3-70B at batch 16, each of the 16 backward passes was 4.4 s above
its bound, its SSD reads saturated and its host reads at 72%, and host memory held 374 of its
512 GiB as each began; one window at a time (the second batch alone, as this pass first was)
reached only the three worst of 33 windows (650.9 s predicted; with both batches 617.0 s). The
moves keep their triggers: host memory's link is the faster one in every setting the issue
names, and where it is not, the simulation refuses the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from planner.bound import Bound
from planner.clean import host_held, host_span, take_host
from planner.greedy import Move
from planner.hardware import Hardware
from planner.problem import PlanProblem
from planner.simulate import SimResult

__all__ = ["fill_host"]

# Rounds of sending moves to host memory; each costs up to four simulations.
MAX_ROUNDS = 3


def _to_host(problem: PlanProblem, moves: list[Move], chosen: Sequence[int], host_mem_bytes: float) -> int:
    """Send each of ``chosen`` (in order) to host memory where it fits; returns the bytes sent."""
    n = problem.num_ops
    held = host_held(problem, moves)
    sent = 0
    for i in chosen:
        mv = moves[i]
        if take_host(held, *host_span(mv, n), mv.size_bytes, host_mem_bytes):
            moves[i] = replace(mv, target="host")
            sent += mv.size_bytes
    return sent


def window_times_us(sim: SimResult, first_ops: np.ndarray) -> np.ndarray:
    """(num_windows,) float64: how long each window of ops took in ``sim``, its first op's stall in it."""
    began = sim.op_start_us - sim.stall_us_before
    starts = began[first_ops]
    return np.diff(np.r_[starts, sim.iteration_us])


def _batches(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, bound: Bound, hw: Hardware,
             side: str) -> list[list[int]]:
    """Two batches of SSD moves to try sending to host memory, ``side`` "read" (the moves due in a
    window) or "write" (those offloaded in it): *balancing*, in every phase window above its bound in
    ``sim``, the largest first, until the window's SSD and host channels of ``side`` would finish its
    bytes together; and *the worst window's*, all of those in the window furthest above its bound,
    the largest first (one batch where the two are the same)."""
    n, first_ops = problem.num_ops, bound.window_first_op
    ssd_bw, host_bw = hw.channel_bw()[f"ssd_{side}"], hw.channel_bw()[f"host_{side}"]
    gap = window_times_us(sim, first_ops) - bound.window_us
    at = np.array([(mv.end_op if side == "read" else mv.start_op + 1) % n for mv in moves], np.int64)
    window = np.searchsorted(first_ops, at, side="right") - 1
    balancing: list[int] = []
    worst: list[int] = []
    for w in np.argsort(-gap, kind="stable").tolist():
        if gap[w] <= 0:
            break
        mine = [i for i in np.flatnonzero(window == w).tolist() if moves[i].reads_back or side == "write"]
        on_ssd = sorted((i for i in mine if moves[i].target == "ssd"), key=lambda i: -moves[i].size_bytes)
        if not worst:
            worst = on_ssd
        # bytes x off the SSD even the two out: (ssd - x) / ssd_bw = (host + x) / host_bw
        ssd = sum(moves[i].size_bytes for i in on_ssd)
        host = sum(moves[i].size_bytes for i in mine) - ssd
        left = (ssd * host_bw - host * ssd_bw) / (ssd_bw + host_bw)
        for i in on_ssd:
            if left <= 0:
                break
            if moves[i].size_bytes <= 1.5 * left:  # not one so large it overshoots by more than half
                balancing.append(i)
                left -= moves[i].size_bytes
    return [balancing] if worst == balancing else [balancing, worst]  # the same one tried once


def fill_host(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware, bound: Bound,
              simulate: Callable[[Sequence[Move]], SimResult]) -> tuple[list[Move], SimResult]:
    """NOTE [ Host memory left idle ]: ``moves`` with SSD moves sent to host memory where that makes
    the simulated iteration (``simulate``, of which ``sim`` is ``moves``'s) faster, and its simulation."""
    best, best_sim = list(moves), sim
    if hw.host_mem_bytes <= 0 or problem.num_ops == 0 or not any(mv.target == "ssd" for mv in moves):
        return best, best_sim
    for _ in range(MAX_ROUNDS):
        improved = False
        for side in ("read", "write"):
            for chosen in _batches(problem, best, best_sim, bound, hw, side):
                trial = list(best)
                if not chosen or not _to_host(problem, trial, chosen, hw.host_mem_bytes):
                    continue
                trial_sim = simulate(trial)
                if (trial_sim.fits and trial_sim.host_peak_bytes <= hw.host_mem_bytes
                        and trial_sim.iteration_us < best_sim.iteration_us):
                    best, best_sim, improved = trial, trial_sim, True
                    break  # the next batches are of the moves and simulation before this one
        if not improved:
            break
    return best, best_sim
