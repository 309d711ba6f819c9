"""``offload``: run training code under a plan (the Python API behind `teraio run`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from planner.plan import Plan, check_rank, load_plan
from runtime.backends import Backend, HostBackend, KvikioBackend, PosixBackend
from runtime.engine import MigrationEngine
from runtime.errors import SwapKeptError
from runtime.executor import PlanExecutor, signals_held
from runtime.memory import peak_rss_bytes, reset_peak_rss
from runtime.swapdir import sweep
from torch_patch.identity import STOP_SIGNALS

__all__ = ["first_iteration_warning", "make_backends", "offload", "run_report", "write_report"]

DEFAULT_HOST_POOL_BYTES = 1 << 30  # when the plan names none, or --backend host keeps everything there
MAX_HOST_POOL_BYTES = 64 << 30


def make_backends(backend: str, swap_dir: str | os.PathLike[str] | None,
                  host_mem_bytes: int, cuda: bool | None = None) -> dict[str, Backend]:
    """The backend for each plan target ("ssd", "host"), chosen once at start. The host pool
    is allocated at its first use (none with ``host_mem_bytes`` 0). ``cuda``: whether the script
    trains on CUDA (by default, whether CUDA is available): only then is the host pool pinned and
    does ``auto`` take kvikio."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    host = HostBackend(host_mem_bytes, pin=cuda, spill_dir=swap_dir)
    if backend == "host":
        return {"ssd": host, "host": host}
    if backend == "kvikio" or (backend == "auto" and cuda and _has_kvikio()):
        return {"ssd": KvikioBackend(swap_dir), "host": host}
    if backend not in ("auto", "posix"):
        raise ValueError(f"unknown backend {backend!r}: choose auto, posix, host or kvikio")
    return {"ssd": PosixBackend(swap_dir), "host": host}


def first_iteration_warning(plan: Plan, device_bytes: int) -> str | None:
    """Why the first iteration may not fit ``device_bytes``; None if it should. Its own
    plan (NOTE [ The first iteration's plan ] in planner.plan) may need more than the steady
    plan's budget; a plan without one leaves it unplanned."""
    device = f"the device's {device_bytes / 2**30:.2f} GiB"
    if plan.first is None:
        peak = int(plan.summary.get("peak_before_bytes") or 0)
        if peak <= device_bytes:
            return None
        return (f"this plan has no plan for iteration 0 (its profile did not record it: profile "
                f"and plan again with this teraio), so iteration 0 may need up to the profiled "
                f"peak, {peak / 2**30:.2f} GiB, more than {device}: it may run out of memory")
    need = plan.first.budget_bytes or 0
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


def _sweep(swap_dir: str | os.PathLike[str] | None) -> None:
    """Remove the swap directories of earlier runs that were killed (NOTE [ Swap directories ]
    in runtime.swapdir), and say so."""
    found = sweep(swap_dir)
    if found.removed:
        warnings.warn(f"teraio: removed {len(found.removed)} swap directories left by runs that were "
                      f"killed ({found.removed_bytes / 2**20:,.1f} MiB freed) under "
                      f"{found.removed[0].parent}", RuntimeWarning, stacklevel=4)


