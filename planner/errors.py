"""Errors the planner raises for a user's mistake: rooted at ``TeraioError``."""

from __future__ import annotations

from profiles.errors import TeraioError

__all__ = ["InfeasibleBudgetError", "JobGraphError", "PlanFormatError"]


def _readable(n: int) -> str:
    """``n`` bytes in GiB, or in MiB below one GiB (a CPU profile's "0.00 GiB" said nothing)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class InfeasibleBudgetError(TeraioError, ValueError):
    """The device capacity is below what one op needs resident at once: no plan can fit."""

    def __init__(self, op_index: int, op_name: str, need_bytes: int, active_bytes: int,
                 capacity_bytes: int, scratch_bytes: int = 0, phase: str = "") -> None:
        inside = f", {scratch_bytes:,} it allocates inside itself" if scratch_bytes else ""
        # an optimizer's step over every parameter at once (foreach or fused, PyTorch's default
        # where it can) needs them all with their gradients and states: the batch is not in it, and
        # a step per parameter needs one parameter's share (a sweep's fused AdamW: 6.7 MB at once)
        if phase == "optimizer" and ("_foreach_" in op_name or "_fused_" in op_name):  # not clipping's
            other = (" or make the optimizer step one parameter at a time (foreach=False, and fused=False "
                     "where it is set): this op steps them all at once")
        else:
            other = "" if phase == "optimizer" else " or shrink the batch"
        super().__init__(
            f"op {op_index} ({op_name}) needs {need_bytes:,} bytes ({_readable(need_bytes)}) "
            f"resident at once ({active_bytes:,} bytes of its own inputs and outputs{inside}, the rest "
            f"tensors that are never idle there or that cannot move), more than the capacity {capacity_bytes:,} bytes "
            f"({_readable(capacity_bytes)}); the smallest capacity any plan can meet is {need_bytes:,} "
            f"bytes: raise --gpu-mem to that (`--gpu-mem min` plans at it){other}"
        )
        self.op_index = op_index
        self.op_name = op_name
        self.need_bytes = need_bytes
        self.active_bytes = active_bytes
        self.capacity_bytes = capacity_bytes
        self.scratch_bytes = scratch_bytes


class PlanFormatError(TeraioError):
    """plan.json is missing, damaged or of another format version."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class JobGraphError(TeraioError, ValueError):
    """The ranks of a job profile do not fit together: a send without its receive, collectives
    that do not line up, or ranks that would wait on each other for ever (``planner.job``)."""
