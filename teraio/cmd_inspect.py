"""`teraio inspect`: what a profile says, in terms a user can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from teraio.console import fail, info

__all__ = ["bandwidth_for", "characterize", "inspect", "roofline_rows", "summarize", "summarize_ranks"]

# Size classes of the inactive-period distribution (the Teraio paper's Figure 2 uses 10 MB-1 GB).
_SIZE_BINS = [0, 1 << 20, 10 << 20, 100 << 20, 1 << 30, 1 << 62]
_SIZE_LABELS = ["<1MiB", "1-10MiB", "10-100MiB", "100MiB-1GiB", ">=1GiB"]
_TIME_BINS_US = [0, 100, 1_000, 10_000, 100_000, float("inf")]
_TIME_LABELS = ["<0.1ms", "0.1-1ms", "1-10ms", "10-100ms", ">=100ms"]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def summarize(profile: Any, rank: int = 0) -> dict[str, Any]:
    """The numbers `teraio inspect` shows, as plain data."""
    from profiles import active_bytes, inactive_periods, iteration_time_us, memory_curve

    kernels = profile.kernels_of(rank)
    tensors = profile.tensors_of(rank)
    from planner.problem import op_scratch_bytes, written_unseen

    mem = memory_curve(profile, rank)
    act = active_bytes(profile, rank)
    scratch = op_scratch_bytes(profile, rank, kernels)  # NOTE [ Scratch ] in torch_patch.tracer
    peak_op = int(mem.argmax()) if len(mem) else 0
    from profiles import live_intervals

    row, begin, end = live_intervals(tensors, len(kernels))
    alive = row[(begin <= peak_op) & (peak_op < end)]
    at_peak = tensors.iloc[np.unique(alive)].groupby("kind")["size_bytes"].sum()
    frac = act / np.maximum(mem, 1)
    periods = inactive_periods(profile, rank)
    table = {}
    if len(periods):
        size_class = np.digitize(periods["size_bytes"], _SIZE_BINS[1:-1])
        time_class = np.digitize(periods["duration_us"], _TIME_BINS_US[1:-1])
        for s, label in enumerate(_SIZE_LABELS):
            sel = size_class == s
            if sel.any():
                counts = np.bincount(time_class[sel], minlength=len(_TIME_LABELS))
                table[label] = dict(zip(_TIME_LABELS, counts.tolist(), strict=True))
    longest = periods.groupby("tensor_id")["duration_us"].max() if len(periods) else None
    largest = tensors.nlargest(10, "size_bytes")
    top = [
        {
            "tensor_id": int(r.tensor_id), "name": r.name if isinstance(r.name, str) else None, "kind": r.kind,
            "size_bytes": int(r.size_bytes),
            "longest_inactive_us": float(longest.get(r.tensor_id, 0.0))
            if longest is not None else 0.0,
        }
        for r in largest.itertuples()
    ]
    mid = periods[(periods["size_bytes"] >= 10 * 10**6) & (periods["size_bytes"] < 10**9)]
    capacity = profile.meta.get("device_memory_bytes")
    first = None  # iteration 0 (NOTE [ The first iteration ] in profiles.model)
    if profile.first is not None and rank in profile.first.ranks:
        first_mem = memory_curve(profile.first, rank)
        first = {"num_ops": len(first_mem), "peak_bytes": int(first_mem.max()) if len(first_mem) else 0,
                 "iteration_time_us": iteration_time_us(profile.first, rank)}
    fixed = tensors[~tensors["resizable"]] if "resizable" in tensors else tensors.iloc[:0]
    return {
        "first_iteration": first,
        "written_unseen": written_unseen(profile, rank),  # NOTE [ Writes teraio cannot see ]
        # storages no plan moves (docs/formats.md, ``resizable``): how many, their bytes, the largest
        "fixed": {"count": len(fixed), "bytes": int(fixed["size_bytes"].sum()),
                  "largest": [{"tensor_id": int(r.tensor_id), "name": r.name if isinstance(r.name, str) else None,
                               "kind": r.kind, "size_bytes": int(r.size_bytes)}
                              for r in fixed.nlargest(3, "size_bytes").itertuples()]},
        "profile": str(profile.path),
        "mode": profile.meta.get("mode"),
        "device": profile.meta.get("device_name"),
        "num_ops": len(kernels),
        "iteration_time_us": iteration_time_us(profile, rank),
        "op_time_us": float(kernels["duration_us"].sum()),
        "ops_by_phase": kernels["phase"].value_counts().to_dict(),
        "peak_bytes": int(mem.max()) if len(mem) else 0,
        "peak_op": peak_op,
        "peak_op_name": str(kernels["op_name"].iloc[peak_op]) if len(kernels) else None,
        "peak_by_kind": {str(k): int(v) for k, v in at_peak.items()},
        # with what each op allocates inside itself: the peak `teraio plan --gpu-mem N%` takes a share of
        "peak_needed_bytes": int((mem + scratch).max()) if len(mem) else 0,
        "max_scratch_bytes": int(scratch.max()) if len(scratch) else 0,
        "max_scratch_op": int(scratch.argmax()) if len(scratch) else 0,
        "bytes_by_kind": {str(k): int(v) for k, v in tensors.groupby("kind")["size_bytes"].sum().items()},
        "active_fraction_mean": float(frac.mean()) if len(frac) else 0.0,
        "active_fraction_max": float(frac.max()) if len(frac) else 0.0,
        "active_bytes_max": int(act.max()) if len(act) else 0,
        "num_inactive_periods": len(periods),
        "inactive_periods_by_size": table,
        "share_10MB_1GB_inactive_over_10ms": float((mid["duration_us"] > 10_000).mean())
        if len(mid) else None,
        "largest_tensors": top,
        **characterize(profile, rank, capacity),
    }


def summarize_ranks(profile: Any) -> dict[str, Any]:
    """What `teraio inspect` shows of a job profile's ranks side by side, as plain data.

    Per rank: ops, measured iteration time, time in ops, peak memory and how far it is above
    the smallest rank's peak. ``pipeline`` (ranks that send to and receive from each other):
    the memory imbalance across its stages, the largest peak over the smallest. ``job``: the
    job's iteration from all ranks' ops together, nothing offloaded (``planner.job``: the
    waits for peers come from the graph), against the slowest rank's measured iteration; or
    ``error`` when the ranks' communication does not fit together.
    """
    from planner.errors import JobGraphError
    from planner.job import RECV, SEND, predict_job, rank_ops_from_kernels
    from profiles import iteration_time_us, memory_curve

    rows, ops = [], {}
    for r in profile.ranks:
        kernels = profile.kernels_of(r)
        mem = memory_curve(profile, r)
        ops[r] = rank_ops_from_kernels(r, kernels)
        rows.append({
            "rank": r, "num_ops": len(kernels), "iteration_time_us": iteration_time_us(profile, r),
            "op_time_us": float(kernels["duration_us"].sum()), "peak_bytes": int(mem.max()) if len(mem) else 0,
            "num_sends": int((kernels["op_name"] == SEND).sum()), "num_recvs": int((kernels["op_name"] == RECV).sum()),
        })
    least = min(rows, key=lambda row: (row["peak_bytes"], row["rank"]))
    most = max(rows, key=lambda row: (row["peak_bytes"], -row["rank"]))
    for row in rows:
        row["peak_over_least_bytes"] = row["peak_bytes"] - least["peak_bytes"]
    pipeline = None
    if any(row["num_sends"] or row["num_recvs"] for row in rows):
        pipeline = {"peak_ratio": most["peak_bytes"] / least["peak_bytes"] if least["peak_bytes"] else None,
                    "most_rank": most["rank"], "least_rank": least["rank"]}
    job: dict[str, Any] = {"measured_iteration_us": max(row["iteration_time_us"] for row in rows)}
    try:
        prediction = predict_job(ops, include_stalls=False)
        job.update(iteration_us=prediction.iteration_us, critical_rank=prediction.critical_rank)
    except JobGraphError as exc:
        job["error"] = str(exc)
    return {"world_size": profile.meta.get("world_size"), "ranks": rows, "pipeline": pipeline, "job": job}


def _print_ranks(j: dict[str, Any]) -> None:
    print(f"ranks          {len(j['ranks'])} of a job of {j['world_size']}")
    print(f"  {'rank':>4} {'ops':>8} {'iteration':>12} {'in ops':>12} {'peak':>14} {'over least':>14}")
    for row in j["ranks"]:
        print(f"  {row['rank']:>4} {row['num_ops']:>8,} {row['iteration_time_us'] / 1e3:>9,.2f} ms "
              f"{row['op_time_us'] / 1e3:>9,.2f} ms {_mib(row['peak_bytes']):>14} "
              f"{_mib(row['peak_over_least_bytes']):>14}")
    p = j["pipeline"]
    if p is not None:
        ratio = "unbounded" if p["peak_ratio"] is None else f"{p['peak_ratio']:.2f}x"
        print(f"pipeline       stages' peak memory imbalance {ratio} (largest rank {p['most_rank']} over "
              f"smallest rank {p['least_rank']})")
    job = j["job"]
    if "error" in job:
        print(f"job            not predicted: {job['error']}")
    else:
        print(f"job            {job['iteration_us'] / 1e3:,.2f} ms per iteration from all ranks' ops together "
              f"(nothing offloaded; critical rank {job['critical_rank']}); slowest rank measured "
              f"{job['measured_iteration_us'] / 1e3:,.2f} ms")


def characterize(profile: Any, rank: int = 0, capacity_bytes: int | None = None) -> dict[str, Any]:
    """The Teraio paper's Figure 1 and 2 numbers, as plain data.

    Figure 1: active bytes per op (what the op reads or writes) against the
    device's capacity (the paper's denominator) and against the bytes alive at
    that op. Figure 2: for tensors of 10 MB to 1 GB (decimal, as the paper), the
    share whose longest inactive period exceeds 10 ms (the paper's reading: over
    40%), and the same over all their inactive periods.
    """
    from profiles import active_bytes, inactive_periods, memory_curve

    act = active_bytes(profile, rank)
    mem = memory_curve(profile, rank)
    out: dict[str, Any] = {"device_memory_bytes": capacity_bytes}
    if capacity_bytes and len(act):
        out["active_of_capacity_mean"] = float(act.mean() / capacity_bytes)
        out["active_of_capacity_max"] = float(act.max() / capacity_bytes)
        out["live_of_capacity_max"] = float(mem.max() / capacity_bytes)
    else:
        out["active_of_capacity_mean"] = out["active_of_capacity_max"] = None
        out["live_of_capacity_max"] = None
    periods = inactive_periods(profile, rank)
    tensors = profile.tensors_of(rank)
    in_band = tensors[(tensors["size_bytes"] >= 10 * 10**6) & (tensors["size_bytes"] < 10**9)]
    longest = periods.groupby("tensor_id")["duration_us"].max() if len(periods) else None
    if len(in_band):
        idle = longest.reindex(in_band["tensor_id"]).fillna(0.0) if longest is not None else None
        out["num_tensors_10MB_1GB"] = len(in_band)
        out["share_10MB_1GB_tensors_idle_over_10ms"] = (
            float((idle > 10_000).mean()) if idle is not None else 0.0)
    else:
        out["num_tensors_10MB_1GB"] = 0
        out["share_10MB_1GB_tensors_idle_over_10ms"] = None
    return out


def roofline_rows(profile: Any, rank: int, capacity_bytes: int, bandwidths_gb_per_s: list[float],
                  host_mem_bytes: int = 0) -> list[dict[str, Any]]:
    """The paper's Figure 3: per SSD bandwidth (GB/s each way), each policy's throughput over
    ideal (infinite memory); 0.0 where the policy does not fit, None where no plan exists."""
    from planner import Hardware, InfeasibleBudgetError, plan_rank, problem_from_profile
    from planner.baselines import run_baselines

    problem = problem_from_profile(profile, rank)
    rows = []
    for bw in bandwidths_gb_per_s:
        hw = Hardware(gpu_mem_bytes=capacity_bytes, ssd_read_bw_bytes_per_s=bw * 1e9,
                      ssd_write_bw_bytes_per_s=bw * 1e9, host_mem_bytes=host_mem_bytes)
        row: dict[str, Any] = {"bw_gb_per_s": bw}
        try:
            policies = {"planner": plan_rank(problem, hw)}
        except InfeasibleBudgetError:
            policies = {}
            row["planner"] = None
        policies.update(run_baselines(profile, problem, hw, rank))
        for name, rp in policies.items():
            row[name] = round(1 / rp.sim.slowdown, 4) if rp.sim.fits else 0.0
        rows.append(row)
    return rows


def bandwidth_for(rows: list[dict[str, Any]], fraction: float, policy: str = "planner") -> float | None:
    """The smallest bandwidth in ``rows`` at which ``policy`` reaches ``fraction`` of ideal."""
    ok = [r["bw_gb_per_s"] for r in rows if (r.get(policy) or 0.0) >= fraction]
    return min(ok) if ok else None


def _print(s: dict[str, Any]) -> None:
    print(f"profile        {s['profile']} ({s['mode']}, {s['device']})")
    print(f"ops/iteration  {s['num_ops']:,}  ({', '.join(f'{k} {v}' for k, v in s['ops_by_phase'].items())})")
    print(f"iteration time {s['iteration_time_us'] / 1e3:,.2f} ms "
          f"(ops {s['op_time_us'] / 1e3:,.2f} ms)")
    print(f"peak memory    {_mib(s['peak_bytes'])} at op {s['peak_op']} ({s['peak_op_name']})")
    for kind, b in sorted(s["peak_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<16}{_mib(b):>16}")
    if s["max_scratch_bytes"]:
        print(f"scratch        up to {_mib(s['max_scratch_bytes'])} allocated inside one op (op "
              f"{s['max_scratch_op']}); with it, the peak with nothing moved is {_mib(s['peak_needed_bytes'])}")
    if s["written_unseen"]:
        names = s["written_unseen"]
        print(f"written unseen {len(names)} named tensors ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) "
              "changed with no op teraio saw writing them: plans move no named tensor")
    if s["fixed"]["count"]:
        largest = ", ".join(f"{t['name'] or t['tensor_id']} ({t['kind']}, {_mib(t['size_bytes'])})"
                            for t in s["fixed"]["largest"])
        print(f"cannot move    {s['fixed']['count']:,} storages, {_mib(s['fixed']['bytes'])} (largest: {largest}): "
              "memory teraio cannot free in place, or that others manage (docs/formats.md, resizable)")
    if s["first_iteration"] is not None:
        f = s["first_iteration"]
        print(f"iteration 0    {f['num_ops']:,} ops (set-up, optimizer state made), peak memory "
              f"{_mib(f['peak_bytes'])}, {f['iteration_time_us'] / 1e3:,.2f} ms")
    print(f"active bytes   mean {s['active_fraction_mean']:.1%} of live, "
          f"max {s['active_fraction_max']:.1%} (largest op needs {_mib(s['active_bytes_max'])})")
    print(f"inactive periods by tensor size ({s['num_inactive_periods']:,} in all):")
    print(f"  {'size':<14}" + "".join(f"{label:>11}" for label in _TIME_LABELS))
    for size, row in s["inactive_periods_by_size"].items():
        print(f"  {size:<14}" + "".join(f"{row[t]:>11,}" for t in _TIME_LABELS))
    cap = s["device_memory_bytes"]
    if cap:
        print(f"Figure 1       active bytes per op: mean {s['active_of_capacity_mean']:.2%}, max "
              f"{s['active_of_capacity_max']:.2%} of the device's {_mib(cap)}; everything alive: up to "
              f"{s['live_of_capacity_max']:.0%} of it")
    else:
        print("Figure 1       device capacity unknown (real CPU profile): see 'active bytes' above")
    share = s["share_10MB_1GB_tensors_idle_over_10ms"]
    print(f"Figure 2       {s['num_tensors_10MB_1GB']:,} tensors of 10 MB-1 GB; "
          + (f"{share:.0%} of them idle for over 10 ms at a stretch" if share is not None else "none"))
    rows = s.get("roofline")
    if rows:
        names = [k for k in rows[0] if k != "bw_gb_per_s"]
        print("Figure 3       throughput / ideal by SSD bandwidth (GB/s each way; 0: does not fit)")
        print("  GB/s  " + "".join(f"{n:>20}" for n in names))
        for r in rows:
            print(f"  {r['bw_gb_per_s']:>5g} " + "".join(
                f"{'no plan':>20}" if r[n] is None else f"{r[n]:>20.3f}" for n in names))
        for frac in (0.9, 0.95):
            bw = bandwidth_for(rows, frac)
            print(f"  planner within {1 - frac:.0%} of ideal from "
                  + (f"{bw:g} GB/s" if bw is not None else "none of these bandwidths"))
    print("largest tensors:")
    for t in s["largest_tensors"]:
        print(f"  {t['tensor_id']:>15}  {t['kind']:<16}{_mib(t['size_bytes']):>14}  "
              f"longest idle {t['longest_inactive_us'] / 1e3:,.2f} ms  {t['name'] or ''}")


def inspect(
    profile: Annotated[Path, typer.Argument(help="A profile directory written by `teraio profile`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    rank: Annotated[int, typer.Option(help="Which rank to summarise.")] = 0,
    plot: Annotated[Path | None, typer.Option(
        help="Also draw the paper's Figures 1-3 as PNGs into this directory (needs matplotlib); "
             "implies --roofline.", show_default=False)] = None,
    roofline: Annotated[bool, typer.Option(
        "--roofline", help="Also plan at each --bw and show throughput against SSD bandwidth "
                           "(Figure 3; runs the planner once per bandwidth).")] = False,
    bw: Annotated[str, typer.Option(
        help="Comma-separated SSD bandwidths for Figure 3, GB/s (1e9 bytes/s) each way.")]
    = "4,8,16,24,32,48,64,128",
    gpu_mem: Annotated[str | None, typer.Option(
        help="Device memory for Figures 1 and 3, e.g. 80G (K/M/G/T are powers of 1024). "
             "Default: the profiled device's.", show_default=False)] = None,
) -> None:
    """Summarise a profile: time, peak memory and its make-up, active bytes, idle periods, and
    the Teraio paper's characterization (Figure 1: active bytes against device capacity;
    Figure 2: inactive periods by tensor size; Figure 3 with --roofline or --plot: predicted
    throughput against SSD bandwidth). For a profile of several ranks, also each rank's ops,
    time and peak, a pipeline's memory imbalance across its stages, and the job's iteration from
    all ranks' ops together. Exit codes: 0 done, 2 bad input."""
    from profiles import ProfileFormatError, read_profile

    try:
        prof = read_profile(profile)
    except ProfileFormatError as exc:
        fail(str(exc))
    if rank not in prof.ranks:
        fail(f"rank {rank} is not in {profile} (ranks: {prof.ranks})")
    capacity = prof.meta.get("device_memory_bytes")
    if gpu_mem is not None:
        from teraio.units import parse_size

        try:
            capacity = parse_size(gpu_mem)
        except ValueError as exc:
            fail(f"--gpu-mem: {exc}")
        prof.meta["device_memory_bytes"] = capacity
    s = summarize(prof, rank)
    if len(prof.ranks) > 1:
        s["job"] = summarize_ranks(prof)
    if roofline or plot is not None:
        from teraio.units import parse_bandwidth

        try:
            bandwidths = [parse_bandwidth(x) / 1e9 for x in bw.split(",") if x.strip()]
        except ValueError as exc:
            fail(f"--bw: {exc}")
        if not bandwidths:
            fail("--bw: give at least one bandwidth, e.g. --bw 8,16,32")
        if not capacity:
            info("Figure 3 skipped: the profile does not record the device's memory; pass --gpu-mem")
        else:
            info(f"Figure 3: planning at {len(bandwidths)} bandwidths")
            s["roofline"] = roofline_rows(prof, rank, int(capacity), bandwidths)
            s["bw_for_90pct_gb_per_s"] = bandwidth_for(s["roofline"], 0.9)
            s["bw_for_95pct_gb_per_s"] = bandwidth_for(s["roofline"], 0.95)
    if json_out:
        print(json.dumps(s, indent=2))
    else:
        _print(s)
        if "job" in s:
            _print_ranks(s["job"])
    if plot is not None:
        _plot(prof, rank, s, plot)


