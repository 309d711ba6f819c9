"""Planning on a paced clock: where bandwidth, not compute, sets how long a stretch of ops takes.

NOTE [ Paced clock ]: the greedy (``planner.greedy``) fits transfers into the
bandwidth the ops' own time leaves, so it plans as if no op ever waited. Where
no plan can keep up with the ops (NOTE [ Transfer bound ] in
``planner.bound``: an optimizer step that reads every moment back within its
few milliseconds, say), it runs out of bandwidth there, and the ops it cannot
fit are fixed one by one with stalls (NOTE [ Stall fixes ]), each made urgent,
each pushing other transfers late: stalls many times what the bytes need.

The planner therefore plans on a *paced* clock: each phase window (``bound.
phase_windows``) whose transfers need more time than its ops take has its ops'
durations stretched in proportion, to that time times ``1 + margin``; the
others keep theirs. On that clock the bandwidth such a window needs is there,
and the greedy places the transfers across it. The moves are then simulated on
the real durations: the ops of a stretched window wait for the transfers they
need (stalls the simulator counts, and ``settle_urgency`` marks urgent), about
as long as the stretch, since a window whose channels are busy runs as slowly
as the clock it was planned on. The margin is headroom: the greedy does not fill
a channel to the last byte, and it moves more than the bound counts. Too little
leaves ops to the stall fixes, too much slows the window down for nothing, so
the margins of ``DEFAULT_MARGINS`` are tried, and the ops' own clock too (on
some small synthetic profiles it wins); the caller paces by two bounds where
copies can be kept (``planner.make.plan_rank``) and keeps the plan that
simulates fastest. Stretching also the windows whose transfers barely fit their
ops (a backward pass that must read back every parameter, gradient and
activation it uses) was tried and simulated slower (BENCHMARKS.md).
"""

from __future__ import annotations

import numpy as np

from planner.bound import Bound
from planner.problem import PlanProblem

__all__ = ["DEFAULT_MARGINS", "paced_durations"]

# Measured (BENCHMARKS.md, planner against the bound): 0.2 simulated fastest of 0, 0.1, 0.2, 0.35,
# 0.6 and 1 on Llama3-8B at batch 16 and Llama3-70B at batches 1, 4 and 16.
DEFAULT_MARGINS = (0.2,)


def paced_durations(problem: PlanProblem, bound: Bound, margin: float) -> np.ndarray | None:
    """(num_ops,) float64: ``problem``'s op durations with each window whose transfers need more than
    its compute time stretched to that times ``1 + margin`` (NOTE [ Paced clock ]); None if none does."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, not {margin}")
    compute = bound.window_compute_us
    slow = bound.window_transfer_us > compute * (1 + 1e-9)
    target = bound.window_transfer_us * (1 + margin)
    if not slow.any():
        return None
    window = np.searchsorted(bound.window_first_op, np.arange(problem.num_ops), side="right") - 1
    stretch = np.where(slow, target / np.where(compute > 0, compute, 1.0), 1.0)
    paced = problem.duration_us * stretch[window]
    # A window of ops that take no time: its time spread evenly over them.
    idle = slow & (compute <= 0)
    if idle.any():
        ops = np.bincount(window, minlength=len(compute))
        even = target / np.maximum(ops, 1)
        paced = np.where(idle[window], even[window], paced)
    return paced
