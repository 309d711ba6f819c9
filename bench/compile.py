"""What torch.compile would buy on the example, beside teraio, in one run.

    python bench/compile.py [--rounds 2] [--budget 0.5] [-- example args]

Profiles the example with --compile, plans at ``--budget`` of its peak, then
alternates ``--rounds`` times: the plain eager run, the plain compiled run and
`teraio run` of the compiled script (under teraio compiled code runs eagerly,
docs/compile.md). Per configuration: the median step time over steps 2 on
(compilation happens in steps 0 and 1), the highest peak RSS of those steps
(the example's --timing; for teraio its run report's per-iteration peaks)
and, for teraio, its tracked peak against the budget. Ends with one line of
key=value figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import quiet
from demo import EXAMPLE, losses, report_peak_mib, sh, step_ms, step_peak_mib, teraio

DEFAULT_ARGS = ["--layers", "4", "--hidden", "256", "--seq", "256", "--batch", "8", "--steps", "6"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.5, help="share of the profiled peak to plan for")
    p.add_argument("example_args", nargs="*")
    args = p.parse_args()
    ex_args = args.example_args or DEFAULT_ARGS
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        sh(*teraio("profile", EXAMPLE, "--out", work / "profile", "--", *ex_args, "--compile"))
        sh(*teraio("plan", work / "profile", "--gpu-mem", f"{args.budget:.0%}", "--ssd-bw", "2",
                   "--out", work / "plan.json"))
        budget = json.loads((work / "plan.json").read_text())["parameters"]["gpu_mem_bytes"]
        times: dict[str, list[float]] = {"eager": [], "compiled": [], "teraio": []}
        rss: dict[str, list[float]] = {k: [] for k in times}
        tracked: list[float] = []
        seen: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for name, cmd in (
                ("eager", [sys.executable, EXAMPLE, *ex_args, "--timing"]),
                ("compiled", [sys.executable, EXAMPLE, *ex_args, "--timing", "--compile"]),
                ("teraio", teraio("run", "--plan", work / "plan.json", "--swap-dir", work, "--report",
                                  work / "run.json", EXAMPLE, "--", *ex_args, "--timing", "--compile")),
            ):
                r = quiet.sh(*cmd, label=name)
                times[name].append(step_ms(r.stdout))
                seen[name] = losses(r.stdout)
                if name == "teraio":
                    report = json.loads((work / "run.json").read_text())
                    rss[name].append(report_peak_mib(report["iteration_peak_rss_bytes"]))
                    tracked.append(report_peak_mib(report["iteration_peak_bytes"]))
                else:
                    rss[name].append(step_peak_mib(r.stdout, "peak_rss_mib"))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nexample {' '.join(ex_args)}; {args.rounds} rounds; teraio planned at {args.budget:.0%} of the "
          f"profiled peak ({budget / 2**20:,.1f} MiB)")
    print("configuration     step (median)   vs eager   peak RSS")
    for name in times:
        print(f"{name:<16} {med[name]:>10,.1f} ms {med[name] / med['eager']:>9.2f}x "
              f"{max(rss[name]):>9,.1f} MiB")
    print(f"teraio tracked peak {max(tracked):,.1f} MiB, {max(tracked) * 2**20 / budget:.3f} of the budget")
    print(f"losses: teraio {'==' if seen['teraio'] == seen['eager'] else '!='} eager, "
          f"compiled {'==' if seen['compiled'] == seen['eager'] else '!='} eager")
    print(quiet.TALLY.line())
    print(f"compiled_over_eager={med['compiled'] / med['eager']:.3f} "
          f"teraio_over_eager={med['teraio'] / med['eager']:.3f} "
          f"teraio_over_compiled={med['teraio'] / med['compiled']:.3f} "
          f"teraio_tracked_over_budget={max(tracked) * 2**20 / budget:.3f}")


if __name__ == "__main__":
    main()
