"""torchrun jobs under teraio on this machine: DDP, FSDP2 and three pipeline schedules.

    python bench/jobs.py [--jobs ddp fsdp2 1f1b interleaved-1f1b zbv] [--budget 0.5] [-- example args]

For each job, 2 processes on the CPU with gloo: `teraio profile --nproc 2`, the
peak of every rank from the profile (for the pipelines, the imbalance across
stages each schedule gives), `teraio plan` at ``--budget`` of the largest
rank's peak (or the least any plan meets, when that is more), then the plain
job and `teraio run --nproc 2` side by side: every rank's tracked peak against
the budget, the job's iteration time measured (the slowest rank's median)
against the plan's prediction (the job's, from all ranks' ops together, when
the plan has it; else the slowest rank's), and whether the losses are equal.
Ends with one line of key=value figures.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

from demo import ROOT, sh, teraio

EXAMPLES = ROOT / "examples"
JOBS = {
    "ddp": ("train_gpt_ddp.py", []),
    "fsdp2": ("train_gpt_fsdp.py", []),
    "1f1b": ("train_gpt_pp.py", ["--schedule", "1f1b"]),
    "interleaved-1f1b": ("train_gpt_pp.py", ["--schedule", "interleaved-1f1b"]),
    "zbv": ("train_gpt_pp.py", ["--schedule", "zbv"]),
}
DEFAULT_ARGS = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "8",
                "--vocab", "512", "--steps", "8"]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+)", stdout, re.M)


def one_job(name: str, ex_args: list[str], budget_share: float, work: Path) -> dict[str, float]:
    script, extra = JOBS[name]
    args = [*ex_args, *extra]
    prof, plan = work / f"{name}-profile", work / f"{name}-plan.json"
    sh(*teraio("profile", "--nproc", "2", EXAMPLES / script, "--out", prof, "--", *args))
    r = sh(*teraio("plan", prof, "--gpu-mem", f"{budget_share:.0%}", "--ssd-bw", "2", "--out", plan),
           check=False)
    if r.returncode != 0:
        sh(*teraio("plan", prof, "--gpu-mem", "min", "--ssd-bw", "2", "--out", plan))
    doc = json.loads(plan.read_text())
    budget = doc["parameters"]["gpu_mem_bytes"]
    by_rank = doc["summary_by_rank"]
    peaks = {int(k): s["peak_before_bytes"] for k, s in by_rank.items()}
    predicted_us = doc["summary"].get("job_iteration_us") or max(s["predicted_iteration_us"] for s in by_rank.values())
    plain = sh(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               EXAMPLES / script, *args, "--timing")
    run = sh(*teraio("run", "--nproc", "2", "--plan", plan, "--swap-dir", work, "--report", work / f"{name}-run.json",
                     EXAMPLES / script, "--", *args, "--timing"))
    report = json.loads((work / f"{name}-run.json").read_text())
    tracked = {int(r): max(p for i, (p, f) in enumerate(zip(rr["iteration_peak_bytes"], rr["iteration_followed"],
                                                            strict=True)) if i and f)
               for r, rr in report["ranks"].items()}
    times = [float(t) for t in re.findall(r"time_ms (\S+)", plain.stdout)][2:]
    plain_ms = statistics.median(times) if times else float("nan")
    teraio_ms = report["measured_iteration_s"] * 1e3
    print(f"\n{name}: peaks per rank {', '.join(mib(peaks[r]) for r in sorted(peaks))} (imbalance "
          f"{max(peaks.values()) / min(peaks.values()):.2f}x); budget {mib(budget)}; tracked under teraio "
          f"{', '.join(f'{tracked[r] / budget:.3f}' for r in sorted(tracked))} of it; iteration plain "
          f"{plain_ms:,.1f} ms, teraio {teraio_ms:,.1f} ms ({teraio_ms / plain_ms:.2f}x), predicted "
          f"{predicted_us / 1e3:,.1f} ms; losses "
          f"{'equal' if losses(plain.stdout) == losses(run.stdout) else 'DIFFER'}")
    return {"imbalance": max(peaks.values()) / min(peaks.values()),
            "tracked_over_budget": max(tracked.values()) / budget,
            "teraio_over_plain": teraio_ms / plain_ms, "predicted_over_measured": predicted_us / 1e3 / teraio_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--budget", type=float, default=0.5, help="share of the largest rank's profiled peak")
    p.add_argument("example_args", nargs="*")
    args = p.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.jobs:
            figures[name] = one_job(name, args.example_args or DEFAULT_ARGS, args.budget, Path(d))
    print(" ".join(f"{k}.{name}={v:.3f}" for name, f in figures.items() for k, v in f.items()))


if __name__ == "__main__":
    main()
