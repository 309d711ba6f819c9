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

Printed: two Markdown tables per case and setting (each policy's predicted
iteration, its share of ideal throughput, its peak and whether it fits; where
the planner's time goes, per phase, NOTE [ Where the time goes ] in
``planner.phases``), then one line of headline figures as ``key=value`` pairs:

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
    .venv/bin/python bench/policies.py --cases 8b-b16-pp2 70b-b16-pp2 --profiles /tmp/prof

Pipeline cases (``Case.stages`` > 1; ``8b-b16-pp2``, ``70b-b16-pp2``) are the
paper's own setting: two H100s, one stage each, the 1F1B schedule. The job is
profiled with `teraio profile --fake --pipeline 2 --schedule 1f1b` (each rank in
a process of its own, through a fake process group), every stage is planned
alone against its own GPU's 80 GB, SSD and host memory (in ``mixed``, 512 GiB
per GPU: each GPU's share of the paper's 1 TB server), and the job's iteration
comes from both stages' simulations together (``planner.job``, the plan's
``job_iteration_us``). Baselines are not simulated there: the paper ran ZeRO
with tensor parallelism, not as pipeline stages. Extra headline keys:

- ``ideal_share.<case>.<setting>``: the job's ideal iteration (both stages, no
  stalls, the pipeline's bubble in it) over its predicted one;
- ``stage_ideal_share.<case>.<setting>.<rank>``: each stage on its own;
- ``slowest_stage_share.<case>.<setting>``: the slowest stage's ideal time
  over its predicted time, the job's figure without the messages between them;
- ``plan_s.<case>.<setting>``: seconds for both stages' plans.

Beside each pipeline case the Teraio paper's figure for the same model and
setting is printed (``PAPER``).
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
    stages: int = 1  # pipeline stages, one per GPU, trained with the 1F1B schedule
    micro_batch: int = 1
    seq: int = 4096


CASES = {
    "8b-b16": Case("llama3-8b", 16),
    "8b-b32": Case("llama3-8b", 32),
    "70b-b1": Case("llama3-70b", 1),
    "70b-b16": Case("llama3-70b", 16),
    "70b-b32": Case("llama3-70b", 32),
    "8b-b16-pp2": Case("llama3-8b", 16, stages=2),
    "70b-b16-pp2": Case("llama3-70b", 16, stages=2),
}
PIPELINE_CASES = tuple(k for k, c in CASES.items() if c.stages > 1)
# make bench: profiles and plans in under 30 minutes on 2 cores (BENCHMARKS.md).
DEFAULT_CASES = ("8b-b16", "70b-b1", "70b-b16")
SETTINGS = {"ssd": 0, "mixed": 512 * GIB}  # host memory the planner may use
BASELINE_HOST_MEM = 512 * GIB
# The Teraio paper's share of ideal throughput for its two-stage 1F1B runs on two H100s
# (shared/papers/teraio-lifetime-aware-offloading-gds.txt, section 4.2, figure 7), as its text
# gives them: model -> setting -> (share, or None where the text gives no number; what it says).
PAPER: dict[str, dict[str, tuple[float | None, str]]] = {
    "llama3-8b": {"ssd": (None, "near ideal (Teraio-SSD)"), "mixed": (None, "near ideal (Teraio-Mixed)")},
    "llama3-70b": {"ssd": (None, "below Teraio-Mixed; no figure in the text"),
                   "mixed": (0.597, "59.7% of ideal (Teraio-Mixed), 1.33x ZeRO-Infinity's 43.0%")},
}


def hardware(setting: str) -> Any:
    """One H100-80GB of the paper's server: 16 GB/s of SSD each way, the setting's host memory."""
    from planner import Hardware

    return Hardware(gpu_mem_bytes=80 * GIB, ssd_read_bw_bytes_per_s=16e9, ssd_write_bw_bytes_per_s=16e9,
                    host_bw_bytes_per_s=25e9, host_mem_bytes=SETTINGS[setting])


