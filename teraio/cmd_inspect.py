"""`teraio inspect`: what a profile says, in terms a user can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from teraio.console import fail

__all__ = ["inspect", "summarize"]

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
    mem = memory_curve(profile, rank)
    act = active_bytes(profile, rank)
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
    return {
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
        "bytes_by_kind": {str(k): int(v) for k, v in tensors.groupby("kind")["size_bytes"].sum().items()},
        "active_fraction_mean": float(frac.mean()) if len(frac) else 0.0,
        "active_fraction_max": float(frac.max()) if len(frac) else 0.0,
        "active_bytes_max": int(act.max()) if len(act) else 0,
        "num_inactive_periods": len(periods),
        "inactive_periods_by_size": table,
        "share_10MB_1GB_inactive_over_10ms": float((mid["duration_us"] > 10_000).mean())
        if len(mid) else None,
        "largest_tensors": top,
    }


def _print(s: dict[str, Any]) -> None:
    print(f"profile        {s['profile']} ({s['mode']}, {s['device']})")
    print(f"ops/iteration  {s['num_ops']:,}  ({', '.join(f'{k} {v}' for k, v in s['ops_by_phase'].items())})")
    print(f"iteration time {s['iteration_time_us'] / 1e3:,.2f} ms "
          f"(ops {s['op_time_us'] / 1e3:,.2f} ms)")
    print(f"peak memory    {_mib(s['peak_bytes'])} at op {s['peak_op']} ({s['peak_op_name']})")
    for kind, b in sorted(s["peak_by_kind"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<16}{_mib(b):>16}")
    print(f"active bytes   mean {s['active_fraction_mean']:.1%} of live, "
          f"max {s['active_fraction_max']:.1%} (largest op needs {_mib(s['active_bytes_max'])})")
    print(f"inactive periods by tensor size ({s['num_inactive_periods']:,} in all):")
    print(f"  {'size':<14}" + "".join(f"{label:>11}" for label in _TIME_LABELS))
    for size, row in s["inactive_periods_by_size"].items():
        print(f"  {size:<14}" + "".join(f"{row[t]:>11,}" for t in _TIME_LABELS))
    print("largest tensors:")
    for t in s["largest_tensors"]:
        print(f"  {t['tensor_id']:>15}  {t['kind']:<16}{_mib(t['size_bytes']):>14}  "
              f"longest idle {t['longest_inactive_us'] / 1e3:,.2f} ms  {t['name'] or ''}")


def inspect(
    profile: Annotated[Path, typer.Argument(help="A profile directory written by `teraio profile`.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    rank: Annotated[int, typer.Option(help="Which rank to summarise.")] = 0,
) -> None:
    """Summarise a profile: time, peak memory and its make-up, active bytes, idle periods."""
    from profiles import ProfileFormatError, read_profile

    try:
        prof = read_profile(profile)
    except ProfileFormatError as exc:
        fail(str(exc))
    if rank not in prof.ranks:
        fail(f"rank {rank} is not in {profile} (ranks: {prof.ranks})")
    s = summarize(prof, rank)
    if json_out:
        print(json.dumps(s, indent=2))
    else:
        _print(s)
