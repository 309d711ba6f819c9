"""``offload``: run training code under a plan (the Python API behind `teraio run`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from profiles.errors import TeraioError
from runtime.backends import Backend, HostBackend, KvikioBackend, PosixBackend
from runtime.engine import MigrationEngine
from runtime.executor import FirstPlan, Move, PlanExecutor
from runtime.memory import peak_rss_bytes, reset_peak_rss

__all__ = ["RunPlan", "load_run_plan", "make_backends", "offload"]

PLAN_FORMAT = "teraio-plan/1"
DEFAULT_HOST_POOL_BYTES = 1 << 30


class PlanFileError(TeraioError):
    """plan.json is missing, damaged or of another version."""


@dataclass(frozen=True)
class RunPlan:
    """What the runtime takes from plan.json for one rank."""

    signature: str
    moves: list[Move]
    op_names: list[str] | None
    host_mem_bytes: int | None
    summary: dict[str, Any]
    budget_bytes: int | None = None  # the device memory the plan was made for
    first: FirstPlan | None = None  # iteration 0's plan, if the profile recorded it


def load_run_plan(path: str | os.PathLike[str], rank: int = 0) -> RunPlan:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"{p}: no such plan file; make one with `teraio plan`") from None
    except (OSError, ValueError) as exc:
        raise PlanFileError(f"{p}: not a readable plan ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise PlanFileError(f"{p}: format {found!r}, expected {PLAN_FORMAT!r}")
    try:
        moves, op_names = _moves_of(doc, rank)
        params = doc.get("parameters", {})
        host = params.get("host_mem_bytes")
        budget = params.get("gpu_mem_bytes")
        first = doc.get("first_iteration")
        first_plan = None
        if first is not None and str(rank) in first.get("ranks", {}):
            first_moves, first_names = _moves_of(first, rank)
            first_budget = first.get("parameters", {}).get("gpu_mem_bytes")
            carried = first.get("carried_into_next", {}).get(str(rank), {})
            first_plan = FirstPlan(first_moves, list(first_names or []),
                                   int(first_budget) if first_budget is not None else None,
                                   {int(k): int(v) for k, v in carried.items()})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanFileError(f"{p}: malformed plan ({exc!r} missing or wrong)") from None
    if any(m.action not in ("offload", "prefetch") for m in moves):
        raise PlanFileError(f"{p}: an action other than offload or prefetch")
    return RunPlan(str(doc.get("signature", "")), moves, op_names,
                   int(host) if host is not None else None, dict(doc.get("summary", {})),
                   int(budget) if budget is not None else None, first_plan)


def _moves_of(doc: dict[str, Any], rank: int) -> tuple[list[Move], list[str] | None]:
    """The moves and op names of one rank of a plan document (or of its first iteration's)."""
    entries = doc["ranks"][str(rank)]
    num_ops = int(doc.get("num_ops", {}).get(str(rank), 0)) or None
    prefetch_at = {(m["tensor_id"], m.get("period_start_op")): int(m["trigger_op"])
                   for m in entries if m["action"] == "prefetch"}
    moves = [
        Move(tensor_id=int(m["tensor_id"]), action=str(m["action"]),
             target=str(m.get("target") or m.get("source")), trigger_op=int(m["trigger_op"]),
             deadline_op=int(m["deadline_op"]), size_bytes=int(m["size_bytes"]),
             urgent=bool(m.get("urgent", False)), name=m.get("name"),
             out_at_boundary=m["action"] == "offload" and _out_at_boundary(m, prefetch_at, num_ops))
        for m in entries
    ]
    return moves, doc.get("op_names", {}).get(str(rank))


def _out_at_boundary(offload: dict[str, Any], prefetch_at: dict[tuple[Any, Any], int],
                     num_ops: int | None) -> bool:
    """Whether the plan has this offload's tensor out when an iteration begins.

    That is a period that spans the boundary (``wraps``) whose offload is triggered
    before it: after its own prefetch once both are folded into one iteration, or,
    with no prefetch (a trailing period, NOTE [ Offloads without a prefetch ] in
    ``planner.plan``), at ``period_start_op + 1`` still inside the iteration.
    """
    if not offload.get("wraps"):
        return False
    trigger = int(offload["trigger_op"])
    prefetch = prefetch_at.get((offload["tensor_id"], offload.get("period_start_op")))
    if prefetch is not None:
        return trigger > prefetch
    start = offload.get("period_start_op")
    return num_ops is not None and start is not None and int(start) + 1 < num_ops


def make_backends(backend: str, swap_dir: str | os.PathLike[str] | None,
                  host_mem_bytes: int) -> dict[str, Backend]:
    """The backend for each plan target ("ssd", "host"), chosen once at start."""
    host = HostBackend(host_mem_bytes)
    if backend == "host":
        return {"ssd": host, "host": host}
    if backend == "kvikio" or (backend == "auto" and torch.cuda.is_available()
                               and _has_kvikio()):
        return {"ssd": KvikioBackend(swap_dir), "host": host}
    if backend not in ("auto", "posix"):
        raise ValueError(f"unknown backend {backend!r}: choose auto, posix, host or kvikio")
    return {"ssd": PosixBackend(swap_dir), "host": host}


def first_iteration_warning(run_plan: RunPlan, device_bytes: int) -> str | None:
    """Why the first iteration may not fit ``device_bytes``; None if it should. Its own
    plan (NOTE [ Following the first iteration ] in runtime.executor) may need more than
    the steady plan's budget; a plan without one leaves it unplanned."""
    device = f"the device's {device_bytes / 2**30:.2f} GiB"
    if run_plan.first is None:
        peak = int(run_plan.summary.get("peak_before_bytes") or 0)
        if peak <= device_bytes:
            return None
        return (f"this plan has no plan for iteration 0 (its profile did not record it: profile "
                f"and plan again with this teraio), so iteration 0 may need up to the profiled "
                f"peak, {peak / 2**30:.2f} GiB, more than {device}: it may run out of memory")
    need = run_plan.first.budget_bytes or 0
    if need <= device_bytes:
        return None
    return (f"iteration 0 (set-up, and the optimizer making its state) is planned for "
            f"{need / 2**30:.2f} GiB, the least it fits in, more than {device}: it may run out "
            "of memory")


def _has_kvikio() -> bool:
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def offload(plan: str | os.PathLike[str] | RunPlan, *, swap_dir: str | os.PathLike[str] | None = None,
            backend: str = "auto", host_mem_bytes: int | None = None,
            report: str | os.PathLike[str] | None = None, num_workers: int = 2,
            follow_from: int = 1) -> Iterator[PlanExecutor]:
    """Train under ``plan``: the body's ops run with the plan's transfers carried out.

    Results are bit-identical to running the body without it. Every tensor
    moved out is back when the block ends; swap files are removed on exit,
    on error and on Ctrl-C (SIGTERM is turned into ``SystemExit``).
    """
    run_plan = plan if isinstance(plan, RunPlan) else load_run_plan(plan)
    if torch.cuda.is_available():
        why = first_iteration_warning(run_plan, torch.cuda.mem_get_info()[1])
        if why is not None:
            warnings.warn(f"teraio: {why}", RuntimeWarning, stacklevel=3)
    host_bytes = host_mem_bytes or run_plan.host_mem_bytes or DEFAULT_HOST_POOL_BYTES
    backends = make_backends(backend, swap_dir, min(host_bytes, DEFAULT_HOST_POOL_BYTES * 64))
    engine = MigrationEngine(num_workers)
    executor = PlanExecutor(run_plan.moves, run_plan.op_names, backends, engine, follow_from,
                            run_plan.budget_bytes, run_plan.first)
    old_term = _term_as_exit()
    t0 = time.perf_counter()
    reset_peak_rss()
    try:
        with executor:
            yield executor
    finally:
        engine.close()
        for b in {id(b): b for b in backends.values()}.values():
            b.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if report is not None:
            write_report(report, executor, run_plan, time.perf_counter() - t0)


def _term_as_exit() -> Any:
    if sys.platform == "win32":
        return None
    try:
        return signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    except ValueError:  # not the main thread
        return None


def run_report(executor: PlanExecutor, plan: RunPlan, wall_s: float) -> dict[str, Any]:
    s = executor.stats
    steady = s.iteration_s[1:] or s.iteration_s
    measured_iter = sorted(steady)[len(steady) // 2] if steady else None
    written, read = dict(s.bytes_written), dict(s.bytes_read)
    # Iteration 0 has a plan of its own (see runtime.executor): its peak is reported apart.
    peaks = s.iteration_peak_bytes
    followed = peaks[executor.follow_from:] or peaks or [s.peak_tracked_bytes]
    rss = s.iteration_peak_rss_bytes
    followed_rss = rss[executor.follow_from:] or rss or [peak_rss_bytes()]
    cuda = s.iteration_peak_cuda_bytes
    return {
        "peak_tracked_bytes": max(followed),
        "first_iteration_peak_bytes": peaks[0] if peaks else None,
        # the budget iteration 0 was planned for (None: no plan for it), and where it left that plan
        "first_iteration_budget_bytes": executor.first.budget_bytes if executor.first is not None else None,
        "first_iteration_left_plan_at": executor.first_left_at,
        "iteration_peak_bytes": peaks,
        "peak_rss_bytes": max(followed_rss),
        "iteration_peak_rss_bytes": rss,
        # CUDA: the allocator's peak of allocated bytes in followed iterations; None on CPU
        "peak_cuda_allocated_bytes": max(cuda[executor.follow_from:] or cuda) if cuda else None,
        "iteration_peak_cuda_allocated_bytes": cuda,
        "stalls": s.stalls,
        "stall_s": s.stall_s,
        "iteration_stall_s": s.iteration_stall_s,
        "on_demand_fetches": s.on_demand_fetches,
        "cancelled_offloads": s.cancelled_offloads,
        "failed_writes": s.failed_writes,
        "bytes_written": written,
        "bytes_read": read,
        "write_bandwidth_bytes_per_s": sum(written.values()) / s.write_busy_s
        if s.write_busy_s else None,
        "read_bandwidth_bytes_per_s": sum(read.values()) / s.read_busy_s if s.read_busy_s else None,
        "iterations": len(s.iteration_s),
        "iteration_s": s.iteration_s,
        "measured_iteration_s": measured_iter,
        "predicted": plan.summary,
        "diverged_at": executor.diverged if executor.divergence_reported else None,
        "wall_s": wall_s,
    }


def write_report(path: str | os.PathLike[str], executor: PlanExecutor, plan: RunPlan,
                 wall_s: float) -> None:
    Path(path).write_text(json.dumps(run_report(executor, plan, wall_s), indent=2) + "\n")


__all__ += ["PlanFileError", "run_report"]