@contextmanager
def offload(plan: str | os.PathLike[str] | Plan, *, swap_dir: str | os.PathLike[str] | None = None,
            backend: str = "auto", host_mem_bytes: int | None = None,
            report: str | os.PathLike[str] | None = None, num_workers: int = 2,
            rank: int | None = None, reuse_copies: bool | None = None,
            hold_on_demand: bool = False, stream_copies: bool = False) -> Iterator[PlanExecutor]:
    """Train under ``plan``: the body's ops run with the plan's transfers carried out.

    Results are bit-identical to running the body without it. Every tensor
    moved out is back when the block ends; swap files are removed on exit, on
    error, on Ctrl-C and on SIGTERM, SIGHUP and SIGQUIT (each turned into ``SystemExit``
    with 128 + its number, where it would have ended the process outright). A tensor that
    cannot be brought back at exit keeps its bytes in a ``teraio-kept-*``
    directory, and ``SwapKeptError`` names them (chained to the exception that
    ended the block, if one did). ``rank``: which rank's section of the plan to
    follow; by default torchrun's ``RANK`` (0 outside a job). ``reuse_copies`` false: every
    offload writes, none reuses a copy its prefetch kept (NOTE [ Copies kept ] in
    ``planner.clean``; by default true unless ``TERAIO_REUSE_COPIES=0``): for a script that
    writes tensors where teraio's dispatch mode cannot see it. ``hold_on_demand``: iterations
    that leave the plan send the least recently used tensors out to keep to its budget (NOTE [ On
    demand within the budget ] in ``runtime.executor``; not for a script that uses its tensors
    where teraio cannot see: ops on threads started before it, pointers). ``stream_copies``: on
    CUDA with host memory, copies launched on CUDA streams that the op needing one waits for on the
    GPU, not the host (NOTE [ Copies ordered on streams ] in ``runtime.engine``; no faster on an H200).
    """
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    run_plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if rank not in run_plan.migrations:  # it would run with nothing moved, silently
        check_rank(run_plan, rank, int(os.environ.get("WORLD_SIZE", run_plan.job_size)),
                   "plan" if isinstance(plan, Plan) else plan)
    # NOTE [ A CPU script on a GPU machine ]: a plan made from a CPU profile runs without
    # touching CUDA (a context takes device memory a neighbour may be using, pinning takes host
    # memory): no device memory asked for, no pinned pool, no kvikio. A plan that does not say
    # (made before 2026-11-26) runs as one for CUDA wherever CUDA is available.
    cuda = run_plan.device_type != "cpu" and torch.cuda.is_available()
    if cuda:
        why = first_iteration_warning(run_plan, torch.cuda.mem_get_info()[1])
        if why is not None:
            warnings.warn(f"teraio: {why}", RuntimeWarning, stacklevel=3)
    _sweep(swap_dir)
    host_bytes = host_mem_bytes
    if host_bytes is None:  # the plan's (0: none), or a default pool when it names none
        host_bytes = run_plan.host_mem_bytes
        if host_bytes is None or (backend == "host" and host_bytes == 0):
            host_bytes = DEFAULT_HOST_POOL_BYTES
    # One cleanup for everything from here on: whatever fails or is interrupted (a backend
    # that cannot be made, the executor's checks, Ctrl-C while torch is being patched) stops
    # the threads and removes the swap directories, keeping what is still out.
    backends: dict[str, Backend] = {}
    engine: MigrationEngine | None = None
    executor: PlanExecutor | None = None
    old_handlers: dict[int, Any] = {}
    ended_by: BaseException | None = None
    t0 = time.perf_counter()
    try:
        backends = make_backends(backend, swap_dir, min(host_bytes, MAX_HOST_POOL_BYTES), cuda)
        engine = MigrationEngine(num_workers)
        if reuse_copies is None:
            reuse_copies = os.environ.get("TERAIO_REUSE_COPIES", "1") != "0"
        executor = PlanExecutor(run_plan, backends, engine, rank, reuse_copies=reuse_copies,
                                hold_on_demand=hold_on_demand, stream_copies=stream_copies)
        _signals_as_exit(old_handlers)
        reset_peak_rss()
        t0 = time.perf_counter()
        with executor:
            yield executor
    except BaseException as exc:
        ended_by = exc
        raise
    finally:
        try:
            # as the exit's restore: a signal waits until what is still out is kept, the report
            # written and the error naming the kept files raised (then it carries that error)
            # (NOTE [ Forked children ]: the parent's engine, swap files and report are not a
            # forked child's to close)
            with signals_held():
                if executor is None or not executor.forked():
                    if engine is not None:
                        engine.close()
                    kept = _close_backends(executor, backends)
                    if report is not None and executor is not None:
                        write_report(report, executor, run_plan, time.perf_counter() - t0)
                    if kept is not None:
                        raise kept from ended_by
        finally:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)


def _close_backends(executor: PlanExecutor | None,
                    backends: dict[str, Backend]) -> SwapKeptError | None:
    """Close every backend, keeping the bytes of the tensors still out (those the executor
    could not restore); the error that names them, if any."""
    keep: dict[int, dict[int, dict[str, Any]]] = {}
    named: list[str] = []
    if executor is not None:  # else it was never made: nothing is out
        errors = {e.tensor_id: e.problem for e in getattr(executor, "restore_errors", [])}
        for tid, entry in executor.moved.items():
            what = executor._describe(tid)
            keep.setdefault(id(entry.backend), {})[entry.key] = {
                "tensor_id": tid, "tensor": what, "size_bytes": entry.nbytes,
                "problem": errors.get(tid, "not restored")}
            named.append(f"{what}: {errors.get(tid, 'not restored')}")
    kept = []
    for backend in {id(b): b for b in backends.values()}.values():
        path = backend.close(keep.get(id(backend), {}))
        if path is not None:
            kept.append(path)
    return SwapKeptError(kept, named) if kept else None


