"""Fake-mode profiling at LLM scale: time, memory, accounting and the paper's characterization.

For each case it runs `teraio profile --fake --gpu h100 --model ...` and
`teraio plan` as subprocesses (wall time and peak RSS of each, from wait4),
checks that parameters, gradients and optimizer state alive at the optimizer
step add up to 16 bytes a parameter (fp32 AdamW), and computes the Teraio
paper's Figure 1-3 numbers (active bytes against capacity, the share of
10 MB-1 GB tensors idle for over 10 ms, the SSD bandwidth at which the plan
comes within 5% of ideal). Prints a Markdown table; --json also writes them.

    .venv/bin/python bench/fake_scale.py                      # all cases
    .venv/bin/python bench/fake_scale.py --cases 8b-b1 70b-b1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (model, global batch, micro-batch, sequence)
CASES: dict[str, tuple[str, int, int, int]] = {
    "8b-b1": ("llama3-8b", 1, 1, 4096),
    "70b-b1": ("llama3-70b", 1, 1, 4096),
    "8b-b16": ("llama3-8b", 16, 1, 4096),  # the paper's smallest evaluated batch
    "70b-b16": ("llama3-70b", 16, 1, 4096),
}


def run(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, int, str]:
    """Run ``cmd``; (wall seconds, peak RSS bytes, stderr). Raises on an exit code not in ``ok``."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        err.seek(0)
        text = err.read()
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text}")
    return wall, usage.ru_maxrss * 1024, text


def state_bytes(profile: Any) -> int:
    """Bytes of params, grads and optimizer state alive at the first optimizer op."""
    from profiles import live_intervals

    k = profile.kernels_of()
    first = int(np.flatnonzero(k["phase"].to_numpy() == "optimizer")[0])
    t = profile.tensors_of()
    row, begin, end = live_intervals(t, len(k))
    alive = t.iloc[np.unique(row[(begin <= first) & (first < end)])]
    return int(alive[alive["kind"].isin(["param", "grad", "optimizer_state"])]["size_bytes"].sum())


def bench_case(name: str, out_root: Path, bandwidths: list[float], plan_bw: float) -> dict[str, Any]:
    from profiles import read_profile
    from teraio.cmd_inspect import bandwidth_for, roofline_rows, summarize
    from torch_patch.models import CONFIGS, num_parameters

    model, batch, micro, seq = CASES[name]
    out = out_root / name
    py = [sys.executable, "-m", "teraio"]
    prof_s, prof_rss, _ = run([*py, "profile", "--fake", "--gpu", "h100", "--model", model,
                               "--batch", str(batch), "--micro-batch", str(micro), "--seq", str(seq),
                               "--out", str(out), "--force"])
    plan_s, plan_rss, plan_err = run([*py, "plan", str(out), "--ssd-bw", str(plan_bw),
                                      "--out", str(out_root / f"{name}.plan.json")], ok=(0, 2))
    plan_error = next((line for line in plan_err.splitlines() if "error:" in line), None)
    p = read_profile(out)
    n = num_parameters(CONFIGS[model])
    t0 = time.perf_counter()
    s = summarize(p)
    rows = roofline_rows(p, 0, int(p.meta["device_memory_bytes"]), bandwidths)
    roof_s = time.perf_counter() - t0
    return {
        "case": name, "model": model, "batch": batch, "micro_batch": micro, "seq": seq,
        "num_ops": s["num_ops"], "predicted_iteration_s": s["iteration_time_us"] / 1e6,
        "profile_s": prof_s, "profile_rss_gib": prof_rss / 2**30,
        "plan_s": plan_s, "plan_rss_gib": plan_rss / 2**30, "plan_error": plan_error,
        "state_over_16_bytes_per_param": state_bytes(p) / (16 * n),
        "peak_gib": s["peak_bytes"] / 2**30,
        "active_of_capacity_mean": s["active_of_capacity_mean"],
        "active_of_capacity_max": s["active_of_capacity_max"],
        "share_10MB_1GB_tensors_idle_over_10ms": s["share_10MB_1GB_tensors_idle_over_10ms"],
        "share_10MB_1GB_periods_over_10ms": s["share_10MB_1GB_inactive_over_10ms"],
        "roofline": rows, "roofline_s": roof_s,
        "bw_for_90pct_gb_per_s": bandwidth_for(rows, 0.90),
        "bw_for_95pct_gb_per_s": bandwidth_for(rows, 0.95),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bw(x: float | None) -> str:
    return "> max tried" if x is None else f"{x:g} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--bw", default="8,16,24,32,48,64,96,128",
                    help="SSD bandwidths (GB/s each way) for the roofline")
    ap.add_argument("--plan-bw", type=float, default=32.0, help="GB/s for the timed `teraio plan`")
    ap.add_argument("--out", type=Path, help="keep the profiles here (default: a temporary dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    bandwidths = [float(x) for x in args.bw.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        results = []
        for name in args.cases:
            r = bench_case(name, root, bandwidths, args.plan_bw)
            print(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'roofline'})}",
                  file=sys.stderr, flush=True)
            results.append(r)
    print("| case | ops/iter | predicted iter | profile time / RSS | plan time / RSS | "
          "state / 16 B·param | active of 80 GB: mean / max | 10MB-1GB tensors idle >10 ms | "
          "bw for 90% / 95% of ideal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} (batch {r['batch']}, micro {r['micro_batch']}, seq {r['seq']}) "
              f"| {r['num_ops']:,} | {r['predicted_iteration_s']:.2f} s "
              f"| {r['profile_s']:.1f} s / {r['profile_rss_gib']:.2f} GiB "
              f"| {r['plan_s']:.1f} s / {r['plan_rss_gib']:.2f} GiB"
              f"{' (no plan: see below)' if r['plan_error'] else ''} "
              f"| {r['state_over_16_bytes_per_param']:.4f} "
              f"| {_pct(r['active_of_capacity_mean'])} / {_pct(r['active_of_capacity_max'])} "
              f"| {_pct(r['share_10MB_1GB_tensors_idle_over_10ms'])} "
              f"| {_bw(r['bw_for_90pct_gb_per_s'])} / {_bw(r['bw_for_95pct_gb_per_s'])} |")
    print()
    for r in results:
        print(f"{r['case']} roofline (planner throughput / ideal): " + ", ".join(
            f"{row['bw_gb_per_s']:g}: {row['planner'] if row['planner'] is not None else 'no plan'}"
            for row in r["roofline"]))
    for r in results:
        if r["plan_error"]:
            print(f"{r['case']} `teraio plan --ssd-bw {args.plan_bw:g}`: {r['plan_error']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
