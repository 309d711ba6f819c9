"""Planning time and memory against profile size: synthetic profiles of 10k to 300k ops.

Each size runs in a fresh subprocess (so its peak RSS, from
``getrusage(RUSAGE_SELF).ru_maxrss``, is its own). The worker builds a
transformer-shaped profile with ``profiles.synthetic.synthetic_profile`` (8
forward ops and 4 parameters per layer, one extra persistent buffer per layer;
that gives about 1.8 inactive periods per op), then plans it through the real
code path: ``planner.problem_from_profile`` and ``planner.plan_rank`` (greedy,
then the simulator with the urgency rounds) at a capacity of ``--capacity``
times the peak and ``--ssd-bw`` GB/s each way. ``plan_rank`` is timed as a
whole; the greedy's share is timed by wrapping the ``plan_greedy`` it calls,
and the rest is the simulation.

The last column is total planning time / (n ln n), n the ops, normalised to the
smallest size: it stays near 1 (or falls) when time grows no faster than
n log n.

    .venv/bin/python bench/plan_scale.py                          # 10k, 100k, 300k ops
    .venv/bin/python bench/plan_scale.py --sizes 10000 30000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPS_PER_LAYER = 8  # forward ops; a layer has 3 * 8 + 4 = 28 ops in all
PARAMS_PER_LAYER = 4


def plan_one(num_ops: int, capacity: float, ssd_bw_gb_per_s: float, seed: int) -> dict[str, Any]:
    """Build, plan and time one profile of about ``num_ops`` ops (run in a fresh process)."""
    import planner.make
    from planner import Hardware, plan_rank, problem_from_profile, summarize
    from profiles.synthetic import synthetic_profile

    layers = max(1, round(num_ops / (3 * OPS_PER_LAYER + PARAMS_PER_LAYER)))
    t0 = time.perf_counter()
    # 8 MiB activations and 4 MiB parameters per 500 us op: at 16 GB/s an activation's
    # offload takes about one op, so the plan is bandwidth-bound but can hide its transfers.
    profile = synthetic_profile(layers, OPS_PER_LAYER, PARAMS_PER_LAYER, activation_bytes=8 << 20,
                                param_bytes=4 << 20, op_us=500.0, num_extra=layers, seed=seed)
    t1 = time.perf_counter()
    problem = problem_from_profile(profile)
    t2 = time.perf_counter()
    peak = int(problem.memory_bytes.max())
    hw = Hardware(gpu_mem_bytes=int(capacity * peak), ssd_read_bw_bytes_per_s=ssd_bw_gb_per_s * 1e9,
                  ssd_write_bw_bytes_per_s=ssd_bw_gb_per_s * 1e9)

    greedy_s, greedy_calls = 0.0, 0
    real_greedy = planner.make.plan_greedy

    def timed_greedy(*args: Any, **kwargs: Any) -> Any:
        nonlocal greedy_s, greedy_calls
        greedy_calls += 1
        g0 = time.perf_counter()
        try:
            return real_greedy(*args, **kwargs)
        finally:
            greedy_s += time.perf_counter() - g0

    planner.make.plan_greedy = timed_greedy  # plan_rank looks it up at call time
    try:
        t3 = time.perf_counter()
        rank_plan = plan_rank(problem, hw)
        t4 = time.perf_counter()
    finally:
        planner.make.plan_greedy = real_greedy
    if greedy_calls != 1:
        raise RuntimeError(f"plan_rank called plan_greedy {greedy_calls} times, not once: update this timer")
    s = summarize(rank_plan, hw)
    return {
        "num_ops": problem.num_ops, "num_inactive_periods": problem.num_periods,
        "num_moves": len(rank_plan.moves), "capacity_of_peak": capacity, "ssd_bw_gb_per_s": ssd_bw_gb_per_s,
        "fits": s["fits"], "slowdown": s["slowdown"], "num_stalled_ops": s["num_stalled_ops"],
        "bytes_to_ssd": s["bytes_to_ssd"],
        "synthesis_s": t1 - t0, "problem_s": t2 - t1, "greedy_s": greedy_s,
        "simulate_s": (t4 - t3) - greedy_s, "plan_s": (t2 - t1) + (t4 - t3),
        # ru_maxrss is KiB on Linux (bytes on macOS)
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * (1 if sys.platform == "darwin" else 1024),
    }


def run_size(num_ops: int, args: argparse.Namespace) -> dict[str, Any]:
    """``plan_one`` in a fresh interpreter; a row with ``error`` set if it fails or times out."""
    cmd = [sys.executable, __file__, "--worker", str(num_ops), "--capacity", str(args.capacity),
           "--ssd-bw", str(args.ssd_bw), "--seed", str(args.seed)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"num_ops": num_ops, "error": f"timed out after {args.timeout:g} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"num_ops": num_ops, "error": f"exit {proc.returncode}: {last}"}
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    row["wall_s"] = time.perf_counter() - t0
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r]
    base = ok[0]["plan_s"] / (ok[0]["num_ops"] * math.log(ok[0]["num_ops"])) if ok else None
    lines = [
        "| ops | inactive periods | moves | problem | greedy | simulate | plan total | peak RSS "
        "| total / (n ln n), vs smallest | slowdown |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| ~{r['num_ops']:,} | | | | | | {r['error']} | | | |")
            continue
        norm = r["plan_s"] / (r["num_ops"] * math.log(r["num_ops"])) / base if base else float("nan")
        lines.append(
            f"| {r['num_ops']:,} | {r['num_inactive_periods']:,} | {r['num_moves']:,} "
            f"| {r['problem_s']:.2f} s | {r['greedy_s']:.1f} s | {r['simulate_s']:.1f} s "
            f"| {r['plan_s']:.1f} s | {r['peak_rss_bytes'] / 2**20:,.0f} MiB | {norm:.2f} "
            f"| {r['slowdown']:.3f}{'' if r['fits'] else ' (does not fit)'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 300_000],
                    help="ops per profile (rounded to whole layers of 28 ops)")
    ap.add_argument("--capacity", type=float, default=0.55, help="device capacity as a fraction of the peak")
    ap.add_argument("--ssd-bw", type=float, default=16.0, help="SSD bandwidth each way, GB/s (1e9 bytes/s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per size")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(plan_one(args.worker, args.capacity, args.ssd_bw, args.seed)))
        return
    if not 0 < args.capacity <= 1:
        ap.error("--capacity must be in (0, 1]")
    rows = []
    for n in args.sizes:
        print(f"plan_scale: ~{n:,} ops ...", file=sys.stderr, flush=True)
        row = run_size(n, args)
        summary = row.get("error") or (f"{row['num_ops']:,} ops, {row['num_inactive_periods']:,} periods, "
                                       f"{row['num_moves']:,} moves, plan {row['plan_s']:.1f} s, "
                                       f"RSS {row['peak_rss_bytes'] / 2**20:,.0f} MiB")
        print(f"plan_scale: ~{n:,} ops: {summary}", file=sys.stderr, flush=True)
        rows.append(row)
    print(f"capacity {args.capacity:.0%} of the peak, SSD {args.ssd_bw:g} GB/s each way, seed {args.seed}\n")
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
