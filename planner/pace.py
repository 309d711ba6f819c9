"""Planning on a paced clock: where bandwidth, not compute, sets how long a stretch of ops takes.

NOTE [ Paced clock ]: the greedy (``planner.greedy``) fits transfers into the
bandwidth the ops' own time leaves, so it plans as if no op ever waited. Where
no plan can keep up with the ops (NOTE [ Transfer bound ] in
``planner.bound``: an optimizer step that reads every moment back within its
few milliseconds, say), it runs out of bandwidth there, and the ops it cannot
fit are fixed one by one with stalls (NOTE [ Stall fixes ]), each made urgent,
each pushing other transfers late: stalls many times what the bytes need.

The planner therefore plans on a *paced* clock: each phase window (``bound.
phase_windows``) whose bound exceeds its compute time has its ops' durations
stretched in proportion, to the bound times ``1 + margin``; the others keep
theirs. On that clock the bandwidth a window needs is there, and the greedy
places the transfers across it as the stretch allows. The moves are then
simulated on the real durations: the ops of a stretched window wait for the
transfers they need (stalls the simulator counts, and ``settle_urgency`` marks
urgent), about as long as the stretch. A stretched window takes no less than
its bound, and the greedy does not use bandwidth perfectly, so a few margins
are tried (``DEFAULT_MARGINS``), and the unpaced clock when pacing changes
nothing; the caller keeps the plan that simulates fastest.
"""

from __future__ import annotations

import numpy as np

from planner.bound import Bound
from planner.problem import PlanProblem

__all__ = ["DEFAULT_MARGINS", "paced_durations"]

# Measured (BENCHMARKS.md, planner against the bound): on Llama3-8B at batch 16 a margin of 0
# simulates fastest; on Llama3-70B at batch 1, where the greedy fills the optimizer step's
# bandwidth less well, 0.2.
DEFAULT_MARGINS = (0.0, 0.2)


def paced_durations(problem: PlanProblem, bound: Bound, margin: float) -> np.ndarray | None:
    """(num_ops,) float64: ``problem``'s op durations with each window whose bound exceeds its compute
    time stretched to the bound times ``1 + margin`` (NOTE [ Paced clock ]); None if none does."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0, not {margin}")
    compute, target = bound.window_compute_us, bound.window_us
    slow = target > compute * (1 + 1e-9)
    if not slow.any():
        return None
    window = np.searchsorted(bound.window_first_op, np.arange(problem.num_ops), side="right") - 1
    stretch = np.where(slow, target * (1 + margin) / np.where(compute > 0, compute, 1.0), 1.0)
    paced = problem.duration_us * stretch[window]
    # A window of ops that take no time: its time spread evenly over them.
    idle = slow & (compute <= 0)
    if idle.any():
        ops = np.bincount(window, minlength=len(compute))
        even = target * (1 + margin) / np.maximum(ops, 1)
        paced = np.where(idle[window], even[window], paced)
    return paced
