"""NOTE [ Where the time goes ]: the plan report's time per phase against its bound, and what held it.

The phase windows of the bound (NOTE [ Transfer bound ] in ``planner.bound``: a run of ops of one
phase, each micro-batch's forward, its backward, the optimizer step) partition the simulated
iteration, each from the moment its first op is reached (before its stall) to the next one's.
Per phase name, over its windows: the predicted time, the bound, the ops' time, and how long each
channel was busy in them (moving bytes or in a transfer's latency: ``SimResult.window_busy_us``).
A phase well over its bound with one channel busy nearly all of it is bound by that channel; one
well over its bound with every channel idle much of the time waits on memory (a prefetch cannot
start before there is room for it) or on the order of its transfers. A window's time holds the
stall before its first op (the optimizer step's first wait for its states is the step's); the
ops' time is their profiled time, what NOTE [ Copies on the compute ] in ``planner.simulate``
adds to them on a CPU being in the predicted time.

For Llama3-70B at batch 1 on one H100 with 512 GB of host memory (BENCHMARKS.md), the optimizer
step is 3.5 s over its bound with the SSD busy both ways nearly all of it, while host memory's
read channel is idle a third of it and its write channel two thirds: host memory is full.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.bound import Bound
from planner.problem import PlanProblem
from planner.rebalance import window_times_us
from planner.simulate import CHANNELS, SimResult

__all__ = ["phase_report"]


def phase_report(problem: PlanProblem, sim: SimResult, bound: Bound) -> list[dict[str, Any]]:
    """Per phase, in the order each first appears (NOTE [ Where the time goes ]): ``phase``,
    ``windows``, ``predicted_us``, ``bound_us``, ``compute_us`` and ``busy`` (channel -> the share
    of ``predicted_us`` it was busy)."""
    first_ops = bound.window_first_op
    if problem.num_ops == 0 or not len(first_ops):
        return []
    if len(sim.window_busy_us) != len(first_ops):
        raise ValueError(f"a simulation of {len(sim.window_busy_us)} phase windows and a bound of {len(first_ops)}: "
                         "not of the same problem")
    took = window_times_us(sim, first_ops)
    ends = np.vstack([sim.window_busy_us, [[sim.busy_us[c] for c in CHANNELS]]])
    busy = dict(zip(CHANNELS, np.diff(ends, axis=0).T, strict=True))
    out: dict[str, dict[str, Any]] = {}
    for w, op in enumerate(first_ops.tolist()):
        row = out.setdefault(str(problem.phase[op]), {
            "phase": str(problem.phase[op]), "windows": 0, "predicted_us": 0.0, "bound_us": 0.0,
            "compute_us": 0.0, "busy": {c: 0.0 for c in CHANNELS}})
        row["windows"] += 1
        row["predicted_us"] += float(took[w])
        row["bound_us"] += float(bound.window_us[w])
        row["compute_us"] += float(bound.window_compute_us[w])
        for c in CHANNELS:
            row["busy"][c] += float(busy[c][w])
    for row in out.values():
        row["busy"] = {c: (v / row["predicted_us"] if row["predicted_us"] > 0 else 0.0) for c, v in row["busy"].items()}
    return list(out.values())
