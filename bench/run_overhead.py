"""What `teraio run` costs: iteration time and peak memory at a budget, against the plain run,
and the migration engine's bandwidth against the raw O_DIRECT bandwidth of the same disk.

Profiles the example once, measures the disk, plans at ``--budget`` of the
profiled peak with the measured read and write bandwidths, then runs the plain
script and `teraio run` alternately for ``--rounds`` rounds (each a fresh
process); step times and per-step peak RSS are the example's own `--timing`
figures (teraio's peak RSS from its run report, as the example's is not the
step's under teraio), steps before ``--skip`` left out (warm-up, and iteration 0, which
runs the script's set-up and makes the optimizer's state). Medians over all kept steps of all rounds.

    python bench/run_overhead.py [--rounds 3] [--budget 0.5] -- [example args]

The cost depends on the example's size: the copies scale with activation
bytes, the ops with the hidden size and sequence too (BENCHMARKS.md has both
the default and ``--layers 2 --hidden 1024 --heads 16 --seq 512 --batch 8``).

``--backend host --plan-bw GBS`` measures the engine against host memory
instead (pinned on CUDA), planned at that bandwidth: what a machine whose disk
is too slow for the model can still do.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import EXAMPLE, losses, sh, teraio  # noqa: E402
from io_bandwidth import engine_io, raw_o_direct  # noqa: E402

DEFAULT_EXAMPLE = ["--layers", "4", "--hidden", "256", "--seq", "256", "--batch", "8"]


def steps(stdout: str, skip: int) -> tuple[list[float], list[float]]:
    """(step ms, step peak RSS MiB) of the steps from ``skip`` on."""
    rows = re.findall(r"^step (\d+) loss \S+ time_ms (\S+)(?: peak_rss_mib (\S+))?", stdout, re.M)
    kept = [r for r in rows if int(r[0]) >= skip]
    return [float(r[1]) for r in kept], [float(r[2]) for r in kept if r[2]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2, help="leave out steps before this one")
    p.add_argument("--budget", type=float, default=0.5, help="memory budget as a share of the peak")
    p.add_argument("--io-mib", type=int, default=512, help="bytes moved per disk measurement")
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--backend", default="auto", choices=["auto", "posix", "host", "kvikio"],
                   help="teraio run's --backend")
    p.add_argument("--plan-bw", type=float, default=None,
                   help="plan at this bandwidth (GB/s, both ways) instead of the measured disk's")
    p.add_argument("example_args", nargs="*")
    args = p.parse_args()
    ex = [*(args.example_args or DEFAULT_EXAMPLE), "--steps", str(args.steps), "--timing"]

    with tempfile.TemporaryDirectory(dir=args.swap_dir) as d:
        work = Path(d)
        raw_w, raw_r = raw_o_direct(work, args.io_mib << 20)
        sh(*teraio("profile", EXAMPLE, "--out", work / "profile", "--", *ex))
        peak = json.loads(sh(*teraio("inspect", work / "profile", "--json")).stdout)["peak_bytes"]
        budget = int(peak * args.budget)
        plan_w, plan_r = (args.plan_bw * 1e9,) * 2 if args.plan_bw else (raw_w, raw_r)
        sh(*teraio("plan", work / "profile", "--gpu-mem", str(budget), "--ssd-read-bw", f"{plan_r / 1e9:.3f}",
                   "--ssd-write-bw", f"{plan_w / 1e9:.3f}", "--ssd-bw", f"{plan_r / 1e9:.3f}",
                   "--out", work / "plan.json"))
        predicted = json.loads((work / "plan.json").read_text())["summary"]["slowdown"]
        plain_ms, plain_rss, run_ms, run_rss, tracked = [], [], [], [], []
        for _ in range(args.rounds):
            plain = sh(sys.executable, EXAMPLE, *ex)
            pool = ["--host-mem", str(peak)] if args.backend == "host" else []  # room for all
            run = sh(*teraio("run", "--plan", work / "plan.json", "--backend", args.backend, *pool,
                             "--swap-dir", work, "--report",
                             work / "run.json", EXAMPLE, "--", *ex))
            if losses(plain.stdout) != losses(run.stdout):
                raise SystemExit("run_overhead: losses differ between the plain run and teraio run")
            t, r = steps(plain.stdout, args.skip)
            plain_ms += t
            plain_rss += r
            run_ms += steps(run.stdout, args.skip)[0]
            # teraio restarts the RSS counter at its boundaries: its own per-iteration figures
            report = json.loads((work / "run.json").read_text())
            run_rss += [b / 2**20 for b in report["iteration_peak_rss_bytes"][args.skip:]]
            tracked.append(report["peak_tracked_bytes"])
        eng = [engine_io(work, args.io_mib << 20, 2) for _ in range(args.rounds)]
        raws = [(raw_w, raw_r)] + [raw_o_direct(work, args.io_mib << 20) for _ in range(args.rounds - 1)]

    med = statistics.median
    mib = 2**20
    print()
    print(f"example: {' '.join(ex)}; budget {args.budget:.0%} of the {peak / mib:.1f} MiB profiled peak "
          f"= {budget / mib:.1f} MiB; planned at {plan_w / 1e9:.2f} GB/s write, {plan_r / 1e9:.2f} GB/s read; "
          f"backend {args.backend}")
    print("| measure | plain | teraio run | ratio |")
    print("|---|---|---|---|")
    print(f"| iteration time (median) | {med(plain_ms):.1f} ms | {med(run_ms):.1f} ms | "
          f"**{med(run_ms) / med(plain_ms):.2f}x** (the plan predicted {predicted:.2f}x) |")
    print(f"| peak tracked bytes | {peak / mib:.1f} MiB | {max(tracked) / mib:.1f} MiB | "
          f"{max(tracked) / budget:.3f} of the budget |")
    if plain_rss and run_rss:
        print(f"| peak RSS (max over kept steps) | {max(plain_rss):.1f} MiB | {max(run_rss):.1f} MiB | "
              f"{max(run_rss) / max(plain_rss):.2f}x |")
    w = med([e[0] for e in eng]) / med([r[0] for r in raws])
    r = med([e[1] for e in eng]) / med([r[1] for r in raws])
    print(f"| disk write, engine / raw O_DIRECT | {med([r[0] for r in raws]) / 1e9:.2f} GB/s | "
          f"{med([e[0] for e in eng]) / 1e9:.2f} GB/s | **{w:.2f}x** |")
    print(f"| disk read, engine / raw O_DIRECT | {med([r[1] for r in raws]) / 1e9:.2f} GB/s | "
          f"{med([e[1] for e in eng]) / 1e9:.2f} GB/s | **{r:.2f}x** |")


if __name__ == "__main__":
    main()
