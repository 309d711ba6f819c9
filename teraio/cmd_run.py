"""`teraio run`: train with a plan carried out."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.console import EXIT_BAD_INPUT, EXIT_FAILED, fail, info, who
from teraio.job import gather, job_place, launch, without_nproc, write_json_part

__all__ = ["run"]


# A followed iteration's tracked peak this far over the plan's budget is said (the runtime itself
# keeps within about 1%: tests/compat's runs allow 5%)
_OVER = 1.05


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _causes(steady: dict[str, list[float]] | None) -> str:
    """What the waits from iteration 1 on were for (runtime.executor's ``_wait``), longest first."""
    if not steady:
        return ""
    by_time = sorted(steady.items(), key=lambda kv: -kv[1][1])
    return "; from iteration 1: " + ", ".join(f"{cause} {n:.0f} ({t * 1e3:,.1f} ms)" for cause, (n, t) in by_time)


def _summary(r: dict[str, Any], profiled_from: int = 1, held: bool = False) -> str:
    """The run's summary lines; ``profiled_from``: the first iteration the plan's profile kept (those
    before it may differ from the plan's, as the profile expected); ``held``: run with
    --hold-on-demand."""
    pred = r["predicted"] or {}
    lines = [
        f"peak tracked memory {_mib(r['peak_tracked_bytes'])} from iteration 1 (predicted "
        f"{_mib(pred.get('peak_tracked_after_bytes', pred.get('peak_after_bytes')))}), peak RSS "
        f"{_mib(r['peak_rss_bytes'])}",
        f"iteration time {r['measured_iteration_s'] * 1e3:,.1f} ms (median; predicted "
        f"{pred.get('predicted_iteration_us', float('nan')) / 1e3:,.1f} ms)"
        if r["measured_iteration_s"] else "no complete iteration",
        f"stalls {r['stalls']} ({r['stall_s'] * 1e3:,.1f} ms{_causes(r.get('steady_stalls'))}), on-demand fetches "
        f"{r['on_demand_fetches']}, written {_mib(sum(r['bytes_written'].values()))}, read "
        f"{_mib(sum(r['bytes_read'].values()))}"
        + (f", {r['reused_offloads']} offloads wrote nothing (their kept copy was good)"
           if r.get("reused_offloads") else "")
        + (f", {r['evictions']} tensors sent out on demand to keep to the budget (--hold-on-demand)"
           if r.get("evictions") else ""),
    ]
    budget = pred.get("gpu_mem_bytes")
    if r["unfollowed_iterations"]:
        its = ", ".join(str(u["iteration"]) for u in r["unfollowed_iterations"])
        peaks = r["iteration_peak_bytes"]
        worst = max((peaks[u["iteration"]] for u in r["unfollowed_iterations"] if u["iteration"] < len(peaks)),
                    default=0)
        above_budget = (f"; they peaked at up to {worst / budget:.2f}x the budget" + (
            "; --hold-on-demand sent out what it may (what the plan moves, and what these steps made where "
            "the plan moves such tensors: NOTE [ On demand within the budget ] in runtime/executor.py), and "
            "the rest of what they hold stayed in memory" if held
            else "; --hold-on-demand sends tensors out in them to keep near it")
            if budget and worst > _OVER * budget else "")
        lines.append(f"iterations that ran on demand (their ops left the plan): {its}; the peak above "
                     f"is that of the iterations that followed it{above_budget}")
        unfollowed = {u["iteration"] for u in r["unfollowed_iterations"] if u["iteration"] >= profiled_from}
        n = since = len(r["iteration_followed"])
        while since > 1 and since - 1 in unfollowed:
            since -= 1
        scattered = len(unfollowed & set(range(1, since)))  # before the last run of such iterations
        if n - since >= 3 and scattered <= max(1, (since - 1) // 3):  # DDP's second step, evaluations
            lines.append(f"every iteration from {since} on ran on demand: the steps changed after the profiled "
                         "ones (a layer unfrozen, a head or a param group added, the model cast to another "
                         f"dtype?); profile past the change (teraio profile --warmup {since + 1}) and plan again")
        elif len(unfollowed) >= 3 and 3 * len(unfollowed) >= n - 1:
            first = max(profiled_from, 1)  # those before it the count leaves out (the list above does not)
            lines.append(f"{len(unfollowed)} of the {n - first} iterations from {first} on ran on demand, here and "
                         "there: their ops differ from the plan's (an evaluation every few steps, or ops the data "
                         "decides: a loop whose length it decides, as an episode's, a branch some steps take, a "
                         "model called a varying number of times); a plan holds one sequence of ops, so such "
                         "steps run on demand: make every training step run the same ops (pad to a fixed "
                         "length, take the branch every step) to follow the plan")
    above = [(i, p) for i, (p, f) in enumerate(zip(r["iteration_peak_bytes"], r["iteration_followed"], strict=False))
             if i and f and budget and p > _OVER * budget]
    per_iteration = r.get("iteration_larger_sizes") or []
    grown = [(i, p) for i, (p, f, n) in enumerate(zip(r["iteration_peak_bytes"], r["iteration_followed"],
                                                       per_iteration, strict=False)) if i and f and n]
    if grown and not above and budget:  # over by less than _OVER, or not at all: said all the same
        its = ", ".join(str(i) for i, _ in grown[:8]) + (f" and {len(grown) - 8} more" if len(grown) > 8 else "")
        lines.append(f"in iteration{'s' if len(grown) > 1 else ''} {its}: {sum(per_iteration[i] for i, _ in grown)} "
                     "of the plan's moves found a tensor larger than the profile's and left it in memory (NOTE "
                     "[ Other sizes ] in runtime/executor.py), peaking at up to "
                     f"{max(p for _, p in grown) / budget:.3f}x the budget: sizes that grow after the profiled "
                     "steps need a profile at the largest sizes the script reaches (--warmup past the change)")
    if above:
        its = ", ".join(str(i) for i, _ in above[:8]) + (f" and {len(above) - 8} more" if len(above) > 8 else "")
        which = f"iteration{'s' if len(above) > 1 else ''} {its}"
        larger = sum(per_iteration[i] for i, _ in above if i < len(per_iteration))
        lines.append(f"{which} followed the plan but went over its budget of {_mib(budget)} (up to "
                     f"{max(p for _, p in above) / budget:.2f}x). " + (
                         f"In them {larger} of the plan's moves found a tensor larger than the profile's "
                         "and left it in memory (NOTE [ Other sizes ] in runtime/executor.py): sizes that "
                         "grow after the profiled steps (a longer sequence, a larger batch, a curriculum) "
                         "need a profile at the largest sizes the script reaches (--warmup past the change, "
                         "or profile with those sizes), or inputs padded to fixed sizes. "
                         "Other possible causes: " if larger else "Possible causes: ") + (
                         f"{len(r['not_resizable'])} tensor{'s' if len(r['not_resizable']) > 1 else ''} teraio "
                         "would send out but cannot free in place "
                         "(the warning above: a file mapped by torch.load(mmap=True) or safetensors, numpy's "
                         "memory), which stayed in memory; " if r.get("not_resizable") else "") + (
                         f"{r['other_sizes'] - sum(per_iteration)} of the plan's moves in the run that found a "
                         "tensor smaller than the profile's, or of another name (a smaller batch, a shape the data "
                         "decides) and left it in memory; " if r.get("other_sizes", 0) > sum(per_iteration) else "") + (
                         f"{r['failed_writes']} writes that failed (no room left where they went: the "
                         "warning above), whose tensors stayed in memory; " if r.get("failed_writes") else "")
                     + (f"reads on a thread of the script's own of tensors the plan had out ({r['thread_fetches']} "
                        "brought back: each is in memory while it is read); " if r.get("thread_fetches") else "")
                     + (f"tensors the plan moves out that a collective still used ({r['held_by_collectives']} "
                        "times: the warning above; each stayed in memory until its collective was done, as a "
                        "rank behind the others holds it up); " if r.get("held_by_collectives") else "")
                     + "memory the script came to "
                     "hold after the profiled iterations (a checkpoint loaded and kept, an evaluation's "
                     "results, a history that grows: profile a stretch of steps that holds it, --warmup, or "
                     "plan with that much less --gpu-mem); a torch.save of tensors teraio had moved "
                     "out, in the legacy format or of a GPU's tensors on a thread of the script's own (they "
                     "all come back for the save); writes slower than the plan's bandwidth (a busy disk: plan "
                     "with less --ssd-bw)")
    if r["compiled"]:
        lines.append(f"torch.compile ({', '.join(r['compiled'])}) ran eagerly under teraio: results "
                     "match the eager model's")
    cuda, budget = r.get("peak_cuda_allocated_bytes"), pred.get("gpu_mem_bytes")
    if cuda is not None:
        over = budget is not None and cuda > 1.02 * budget
        scratch = pred.get("max_scratch_bytes")
        lines.insert(1, f"peak CUDA allocated {_mib(cuda)} from iteration 1" + (
            f", {_mib(cuda - budget)} over the plan's {_mib(budget)}: CUDA also counts what libraries "
            "allocate outside any op, which teraio does not see" + ("" if scratch else (
                "; the plan counts nothing that ops allocate inside themselves: its profile measured "
                "none (a profile taken before teraio-profile/3, or not on this GPU: profile again here)")) +
            "; plan with that much less --gpu-mem" if over else ""))
    if r["first_iteration_peak_bytes"] is not None:
        first, steady = r["first_iteration_budget_bytes"], pred.get("gpu_mem_bytes")
        if first is None:
            planned = "no plan for it"
        elif steady is not None and first > steady:  # the plan said it cannot fit the budget
            planned = f"its plan's {_mib(first)}, above the budget of {_mib(steady)}, as the plan warned"
        else:
            planned = f"budget {_mib(first)}"
        lines.insert(1, f"iteration 0 (set-up, optimizer state made): peak tracked memory "
                        f"{_mib(r['first_iteration_peak_bytes'])} (" + planned
                        + (f", left its plan at {r['first_iteration_left_plan_at']}"
                           if r["first_iteration_left_plan_at"] else "") + ")")
    return "\n".join(f"{who()}: {line}" for line in lines)


def run(
    script: Annotated[Path, typer.Argument(help="The training script, run unmodified as __main__.")],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(help="Arguments for the script; put them after `--`.", show_default=False),
    ] = None,
    plan: Annotated[Path, typer.Option(help="The plan written by `teraio plan`.")] = Path("plan.json"),
    swap_dir: Annotated[
        Path | None,
        typer.Option(help="Where swap files go (a private 0700 directory is made inside). "
                          "Default: the system temporary directory."),
    ] = None,
    backend: Annotated[
        str, typer.Option(help="auto (kvikio/GDS with CUDA and kvikio, else posix), posix "
                               "(files), host (host memory only) or kvikio.")
    ] = "auto",
    host_mem: Annotated[
        str | None,
        typer.Option(help="Host-memory pool for host targets, e.g. 4G (K/M/G/T are powers "
                          "of 1024). Default: the plan's --host-mem, at most 64 GiB."),
    ] = None,
    report: Annotated[
        Path | None, typer.Option(help="Write the run report (JSON) here; for a job, one report "
                                       "with every rank's figures. A single process writes it also "
                                       "when the script fails or is stopped, for the steps it ran "
                                       "(not when it ends with os._exit, which skips every exit handler).")
    ] = None,
    nproc: Annotated[int | None, typer.Option(
        min=1, help="Run a job of this many processes on this node, started by PyTorch's launcher "
                    "(torch.distributed.run, as torchrun --nproc-per-node does); each rank follows "
                    "its own section of the plan. Inside a torchrun job (`torchrun ... -m teraio "
                    "run ...`) teraio reads the rank from the environment instead.",
        show_default=False)] = None,
    reuse_copies: Annotated[bool, typer.Option(
        help="Free a tensor that goes out again unchanged against the copy its prefetch kept, "
             "writing nothing (the plan's reuse_copy; teraio drops a copy when an op writes the "
             "tensor). --no-reuse-copies writes every offload: for a script that writes tensors "
             "where teraio cannot see it (from a thread started before teraio, an extension's "
             "kernel called directly, a CUDA graph replayed).")] = True,
    hold_on_demand: Annotated[bool, typer.Option(
        help="In an iteration whose ops leave the plan (an evaluation or a checkpoint between "
             "steps), send the least recently used tensors out before each op so that what it "
             "brings back fits the plan's budget; each op waits for those writes. Without it such "
             "an iteration sends nothing out and may reach the plain run's peak. Not for a script "
             "that uses its tensors where teraio cannot see: ops on threads started before teraio, "
             "pointers kept across ops (C++ code's); those would find a tensor sent out. Tensors "
             "under a thousandth of the budget (at most 1 MiB) stay.")] = False,
    stream_copies: Annotated[bool, typer.Option(
        help="On CUDA with host memory (--backend host): launch each copy on a CUDA stream and make "
             "the op that needs it wait on the GPU, where by default the host waits for the copy "
             "(which lets the GPU run out of queued work). Experimental: on an H200 no faster at 75% "
             "and 50% of the peak, 0.84x at the smallest budget (BENCHMARKS.md). Not for a script "
             "that makes the tensors teraio moves on CUDA streams of its own.")] = False,
) -> None:
    """Run SCRIPT with the plan carried out: same results, less memory.

    Tensors leave memory and come back as the plan says (urgent transfers
    first); any tensor an op needs that is not resident is brought back first,
    so results are bit-identical to a plain run. In a job of several
    processes every rank runs the plan's section for its rank (a plan of
    another job is refused), and a rank that fails stops the job. Exit codes:
    0 done, 1 an I/O error, 2 bad input or a plan made for another profile,
    the script's own code if it fails (a failed rank's, for a job).
    """
    if not script.is_file():
        fail(f"no such script: {script}")
    if backend not in ("auto", "posix", "host", "kvikio"):
        fail(f"--backend must be auto, posix, host or kvikio, not {backend!r}")
    from planner.errors import PlanFormatError
    from planner.plan import check_rank, load_plan
    from profiles.errors import TeraioError
    from runtime.api import offload, run_report
    from runtime.errors import PlanMismatchError, StorageIOError, SwapKeptError
    from teraio.console import teraio_warnings
    from teraio.units import parse_size
    from torch_patch import ScriptFailed, run_script

    try:
        host_bytes = parse_size(host_mem, allow_zero=True) if host_mem is not None else None
        run_plan = load_plan(plan)
    except (ValueError, PlanFormatError) as exc:
        fail(str(exc))
    rank, world_size = job_place()
    if nproc is not None:
        _launch_job(nproc, world_size, swap_dir)
        return
    try:
        check_rank(run_plan, rank, world_size, plan)
    except PlanFormatError as exc:
        fail(str(exc))
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        with teraio_warnings(), offload(run_plan, swap_dir=swap_dir, backend=backend, host_mem_bytes=host_bytes,
                                        rank=rank, reuse_copies=None if reuse_copies else False,
                                        hold_on_demand=hold_on_demand, stream_copies=stream_copies) as executor:
            try:
                run_script(script, list(script_args or []), passthrough=(TeraioError,))
            finally:
                out["executor"] = executor
    except PlanMismatchError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except (StorageIOError, SwapKeptError) as exc:
        fail(str(exc), EXIT_FAILED)
    except ScriptFailed as exc:
        _report_so_far(report, world_size, out, run_plan, t0)
        from torch_patch.identity import STOP_SIGNALS

        stopped_by = {128 + s: s.name for s in STOP_SIGNALS if s != signal.SIGINT}  # runtime.api's exits
        what = f"was stopped by {stopped_by[exc.exit_code]}" if exc.exit_code in stopped_by else "failed"
        fail(f"{script} {what} (exit status {exc.exit_code})", exc.exit_code)
    except KeyboardInterrupt:
        _report_so_far(report, world_size, out, run_plan, t0)
        fail("interrupted; swap files removed", 130)
    except (RuntimeError, OSError) as exc:
        fail(str(exc), EXIT_FAILED)
    r = run_report(out["executor"], run_plan, time.perf_counter() - t0)
    print(_summary(r, run_plan.profiled_from, hold_on_demand), file=sys.stderr)
    if report is None:
        return
    if world_size == 1:
        report.write_text(json.dumps(r, indent=2) + "\n")
        return
    write_json_part(report, rank, r)
    if rank == 0:
        ranks = gather(report, world_size, lambda p: json.loads(p.read_text()))
        report.write_text(json.dumps(job_report(ranks), indent=2) + "\n")


def _report_so_far(report: Path | None, world_size: int, out: dict[str, Any], run_plan: Any, t0: float) -> None:
    """The run report of a script that stopped, for what it ran (one process: a job's ranks would
    wait for the one that stopped)."""
    from runtime.api import run_report

    if report is not None and world_size == 1 and "executor" in out:
        r = run_report(out["executor"], run_plan, time.perf_counter() - t0)
        report.write_text(json.dumps(r, indent=2) + "\n")


def job_report(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run report for a job: every rank's, and the job's figures (an iteration of the job
    takes as long as its slowest rank's)."""
    times = [r["measured_iteration_s"] for r in ranks if r["measured_iteration_s"] is not None]
    return {
        "world_size": len(ranks),
        "measured_iteration_s": max(times) if times else None,
        "slowest_rank": max(range(len(ranks)), key=lambda i: ranks[i]["measured_iteration_s"] or 0.0),
        "peak_tracked_bytes_by_rank": [r["peak_tracked_bytes"] for r in ranks],
        "ranks": {str(i): r for i, r in enumerate(ranks)},
    }


def _launch_job(nproc: int, world_size: int, swap_dir: Path | None) -> None:
    """Start the job's workers; afterwards remove what a rank killed outright left behind."""
    from runtime.swapdir import sweep

    if world_size > 1:
        fail("--nproc inside a torchrun job: give torchrun --nproc-per-node instead")

    def remove_what_killed_ranks_left() -> None:
        swept = sweep(swap_dir)
        if swept.removed:
            info(f"removed the swap files of {len(swept.removed)} ranks that were killed "
                 f"({swept.removed_bytes / 2**20:,.1f} MiB)")

    launch(nproc, without_nproc(sys.argv[1:]), after=remove_what_killed_ranks_left)
