"""The whole chain on the built-in example: profile, plan at about half the peak, run,
and compare peak memory, iteration time and losses with a plain run.

    python bench/demo.py --out demo-out [--budget 0.5] -- [example args]

Every step is the real command line a user would type; each is printed first.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"


def sh(*args: str | Path, quiet: bool = False, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(a) for a in args]
    shown = " ".join(a if a != sys.executable else "python" for a in cmd)
    if not quiet:
        print(f"$ {shown}", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and check:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"demo: the step above failed with exit status {r.returncode}")
    return r


def teraio(*args: str | Path) -> list[str | Path]:
    return [sys.executable, "-m", "teraio", *args]


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+)", stdout, re.M)


def step_ms(stdout: str) -> float:
    """Median step time, steps 0 and 1 left out (set-up and warm-up)."""
    times = [float(t) for t in re.findall(r"time_ms (\S+)", stdout)][2:]
    return statistics.median(times) if times else float("nan")


def step_peak_mib(stdout: str, what: str) -> float:
    """Highest per-step peak (the example's --timing ``peak_rss_mib`` or ``peak_cuda_mib``),
    steps 0 and 1 left out. Only for a plain run: under `teraio run` the example's figures
    are not the step's (see its --help); the run report has teraio's own."""
    values = [float(t) for t in re.findall(rf"{what} (\S+)", stdout)][2:]
    return max(values) if values else float("nan")


def report_peak_mib(values: list[int], skip: int = 2) -> float:
    """Highest per-iteration peak of a run report list, iterations before ``skip`` left out."""
    kept = values[skip:]
    return max(kept) / 2**20 if kept else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo-out"))
    p.add_argument("--budget", type=float, default=0.5, help="memory budget as a share of the peak")
    p.add_argument("--ssd-bw", default="2", help="planning bandwidth, GB/s")
    p.add_argument("example_args", nargs="*")
    args = p.parse_args()
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ex = [*args.example_args, "--timing"]

    sh(*teraio("profile", EXAMPLE, "--out", out / "profile", "--", *ex))
    summary = json.loads(sh(*teraio("inspect", out / "profile", "--json")).stdout)
    peak = summary["peak_bytes"]
    budget = int(summary["peak_needed_bytes"] * args.budget)  # the ops' scratch counted, as `--gpu-mem N%` does
    plan = sh(*teraio("plan", out / "profile", "--gpu-mem", str(budget), "--ssd-bw", args.ssd_bw,
                      "--out", out / "plan.json"))
    print(plan.stdout, end="")

    plain = sh(sys.executable, EXAMPLE, *ex)
    run = sh(*teraio("run", "--plan", out / "plan.json", "--swap-dir", out, "--report",
                     out / "run.json", EXAMPLE, "--", *ex))
    report = json.loads((out / "run.json").read_text())
    same = losses(plain.stdout) == losses(run.stdout) and losses(run.stdout)

    def mib(n: float) -> str:
        return f"{n / 2**20:,.1f} MiB"

    print()
    print(f"{'':28}{'plain':>14}{'teraio run':>14}")
    print(f"{'peak tracked (iter. 1+)':28}{mib(peak):>14}{mib(report['peak_tracked_bytes']):>14}"
          f"   (budget {mib(budget)})")
    first = json.loads((out / "plan.json").read_text()).get("first_iteration")
    if first is not None and report["first_iteration_peak_bytes"] is not None:
        print(f"{'peak (iteration 0)':28}{mib(first['summary']['peak_before_bytes']):>14}"
              f"{mib(report['first_iteration_peak_bytes']):>14}"
              f"   (budget {mib(first['parameters']['gpu_mem_bytes'])})")
    if report["iteration_peak_cuda_allocated_bytes"]:
        print(f"{'peak CUDA allocated (2+)':28}{step_peak_mib(plain.stdout, 'peak_cuda_mib'):>10.1f} MiB"
              f"{report_peak_mib(report['iteration_peak_cuda_allocated_bytes']):>10.1f} MiB")
    print(f"{'peak RSS (steps 2+)':28}{step_peak_mib(plain.stdout, 'peak_rss_mib'):>10.1f} MiB"
          f"{report_peak_mib(report['iteration_peak_rss_bytes']):>10.1f} MiB")
    print(f"{'iteration time (median)':28}{step_ms(plain.stdout):>11.1f} ms"
          f"{step_ms(run.stdout):>11.1f} ms")
    print(f"{'losses identical':28}{'':>14}{'yes' if same else 'NO':>14}")
    if not same:
        raise SystemExit("demo: losses differ")


if __name__ == "__main__":
    main()
