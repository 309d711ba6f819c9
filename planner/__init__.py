"""Lifetime-aware, bandwidth-aware offload planning; imports no torch.

Entry points: ``problem_from_profile`` (profile -> arrays), ``plan_greedy``
(arrays + hardware -> moves), ``simulate`` (moves -> predicted time and
memory), ``plan_rank``/``build_plan`` (all of it -> the plan.json model), and
``load_plan``/``save_plan`` for plan.json (format in ``planner.plan``).
"""

from planner.errors import InfeasibleBudgetError, PlanFormatError
from planner.greedy import Move, plan_greedy
from planner.hardware import Hardware
from planner.make import RankPlan, build_plan, plan_rank, summarize
from planner.plan import FORMAT, Migration, Plan, load_plan, save_plan
from planner.problem import PlanProblem, problem_from_profile
from planner.simulate import SimResult, simulate

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
    "simulate",
    "summarize",
]
