"""The planner against the baselines and the transfer bound, at the Teraio paper's scale.

For each case (a model and a global batch in micro-batches of 1 sequence of
4,096 tokens, fp32 AdamW as in the paper) it runs `teraio profile --fake --gpu
h100` (a subprocess; skipped when ``--profiles DIR`` already holds the case's
profile), then in each setting, on one H100-80GB:

- ``ssd``: the SSD only, 16 GB/s each way (the paper's Teraio-SSD);
- ``mixed``: the SSD and 512 GiB of host memory at 25 GB/s each way
  (Teraio-Mixed),

plans the profile (``planner.plan_rank``, timed), simulates every baseline as
its users would run it (``planner.baselines.run_baselines``: activation
offload, ZeRO-Offload, ZeRO-Infinity, with activation checkpointing or ZeRO
where they do not fit otherwise), and computes the bounds of NOTE [ Transfer
bound ] (``planner.bound``). The ZeRO baselines get the 512 GiB of host memory
in both settings: their optimizer runs on the CPU, and in the paper they ran
with 1 TB while Teraio-SSD used none.

Printed: a Markdown table per case and setting (each policy's predicted
iteration, its share of ideal throughput, its peak and whether it fits), then
one line of headline figures as ``key=value`` pairs:

- ``ideal_share.<case>.<setting>``: ideal time over the planner's predicted time;
- ``planner_over_best.<case>.<setting>``: the best baseline that fits, its
  predicted time over the planner's (above 1: the planner is faster);
- ``bound_ratio.<case>.<setting>``: the planner's predicted time over the
  tightest bound; ``peak_bound_ratio`` the same over the bound of the bytes out
  at the peak alone;
- ``plan_s.<case>.<setting>``: seconds ``plan_rank`` took.

    .venv/bin/python bench/policies.py                              # the default cases
    .venv/bin/python bench/policies.py --cases 8b-b32 70b-b32 --profiles /tmp/prof
    .venv/bin/python bench/policies.py --cases 70b-b1 --settings mixed --margins 0 0.2 1

The two-stage 1F1B pipeline rows of the paper (one stage per GPU) wait for
distributed fake profiles: ``Case.stages`` is their hook (see ``profile_case``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    stages: int = 1  # pipeline stages (one per GPU); only 1 until distributed fake profiles exist
    micro_batch: int = 1
    seq: int = 4096


CASES = {
    "8b-b16": Case("llama3-8b", 16),
    "8b-b32": Case("llama3-8b", 32),
    "70b-b1": Case("llama3-70b", 1),
    "70b-b16": Case("llama3-70b", 16),
    "70b-b32": Case("llama3-70b", 32),
}
# make bench: profiles and plans in under 30 minutes on 2 cores (BENCHMARKS.md).
DEFAULT_CASES = ("8b-b16", "70b-b1", "70b-b16")
SETTINGS = {"ssd": 0, "mixed": 512 * GIB}  # host memory the planner may use
BASELINE_HOST_MEM = 512 * GIB


def profile_case(name: str, case: Case, root: Path) -> Path:
    """The case's fake profile under ``root`` (made with `teraio profile` if not there yet)."""
    if case.stages != 1:
        # The hook for the paper's two-stage 1F1B rows: profile each stage's rank under a fake
        # process group, plan each rank, and take the job's time from all ranks (DESIGN.md 9).
        raise NotImplementedError("pipeline stages wait for distributed fake profiles")
    out = root / name
    if (out / "meta.json").exists():
        return out
    cmd = [sys.executable, "-m", "teraio", "profile", "--fake", "--gpu", "h100", "--model", case.model,
           "--batch", str(case.batch), "--micro-batch", str(case.micro_batch), "--seq", str(case.seq),
           "--out", str(out), "--force"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def bench_case(name: str, case: Case, path: Path, settings: list[str], margins: list[float]) -> list[dict[str, Any]]:
    from dataclasses import replace

    from planner import Hardware, plan_rank, problem_from_profile
    from planner.baselines import run_baselines
    from planner.bound import iteration_bound
    from profiles import read_profile

    profile = read_profile(path)
    problem = problem_from_profile(profile)
    rows = []
    for setting in settings:
        host = SETTINGS[setting]
        hw = Hardware(gpu_mem_bytes=80 * GIB, ssd_read_bw_bytes_per_s=16e9, ssd_write_bw_bytes_per_s=16e9,
                      host_bw_bytes_per_s=25e9, host_mem_bytes=host)
        tag = f"{name} {setting}"
        t0 = time.perf_counter()
        planned = plan_rank(problem, hw, progress=lambda line, tag=tag: print(f"  {tag}: {line}", file=sys.stderr,
                                                                               flush=True))
        plan_s = time.perf_counter() - t0
        bound = iteration_bound(problem, hw)
        t1 = time.perf_counter()
        base = run_baselines(profile, problem, replace(hw, host_mem_bytes=max(host, BASELINE_HOST_MEM)))
        base_s = time.perf_counter() - t1
        policies = {"planner": planned, **base}
        for m in margins:  # the planner with one margin of the paced clock (planner.pace), for comparison
            policies[f"planner, margin {m:g}"] = plan_rank(problem, hw, margins=(m,))
        ideal = problem.ideal_iteration_us
        table = {k: {"iteration_s": rp.sim.iteration_us / 1e6, "ideal_share": ideal / rp.sim.iteration_us,
                     "peak_gib": rp.sim.peak_bytes / GIB, "fits": bool(rp.sim.fits)}
                 for k, rp in policies.items()}
        fitting = {k: v for k, v in table.items() if not k.startswith(("planner", "ideal")) and v["fits"]}
        best = min(fitting, key=lambda k: fitting[k]["iteration_s"]) if fitting else None
        pred = planned.sim.iteration_us
        rows.append({
            "case": name, "model": case.model, "batch": case.batch, "setting": setting,
            "num_ops": problem.num_ops, "peak_gib": float(problem.memory_bytes.max()) / GIB,
            "ideal_s": ideal / 1e6, "bound_s": bound.iteration_us / 1e6, "peak_bound_s": bound.peak_us / 1e6,
            "phases_bound_s": bound.phases_us / 1e6, "plan_s": plan_s, "baselines_s": base_s,
            "policies": table, "best_baseline": best,
            "planner_over_best": (fitting[best]["iteration_s"] * 1e6 / pred) if best else None,
            "ideal_share": ideal / pred, "bound_ratio": pred / bound.iteration_us,
            "peak_bound_ratio": pred / bound.peak_us, "planner_fits": bool(planned.sim.fits),
            "stall_s": planned.sim.stall_us / 1e6,
            "moved_gib": sum(m.size_bytes for m in planned.moves) / GIB,
        })
        print(f"{name} {setting}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'policies'})}",
              file=sys.stderr, flush=True)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"\n{r['case']} ({r['model']}, batch {r['batch']} in micro-batches of 1, seq 4096), {r['setting']}: "
              f"{r['num_ops']:,} ops, peak {r['peak_gib']:,.0f} GiB; ideal {r['ideal_s']:.2f} s, bound "
              f"{r['bound_s']:.2f} s (peak bytes {r['peak_bound_s']:.2f} s, phases {r['phases_bound_s']:.2f} s); "
              f"planned in {r['plan_s']:.0f} s\n")
        print("| policy | predicted iteration | of ideal | peak | fits |")
        print("|---|---:|---:|---:|---|")
        for name, v in r["policies"].items():
            print(f"| {name}{' (best baseline)' if name == r['best_baseline'] else ''} | {v['iteration_s']:,.2f} s "
                  f"| {v['ideal_share']:.3f} | {v['peak_gib']:,.1f} GiB | {'yes' if v['fits'] else 'no'} |")


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--margins", nargs="*", type=float, default=[],
                    help="also plan with each of these paced-clock margins alone (planner.pace)")
    ap.add_argument("--profiles", type=Path, help="keep (and reuse) the fake profiles here")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.profiles or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows: list[dict[str, Any]] = []
        for name in args.cases:
            t0 = time.perf_counter()
            path = profile_case(name, CASES[name], root)
            print(f"{name}: profile ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            rows += bench_case(name, CASES[name], path, args.settings, args.margins)
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    keys = []
    for r in rows:
        tag = f"{r['case']}.{r['setting']}"
        keys += [f"planner_over_best.{tag}={_num(r['planner_over_best'])}", f"ideal_share.{tag}={r['ideal_share']:.3f}",
                 f"bound_ratio.{tag}={r['bound_ratio']:.3f}", f"peak_bound_ratio.{tag}={r['peak_bound_ratio']:.3f}",
                 f"plan_s.{tag}={r['plan_s']:.1f}"]
    print("\n" + " ".join(keys))


if __name__ == "__main__":
    main()