def _signals_as_exit(old: dict[int, Any]) -> None:
    """Make each of ``STOP_SIGNALS`` but SIGINT that would end the process outright, leaving swap
    files and no report (its handler is the default one: not ignored, as ``nohup`` ignores SIGHUP,
    nor handled) raise ``SystemExit(128 + its number)`` instead, so that the run cleans up as on
    Ctrl-C; the handlers replaced go to
    ``old`` as each is (the caller's, to restore them all even if a signal lands here). A handler
    ``faulthandler.register`` installed looks like the default one from Python and is replaced."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT and signal.getsignal(sig) == signal.SIG_DFL:
            old[sig] = signal.SIG_DFL
            signal.signal(sig, lambda signum, _: sys.exit(128 + signum))


def run_report(executor: PlanExecutor, plan: Plan, wall_s: float) -> dict[str, Any]:
    s = executor.stats
    steady = [t for t, f in zip(s.iteration_s[1:], s.iteration_followed[1:], strict=False) if f] \
        or s.iteration_s[1:] or s.iteration_s
    measured_iter = sorted(steady)[len(steady) // 2] if steady else None
    written, read = dict(s.bytes_written), dict(s.bytes_read)
    # NOTE [ Copy streams ]: bytes over the time at least one transfer of that direction was moving
    # them (not a CUDA transfer's wait for the compute to reach it), from iteration 1 on (iteration
    # 0 pins the host pool at its first write), or over the whole run where only iteration 0 moved
    bandwidth = {}
    for d in ("write", "read"):
        moved, busy = s.iteration_moved_bytes[d], s.iteration_busy_s[d]
        if sum(busy[1:]) > 0:
            moved, busy = moved[1:], busy[1:]
        bandwidth[d] = sum(moved) / sum(busy) if sum(busy) > 0 else None
    # Iteration 0 has a plan of its own (NOTE [ The first iteration's plan ] in planner.plan):
    # its peak is reported apart; the peak of the run is that of the iterations that
    # followed the steady plan (the others ran on demand: NOTE [ Boundaries ]).
    peaks = s.iteration_peak_bytes
    followed = [p for p, f in zip(peaks[1:], s.iteration_followed[1:], strict=False) if f]
    rss = s.iteration_peak_rss_bytes
    followed_rss = [p for p, f in zip(rss[1:], s.iteration_followed[1:], strict=False) if f]
    cuda = s.iteration_peak_cuda_bytes
    followed_cuda = [p for p, f in zip(cuda[1:], s.iteration_followed[1:], strict=False) if f]
    return {
        "peak_tracked_bytes": max(followed or peaks[1:] or peaks or [s.peak_tracked_bytes]),
        "first_iteration_peak_bytes": peaks[0] if peaks else None,
        # the budget iteration 0 was planned for (None: no plan for it), and where it left that plan
        "first_iteration_budget_bytes": plan.first.budget_bytes if plan.first is not None else None,
        "first_iteration_left_plan_at": executor.first_left_at,
        "iteration_peak_bytes": peaks,
        # per iteration: whether it followed its plan to the end (else it ran on demand)
        "iteration_followed": s.iteration_followed,
        "unfollowed_iterations": executor.unfollowed,
        "peak_rss_bytes": max(followed_rss or rss[1:] or rss or [peak_rss_bytes()]),
        "iteration_peak_rss_bytes": rss,
        # CUDA: the allocator's peak of allocated bytes in followed iterations; None on CPU
        "peak_cuda_allocated_bytes": max(followed_cuda or cuda) if cuda else None,
        "iteration_peak_cuda_allocated_bytes": cuda,
        "stalls": s.stalls,
        "stall_s": s.stall_s,
        "iteration_stall_s": s.iteration_stall_s,
        # from iteration 1 on, by cause: {"room": [waits, seconds], ...} (PlanExecutor._wait)
        "steady_stalls": s.steady_stalls,
        "on_demand_fetches": s.on_demand_fetches,
        "iteration_on_demand_fetches": s.iteration_on_demand_fetches,
        # NOTE [ On demand within the budget ] in runtime.executor
        "evictions": s.evictions,
        # NOTE [ Copies kept ]: offloads that wrote nothing, and kept copies an op wrote over
        "reused_offloads": s.reused_offloads,
        "dropped_copies": s.dropped_copies,
        "cancelled_offloads": s.cancelled_offloads,
        "failed_writes": s.failed_writes,
        "not_resizable": s.not_resizable,
        "save_fetches": s.save_fetches,
        "thread_fetches": s.thread_fetches,
        "held_by_collectives": s.held_by_collectives,
        "other_sizes": s.other_sizes,
        "iteration_larger_sizes": s.iteration_larger_sizes,
        "compiled": executor.compiled,
        "bytes_written": written,
        "bytes_read": read,
        "write_bandwidth_bytes_per_s": bandwidth["write"],
        "read_bandwidth_bytes_per_s": bandwidth["read"],
        "iteration_moved_bytes": s.iteration_moved_bytes,
        "iteration_busy_s": s.iteration_busy_s,
        "iterations": len(s.iteration_s),
        "iteration_s": s.iteration_s,
        "measured_iteration_s": measured_iter,
        "predicted": plan.summary,
        "wall_s": wall_s,
    }


def write_report(path: str | os.PathLike[str], executor: PlanExecutor, plan: Plan,
                 wall_s: float) -> None:
    Path(path).write_text(json.dumps(run_report(executor, plan, wall_s), indent=2) + "\n")
