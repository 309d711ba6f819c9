"""Prefetches started as early as there is room, and served in the order of their deadlines.

NOTE [ Prefetch early, serve by deadline ]: the greedy (``planner.greedy``)
starts each prefetch as late as the read bandwidth it reserved allows, and the
channels serve transfers in the order the greedy accepted them. Both are
right for the greedy's ideal timeline and brittle off it. Where a backward
pass must read back about as many bytes as its ops' time lets the SSD carry
(Llama3-8B at batch 16 on one 80 GiB GPU, SSD alone: 32 GiB in each 2.1 s
backward, NOTE [ Transfer bound ] in ``planner.bound``), every read that
starts late costs the pass its time, while memory falls from the peak to
about half of it as the pass consumes its activations: room that the late
prefetches leave idle. So, once the moves are chosen:

- *early*: each prefetch, the soonest needed first, starts at the earliest op
  from which its bytes fit under the capacity on the simulated memory curve
  (``SimResult.resident_bytes``, which the moves before it have raised), and
  not before its offload has completed there with a quarter of the write's
  time to spare (a write that much slower at run time is still done; one
  slower still is cancelled by the prefetch and its storage kept, as
  ``runtime.executor`` does), nor in an earlier iteration than the greedy had
  it in (a wrapping period keeps its place in the plan, NOTE [ Op indices in
  plans ] in ``planner.plan``). A prefetch whose offload the simulated
  iteration did not complete stays where it is;
- *by deadline*: the read channels serve prefetches in the order of their
  deadlines, then of their starts, each counted from the start of the
  iteration that triggers it (``Move.prefetch_priority``): most prefetches are
  triggered in the iteration after their offload's, beside that iteration's
  own. With each transfer released at its trigger and due at its deadline, a
  single channel served preemptively in deadline order meets every deadline
  that any order meets (Horn's rule, 1974: earliest due date with preemption
  minimises the maximum lateness). The order is fixed per move, so it is
  exact within an iteration; a prefetch triggered in one iteration and due in
  the next ranks, in the next, behind that iteration's own. Hence
  ``settle_urgency`` marks urgent, on a plan served by deadline, the offloads
  an op waits on and only those prefetches: any other prefetch an op waits on
  is the one due first. Marking them all (the greedy's way) made the Llama3-8B
  case 6% slower, each urgent one jumping ahead of others due sooner.

The result is simulated, and kept only where it fits and is faster. Measured
(BENCHMARKS.md, ``bench/policies.py``): Llama3-8B at batch 16 with the SSD
alone from 61.98 s to 57.63 s a predicted iteration; Llama3-70B at batch 16
with the SSD alone from 1,301.4 to 1,264.0 s; the cases with host memory by
at most 0.8% (before host memory is filled again, ``planner.make``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner.greedy import Move
from planner.problem import PlanProblem
from planner.simulate import SimResult

__all__ = ["by_deadline", "prefetch_early"]


def prefetch_early(problem: PlanProblem, moves: Sequence[Move], sim: SimResult,
                   capacity_bytes: float) -> list[Move]:
    """``moves`` with each prefetch started as early as the simulated memory curve of ``sim`` (their
    simulation) has room for it, the soonest needed first (NOTE [ Prefetch early, serve by deadline ])."""
    n, iteration = problem.num_ops, sim.iteration_us
    if n == 0:
        return list(moves)
    reached = sim.op_start_us - sim.stall_us_before  # when each op is reached, before its wait
    reached = np.concatenate([reached, reached + iteration, [np.inf]])
    resident = sim.resident_bytes.astype(np.float64)
    out = list(moves)
    ran = [i for i, mv in enumerate(moves) if mv.reads_back and not np.isnan(sim.offload_us[i, 1])]
    for i in sorted(ran, key=lambda i: moves[i].prefetch_deadline):
        mv = moves[i]
        start = mv.prefetch_trigger
        base = start // n * n  # the iteration it starts in, on the unrolled axis
        # a quarter of the time the write took after its simulated end: a write that slow is still done
        began, ended = sim.offload_us[i]
        written = ended + 0.25 * (ended - began) + mv.offload_trigger // n * iteration
        first = max(base, mv.offload_trigger + 1, int(np.searchsorted(reached, written)))
        if first >= start:
            continue
        over = np.flatnonzero(resident[first - base:start - base] + mv.size_bytes > capacity_bytes)
        k = first + (int(over[-1]) + 1 if len(over) else 0)
        if k < start:
            resident[k - base:start - base] += mv.size_bytes
            out[i] = replace(mv, prefetch_trigger=k)
    return out


def by_deadline(moves: Sequence[Move], num_ops: int) -> list[Move]:
    """``moves`` with their prefetches' priorities in the order of their deadlines, then of their
    starts, each counted from the start of the iteration that triggers it (NOTE [ Prefetch early,
    serve by deadline ]); ``num_ops``: the iteration's."""
    n = max(num_ops, 1)

    def due(mv: Move) -> int:  # the deadline, counted from the start of the iteration that triggers it
        return mv.prefetch_deadline - mv.prefetch_trigger // n * n

    order = sorted(range(len(moves)), key=lambda i: (due(moves[i]), moves[i].prefetch_trigger % n, moves[i].priority))
    rank = np.empty(len(moves), np.int64)
    rank[order] = np.arange(len(moves))
    return [replace(mv, prefetch_priority=int(rank[i])) for i, mv in enumerate(moves)]
