"""The simulated iteration as a Chrome trace (opens in Perfetto or chrome://tracing).

Lanes: the ops (one slice each, named by op), the stalls before ops, and one
async track per channel with a slice per transfer (transfers on one channel
overlap, as they share its bandwidth).
"""

from __future__ import annotations

import math
from typing import Any

from planner.make import RankPlan

__all__ = ["chrome_trace"]

_TIDS = {"ops": 1, "stalls": 2}


def chrome_trace(rank_plan: RankPlan) -> dict[str, Any]:
    """A ``{"traceEvents": [...]}`` document of ``rank_plan``'s simulated (steady) iteration."""
    p, sim = rank_plan.problem, rank_plan.sim
    pid = p.rank
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid} (simulated)"}},
        *({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
          for name, tid in _TIDS.items()),
    ]
    for k in range(p.num_ops):
        start = float(sim.op_start_us[k])
        events.append({"ph": "X", "name": p.op_names[k], "pid": pid, "tid": _TIDS["ops"], "ts": start,
                       "dur": float(p.duration_us[k]), "args": {"op": k, "phase": str(p.phase[k]),
                                                                "resident_bytes": int(sim.resident_bytes[k])}})
        if sim.stall_us_before[k] > 0:
            wait = float(sim.stall_us_before[k])
            events.append({"ph": "X", "name": f"stall before op {k}", "pid": pid, "tid": _TIDS["stalls"],
                           "ts": start - wait, "dur": wait})
        events.append({"ph": "C", "name": "resident bytes", "pid": pid, "ts": start,
                       "args": {"bytes": int(sim.resident_bytes[k])}})
    for i, mv in enumerate(rank_plan.moves):
        for action, times, urgent, channel in (
            ("offload", sim.offload_us[i], mv.urgent_offload, f"{mv.target} write"),
            ("prefetch", sim.prefetch_us[i], mv.urgent_prefetch, f"{mv.target} read"),
        ):
            start, end = float(times[0]), float(times[1])
            if math.isnan(start) or math.isnan(end):
                continue
            common = {"cat": channel, "id": f"{action}-{i}", "pid": pid, "tid": channel,
                      "name": f"{action} {mv.tensor_id}{' (urgent)' if urgent else ''}"}
            events.append({**common, "ph": "b", "ts": start,
                           "args": {"size_bytes": mv.size_bytes, "trigger_op": mv.offload_trigger
                                    if action == "offload" else mv.prefetch_trigger}})
            events.append({**common, "ph": "e", "ts": end})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
