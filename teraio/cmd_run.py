"""`teraio run`: train with a plan carried out."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.console import EXIT_BAD_INPUT, EXIT_FAILED, fail

__all__ = ["run"]


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def _summary(r: dict[str, Any]) -> str:
    pred = r["predicted"] or {}
    lines = [
        f"peak tracked memory {_mib(r['peak_tracked_bytes'])} from iteration 1 (predicted "
        f"{_mib(pred.get('peak_after_bytes'))}), peak RSS {_mib(r['peak_rss_bytes'])}",
        f"iteration time {r['measured_iteration_s'] * 1e3:,.1f} ms (median; predicted "
        f"{pred.get('predicted_iteration_us', float('nan')) / 1e3:,.1f} ms)"
        if r["measured_iteration_s"] else "no complete iteration",
        f"stalls {r['stalls']} ({r['stall_s'] * 1e3:,.1f} ms), on-demand fetches "
        f"{r['on_demand_fetches']}, written {_mib(sum(r['bytes_written'].values()))}, read "
        f"{_mib(sum(r['bytes_read'].values()))}",
    ]
    if r["unfollowed_iterations"]:
        its = ", ".join(str(u["iteration"]) for u in r["unfollowed_iterations"])
        lines.append(f"iterations that ran on demand (their ops left the plan): {its}; the peak above "
                     "is that of the iterations that followed it")
    if r["compiled"]:
        lines.append(f"torch.compile ({', '.join(r['compiled'])}) ran eagerly under teraio: results "
                     "match the eager model's")
    if r["first_iteration_peak_bytes"] is not None:
        budget = r["first_iteration_budget_bytes"]
        lines.insert(1, f"iteration 0 (set-up, optimizer state made): peak tracked memory "
                        f"{_mib(r['first_iteration_peak_bytes'])} ("
                        + (f"budget {_mib(budget)}" if budget is not None else "no plan for it")
                        + (f", left its plan at {r['first_iteration_left_plan_at']}"
                           if r["first_iteration_left_plan_at"] else "") + ")")
    return "\n".join("teraio: " + line for line in lines)


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
        Path | None, typer.Option(help="Write the run report (JSON) here.")
    ] = None,
) -> None:
    """Run SCRIPT with the plan carried out: same results, less memory.

    Tensors leave memory and come back as the plan says (urgent transfers
    first); any tensor an op needs that is not resident is brought back first,
    so results are bit-identical to a plain run. Exit codes: 0 done, 1 an I/O
    error, 2 bad input or a plan made for another profile, the script's own
    code if it fails.
    """
    if not script.is_file():
        fail(f"no such script: {script}")
    if backend not in ("auto", "posix", "host", "kvikio"):
        fail(f"--backend must be auto, posix, host or kvikio, not {backend!r}")
    from planner.errors import PlanFormatError
    from planner.plan import load_plan
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
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        with teraio_warnings(), offload(run_plan, swap_dir=swap_dir, backend=backend,
                                        host_mem_bytes=host_bytes) as executor:
            try:
                run_script(script, list(script_args or []), passthrough=(TeraioError,))
            finally:
                out["executor"] = executor
    except PlanMismatchError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except (StorageIOError, SwapKeptError) as exc:
        fail(str(exc), EXIT_FAILED)
    except ScriptFailed as exc:
        fail(f"{script} failed (exit status {exc.exit_code})", exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted; swap files removed", 130)
    except (RuntimeError, OSError) as exc:
        fail(str(exc), EXIT_FAILED)
    r = run_report(out["executor"], run_plan, time.perf_counter() - t0)
    print(_summary(r), file=sys.stderr)
    if report is not None:
        report.write_text(json.dumps(r, indent=2) + "\n")
