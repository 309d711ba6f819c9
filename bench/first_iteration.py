"""Iteration 0 against its budget: the tracked peak of every iteration under `teraio run`,
as a share of the plan's budget, for a few shapes of the example at 50% of the profiled
peak and at the smallest budget any plan meets.

Iteration 0 runs the script's set-up and the optimizer makes its state in it, so it is
planned apart (NOTE [ The first iteration's plan ] in planner/plan.py); this shows it
stays within the budget like the iterations after it. Each case is the real command
line: `teraio profile`, `teraio plan`, `teraio run --report`.

    python bench/first_iteration.py [--backend posix|host]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import EXAMPLE, sh, teraio  # noqa: E402

from planner import problem_from_profile  # noqa: E402
from planner.problem import resident_need_bytes  # noqa: E402
from profiles import read_profile  # noqa: E402

SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "8", "--vocab", "512"]
CASES = {
    "adamw": [*SMALL, "--steps", "4"],
    "adamw-foreach": [*SMALL, "--foreach", "--steps", "4"],
    "wide-foreach": ["--layers", "1", "--hidden", "512", "--heads", "8", "--seq", "256", "--batch", "8",
                     "--vocab", "512", "--foreach", "--steps", "3"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="posix", choices=["posix", "host"])
    p.add_argument("--ssd-bw", default="2", help="planned SSD bandwidth, GB/s")
    args = p.parse_args()
    print(f"{'case':<15}{'budget':<9}{'MiB':>9}   iteration peaks / budget (0, 1, ...)")
    with tempfile.TemporaryDirectory(prefix="teraio-first-") as tmp:
        out = Path(tmp)
        for name, case in CASES.items():
            prof = out / name
            sh(*teraio("profile", EXAMPLE, "--out", prof, "--iters", "2", "--", *case), quiet=True)
            problem = problem_from_profile(read_profile(prof))
            budgets = {"50%": int(problem.memory_bytes.max() * 0.5),
                       "smallest": int(resident_need_bytes(problem).max())}
            for share, budget in budgets.items():
                plan, report = out / f"{name}-{share}.json", out / f"{name}-{share}-run.json"
                sh(*teraio("plan", prof, "--gpu-mem", str(budget), "--ssd-bw", args.ssd_bw,
                           "--host-mem", "64M", "--out", plan), quiet=True)
                sh(*teraio("run", "--plan", plan, "--backend", args.backend, "--swap-dir", out,
                           "--report", report, EXAMPLE, "--", *case), quiet=True)
                peaks = json.loads(report.read_text())["iteration_peak_bytes"]
                shares = ", ".join(f"{p / budget:.3f}" for p in peaks)
                print(f"{name:<15}{share:<9}{budget / 2**20:>9.1f}   {shares}", flush=True)


if __name__ == "__main__":
    main()
