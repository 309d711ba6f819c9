"""`teraio roofline`: predicted throughput against transfer bandwidth, planner and baselines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.cmd_plan import PROFILE_ARG, hardware_from_options, load_profile
from teraio.console import fail, info

__all__ = ["roofline", "roofline_table"]


def roofline_table(profile: Any, hw_of_bw: Any, bandwidths: list[float], rank: int = 0) -> list[dict[str, Any]]:
    """Per bandwidth (GB/s): each policy's throughput over ideal (0.0 when it does not fit)."""
    from planner import InfeasibleBudgetError, plan_rank, problem_from_profile
    from planner.baselines import run_baselines

    problem = problem_from_profile(profile, rank)
    rows = []
    for bw in bandwidths:
        hw = hw_of_bw(bw)
        try:
            policies = {"planner": plan_rank(problem, hw)}
        except InfeasibleBudgetError as exc:
            fail(str(exc))
        policies.update(run_baselines(profile, problem, hw, rank))
        rows.append({"bw_gb_per_s": bw, **{
            name: (round(1 / rp.sim.slowdown, 4) if rp.sim.fits else 0.0) for name, rp in policies.items()}})
    return rows


def roofline(
    profile: Annotated[Path | None, PROFILE_ARG] = None,
    gpu_mem: Annotated[str | None, typer.Option(
        help="Device memory to fit in, e.g. 80G. K/M/G/T are binary (powers of 1024); a plain number "
             "is bytes. Default: the profiled device's.", show_default=False)] = None,
    bw: Annotated[str, typer.Option(
        help="Comma-separated SSD bandwidths to try, GB/s (1e9 bytes/s) each way.")] = "4,8,16,32,64",
    host_mem: Annotated[str, typer.Option(
        help="Host memory for offloaded tensors (0: SSD only). K/M/G/T are powers of 1024.")] = "0",
    host_bw: Annotated[str, typer.Option(help="Host link bandwidth each way in GB/s.")] = "25",
    plot: Annotated[Path | None, typer.Option(
        help="Also draw the curves to this PNG file (needs matplotlib).", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
) -> None:
    """Predicted throughput, normalised to ideal (infinite memory), at each SSD bandwidth.

    One row per bandwidth, one column per policy: the planner and the
    baselines (activation offload, ZeRO-Offload/Infinity); 0 means the policy
    does not fit the memory. Exit codes: 0 done, 2 bad input.
    """
    from teraio.units import parse_bandwidth

    prof = load_profile(profile)
    try:
        bandwidths = [parse_bandwidth(x) / 1e9 for x in bw.split(",") if x.strip()]
    except ValueError as exc:
        fail(f"--bw: {exc}")
    if not bandwidths:
        fail("--bw: give at least one bandwidth, e.g. --bw 4,8,16")

    def hw_of_bw(b: float) -> Any:
        return hardware_from_options(prof, gpu_mem, str(b), None, None, host_mem, host_bw)

    rank = prof.ranks[0]
    info(f"simulating {len(bandwidths)} bandwidths, rank {rank}")
    rows = roofline_table(prof, hw_of_bw, bandwidths, rank)
    if json_out:
        print(json.dumps(rows, indent=2))
    else:
        names = [k for k in rows[0] if k != "bw_gb_per_s"]
        print("GB/s  " + "".join(f"{n:>20}" for n in names))
        for r in rows:
            print(f"{r['bw_gb_per_s']:>5g} " + "".join(
                f"{r[n]:>20.3f}" if r[n] > 0 else f"{'does not fit':>20}" for n in names))
    if plot is not None:
        _plot(rows, plot)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib (pip install matplotlib)")
    names = [k for k in rows[0] if k != "bw_gb_per_s"]
    xs = [r["bw_gb_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ax.plot(xs, [r[n] for r in rows], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("SSD bandwidth each way (GB/s)")
    ax.set_ylabel("throughput / ideal (0: does not fit)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror}")
    info(f"plot written to {path}")