def _plot(profile: Any, rank: int, s: dict[str, Any], out_dir: Path) -> None:
    """Write fig1_active_bytes.png, fig2_inactive_periods.png and fig3_roofline.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib (pip install matplotlib)")
    from profiles import active_bytes, inactive_periods, memory_curve

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create {out_dir}: {exc.strerror}")
    title = f"{profile.meta.get('builtin_model', {}).get('model') or profile.path} " \
            f"({s['mode']}, {s['device']})"
    gib = 2**30
    figures = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ops = np.arange(s["num_ops"])
    ax.plot(ops, memory_curve(profile, rank) / gib, label="all tensors (alive)", lw=1)
    ax.plot(ops, np.maximum(active_bytes(profile, rank), 1) / gib, label="active tensors", lw=0.6)
    if s["device_memory_bytes"]:
        ax.axhline(s["device_memory_bytes"] / gib, color="k", ls="--", lw=1, label="device capacity")
    ax.set_yscale("log")
    ax.set_ylim(bottom=2**-20)  # 1 KiB: scalar ops would stretch the axis
    ax.set_xlabel("op index in the iteration")
    ax.set_ylabel("memory (GiB, log)")
    ax.set_title("Figure 1: active bytes per op\n" + title, fontsize=9)
    ax.legend(fontsize=8)
    figures.append((fig, "fig1_active_bytes.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    periods = inactive_periods(profile, rank)
    if len(periods):
        ax.scatter(periods["size_bytes"] / 1e6, np.maximum(periods["duration_us"], 1e-1) / 1e3,
                   s=4, alpha=0.3, lw=0)
    ax.axhline(10, color="k", ls="--", lw=1, label="10 ms")
    ax.axvspan(10, 1000, color="tab:orange", alpha=0.1, label="10 MB-1 GB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (MB)")
    ax.set_ylabel("inactive period (ms)")
    ax.set_title("Figure 2: inactive periods by tensor size\n" + title, fontsize=9)
    ax.legend(fontsize=8)
    figures.append((fig, "fig2_inactive_periods.png"))

    rows = s.get("roofline")
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r["bw_gb_per_s"] for r in rows]
        for name in (k for k in rows[0] if k != "bw_gb_per_s"):
            ax.plot(xs, [r[name] or 0.0 for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("SSD bandwidth each way (GB/s)")
        ax.set_ylabel("throughput / ideal (0: does not fit)")
        ax.set_title("Figure 3: predicted throughput against migration bandwidth\n" + title,
                     fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        figures.append((fig, "fig3_roofline.png"))
    for fig, name in figures:
        fig.tight_layout()
        try:
            fig.savefig(out_dir / name, dpi=120)
        except OSError as exc:
            fail(f"cannot write {out_dir / name}: {exc.strerror}")
        plt.close(fig)
        info(f"wrote {out_dir / name}")