def profile_case(name: str, case: Case, root: Path) -> Path:
    """The case's fake profile under ``root`` (made with `teraio profile` if not there yet)."""
    out = root / name
    if (out / "meta.json").exists():
        return out
    cmd = [sys.executable, "-m", "teraio", "profile", "--fake", "--gpu", "h100", "--model", case.model,
           "--batch", str(case.batch), "--micro-batch", str(case.micro_batch), "--seq", str(case.seq),
           "--out", str(out), "--force"]
    if case.stages > 1:  # every rank, one after another, into one profile of the job
        cmd += ["--pipeline", str(case.stages), "--schedule", "1f1b"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out


def bench_case(name: str, case: Case, path: Path, settings: list[str], margins: list[float]) -> list[dict[str, Any]]:
    from dataclasses import replace

    from planner import plan_rank, problem_from_profile
    from planner.baselines import run_baselines
    from planner.bound import iteration_bound
    from planner.phases import phase_report
    from profiles import read_profile

    profile = read_profile(path)
    if case.stages > 1:
        return bench_pipeline(name, case, profile, settings)
    problem = problem_from_profile(profile)
    rows = []
    for setting in settings:
        host = SETTINGS[setting]
        hw = hardware(setting)
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
            "phases_bound_s": bound.phases_us / 1e6, "merged_bound_s": bound.merged_us / 1e6,
            "plan_s": plan_s, "baselines_s": base_s,
            "policies": table, "best_baseline": best,
            "planner_over_best": (fitting[best]["iteration_s"] * 1e6 / pred) if best else None,
            "ideal_share": ideal / pred, "bound_ratio": pred / bound.iteration_us,
            "peak_bound_ratio": pred / bound.peak_us, "planner_fits": bool(planned.sim.fits),
            "stall_s": planned.sim.stall_us / 1e6,
            "moved_gib": sum(m.size_bytes for m in planned.moves) / GIB,
            "phases": phase_report(problem, planned.sim, bound),  # NOTE [ Where the time goes ]
        })
        print(f"{name} {setting}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'policies'})}",
              file=sys.stderr, flush=True)
    return rows


