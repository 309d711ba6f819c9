"""Lifetime-aware, bandwidth-aware offload planning; imports no torch.

Entry points: ``problem_from_profile`` (profile -> arrays), ``plan_greedy``
(arrays + hardware -> moves), ``planner.simulate.simulate`` (moves -> predicted
time and memory; not re-exported, as its module has its name),
``plan_rank``/``build_plan`` (all of it -> the plan.json model), and
``load_plan``/``save_plan`` for plan.json (format in ``planner.plan``).

Only the errors load eagerly; the rest loads on first use, so that the runtime
can read plans through ``planner.plan`` without numpy, pandas or pyarrow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.errors import InfeasibleBudgetError, PlanFormatError

if TYPE_CHECKING:
    from planner.greedy import Move, plan_greedy
    from planner.hardware import Hardware
    from planner.make import RankPlan, build_plan, plan_rank, summarize
    from planner.plan import FORMAT, Migration, Plan, load_plan, save_plan
    from planner.problem import PlanProblem, problem_from_profile
    from planner.simulate import SimResult

_LAZY = {
    "FORMAT": "planner.plan",
    "Hardware": "planner.hardware",
    "Migration": "planner.plan",
    "Move": "planner.greedy",
    "Plan": "planner.plan",
    "PlanProblem": "planner.problem",
    "RankPlan": "planner.make",
    "SimResult": "planner.simulate",
    "build_plan": "planner.make",
    "load_plan": "planner.plan",
    "plan_greedy": "planner.greedy",
    "plan_rank": "planner.make",
    "problem_from_profile": "planner.problem",
    "save_plan": "planner.plan",
    "summarize": "planner.make",
}

__all__ = [
    "FORMAT",
    "Hardware",
    "InfeasibleBudgetError",
    "Migration",
    "Move",
    "Plan",
    "PlanFormatError",
    "PlanProblem",
    "RankPlan",
    "SimResult",
    "build_plan",
    "load_plan",
    "plan_greedy",
    "plan_rank",
    "problem_from_profile",
    "save_plan",
    "summarize",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
