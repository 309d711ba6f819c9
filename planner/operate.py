"""What running a plan asks of the machine: SSD wear, and the bandwidth a target speed needs."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from planner.hardware import Hardware
from planner.make import plan_rank
from planner.problem import PlanProblem

__all__ = ["DEFAULT_SSD_ENDURANCE_PBW", "bandwidth_needed", "ssd_wear"]

# A mainstream data-centre NVMe drive: the TBA paper (shared/papers, Table 1) names the
# Solidigm D7-P5620 as the mainstream model, rated 3 drive writes per day for 5 years;
# the 12.8 TB model then allows 3 * 12.8 TB * 365 * 5 = 70 PB written (its datasheet's
# 70 PBW). Sequential writes of large tensors wear a drive less than the JESD random-write
# test behind the rating (the same paper: about 2.5x), so this is a conservative figure.
DEFAULT_SSD_ENDURANCE_PBW = 70.0
_DAY_S = 86_400.0


def ssd_wear(bytes_to_ssd_per_iteration: int, iteration_us: float,
             endurance_pbw: float = DEFAULT_SSD_ENDURANCE_PBW) -> dict[str, Any]:
    """SSD bytes written per iteration and per day at ``iteration_us``, and the drive's life.

    ``bytes_to_ssd_per_iteration``: what the offloads to the SSD write each iteration (one that
    reuses a kept copy writes nothing: NOTE [ Copies kept ] in ``planner.clean``); prefetches only
    read. ``ssd_life_years`` is None when nothing is written.
    """
    if not endurance_pbw > 0:
        raise ValueError(f"the SSD endurance must be positive, not {endurance_pbw} PBW")
    per_day = bytes_to_ssd_per_iteration * _DAY_S / (iteration_us * 1e-6) if iteration_us > 0 else 0.0
    life = endurance_pbw * 1e15 / (per_day * 365.0) if per_day > 0 else None
    return {"ssd_bytes_per_iteration": int(bytes_to_ssd_per_iteration), "ssd_bytes_per_day": per_day,
            "ssd_endurance_pbw": endurance_pbw, "ssd_life_years": life}


def bandwidth_needed(problem: PlanProblem, hw: Hardware, fraction: float, *, low_gb_per_s: float = 0.25,
                  high_gb_per_s: float = 4096.0, steps: int = 8) -> float | None:
    """The SSD bandwidth (GB/s each way) at which the plan reaches ``fraction`` of ideal throughput.

    A bisection on a log scale between ``low_gb_per_s`` and ``high_gb_per_s``
    (throughput grows with bandwidth), planning at each point: ``steps`` plans
    give the answer to within a factor ``(high / low) ** (1 / 2**steps)``
    (4% with the defaults), rounded up. None if even ``high_gb_per_s`` falls short.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], not {fraction}")

    def reaches(gb_per_s: float) -> bool:
        bw = gb_per_s * 1e9
        sim = plan_rank(problem, replace(hw, ssd_read_bw_bytes_per_s=bw, ssd_write_bw_bytes_per_s=bw)).sim
        return sim.fits and 1.0 / sim.slowdown >= fraction

    if not reaches(high_gb_per_s):
        return None
    lo, hi = math.log(low_gb_per_s), math.log(high_gb_per_s)
    if reaches(low_gb_per_s):
        return low_gb_per_s
    for _ in range(steps):
        mid = (lo + hi) / 2
        if reaches(math.exp(mid)):
            hi = mid
        else:
            lo = mid
    return math.exp(hi)