def bench_pipeline(name: str, case: Case, profile: Any, settings: list[str]) -> list[dict[str, Any]]:
    """Plan every stage of a pipeline job's profile alone, then the job from all of them."""
    from planner import plan_rank, problem_from_profile
    from planner.bound import iteration_bound
    from planner.make import job_summary

    problems = {r: problem_from_profile(profile, rank=r) for r in profile.ranks}
    rows = []
    for setting in settings:
        hw = hardware(setting)
        plans, stages = {}, []
        t0 = time.perf_counter()
        for r, problem in problems.items():
            tag = f"{name} {setting} rank {r}"
            t1 = time.perf_counter()
            plans[r] = rp = plan_rank(problem, hw, progress=lambda line, tag=tag: print(
                f"  {tag}: {line}", file=sys.stderr, flush=True))
            ideal, pred = problem.ideal_iteration_us, rp.sim.iteration_us
            stages.append({"rank": r, "num_ops": problem.num_ops, "peak_gib": float(problem.memory_bytes.max()) / GIB,
                           "ideal_s": ideal / 1e6, "predicted_s": pred / 1e6, "ideal_share": ideal / pred,
                           "bound_ratio": pred / iteration_bound(problem, hw).iteration_us,
                           "fits": bool(rp.sim.fits), "stall_s": rp.sim.stall_us / 1e6,
                           "moved_gib": sum(m.size_bytes for m in rp.moves) / GIB,
                           "plan_s": time.perf_counter() - t1})
        plan_s = time.perf_counter() - t0
        job = job_summary(plans)
        slowest = max(stages, key=lambda st: st["predicted_s"])
        paper, paper_says = PAPER.get(case.model, {}).get(setting, (None, "not in the paper"))
        rows.append({
            "case": name, "model": case.model, "batch": case.batch, "setting": setting, "stages": stages,
            "job_ideal_s": job["job_ideal_iteration_us"] / 1e6, "job_s": job["job_iteration_us"] / 1e6,
            "ideal_share": job["job_ideal_iteration_us"] / job["job_iteration_us"],
            "slowest_stage_share": max(st["ideal_s"] for st in stages) / slowest["predicted_s"],
            "critical_rank": job["critical_rank"], "plan_s": plan_s,
            "paper_ideal_share": paper, "paper_says": paper_says,
        })
        print(f"{name} {setting}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def _print_pipeline(r: dict[str, Any]) -> None:
    print(f"\n{r['case']} ({r['model']}, {len(r['stages'])} stages, 1F1B, batch {r['batch']} in micro-batches of 1, "
          f"seq 4096), {r['setting']}: job predicted {r['job_s']:.2f} s, ideal {r['job_ideal_s']:.2f} s; "
          f"critical rank {r['critical_rank']}; planned in {r['plan_s']:.0f} s\n")
    print("| stage (rank) | ops | peak unplanned | ideal | predicted | of ideal | over bound | moved | fits |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for st in r["stages"]:
        print(f"| {st['rank']} | {st['num_ops']:,} | {st['peak_gib']:,.0f} GiB | {st['ideal_s']:.2f} s "
              f"| {st['predicted_s']:.2f} s | {st['ideal_share']:.3f} | {st['bound_ratio']:.3f} "
              f"| {st['moved_gib']:,.0f} GiB | {'yes' if st['fits'] else 'no'} |")
    paper = "" if r["paper_ideal_share"] is None else f"{r['paper_ideal_share']:.3f}: "
    print(f"| job (planner.job) | | | {r['job_ideal_s']:.2f} s | {r['job_s']:.2f} s | {r['ideal_share']:.3f} "
          f"| | | |\n\nslowest stage alone: {r['slowest_stage_share']:.3f} of ideal; "
          f"the Teraio paper: {paper}{r['paper_says']}")


def _print(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "stages" in r:
            _print_pipeline(r)
            continue
        print(f"\n{r['case']} ({r['model']}, batch {r['batch']} in micro-batches of 1, seq 4096), {r['setting']}: "
              f"{r['num_ops']:,} ops, peak {r['peak_gib']:,.0f} GiB; ideal {r['ideal_s']:.2f} s, bound "
              f"{r['bound_s']:.2f} s (peak bytes {r['peak_bound_s']:.2f} s, phases {r['phases_bound_s']:.2f} s, "
              f"adjacent phases together {r['merged_bound_s']:.2f} s); "
              f"planned in {r['plan_s']:.0f} s\n")
        print("| policy | predicted iteration | of ideal | peak | fits |")
        print("|---|---:|---:|---:|---|")
        for name, v in r["policies"].items():
            print(f"| {name}{' (best baseline)' if name == r['best_baseline'] else ''} | {v['iteration_s']:,.2f} s "
                  f"| {v['ideal_share']:.3f} | {v['peak_gib']:,.1f} GiB | {'yes' if v['fits'] else 'no'} |")
        print("\nWhere the planner's time goes (planner/phases.py; busy: share of the phase's predicted time)\n")
        print("| phase | windows | predicted | bound | ops | SSD write | SSD read | host write | host read |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for ph in r["phases"]:
            b = ph["busy"]
            print(f"| {ph['phase']} | {ph['windows']} | {ph['predicted_us'] / 1e6:,.2f} s "
                  f"| {ph['bound_us'] / 1e6:,.2f} s | {ph['compute_us'] / 1e6:,.2f} s "
                  f"| {b['ssd_write']:.0%} | {b['ssd_read']:.0%} "
                  f"| {b['host_write']:.0%} | {b['host_read']:.0%} |")


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
        if "stages" in r:
            keys += [f"ideal_share.{tag}={r['ideal_share']:.3f}",
                     *(f"stage_ideal_share.{tag}.{st['rank']}={st['ideal_share']:.3f}" for st in r["stages"]),
                     f"slowest_stage_share.{tag}={r['slowest_stage_share']:.3f}", f"plan_s.{tag}={r['plan_s']:.1f}"]
            continue
        keys += [f"planner_over_best.{tag}={_num(r['planner_over_best'])}", f"ideal_share.{tag}={r['ideal_share']:.3f}",
                 f"bound_ratio.{tag}={r['bound_ratio']:.3f}", f"peak_bound_ratio.{tag}={r['peak_bound_ratio']:.3f}",
                 f"plan_s.{tag}={r['plan_s']:.1f}"]
    print("\n" + " ".join(keys))


if __name__ == "__main__":
    main()
