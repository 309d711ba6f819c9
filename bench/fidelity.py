"""Predictions that hold: `teraio plan`'s predicted iteration time and tracked peak against
what `teraio run` measures, on the CPU.

For each example size: `teraio profile`, then at 100% (a plan that moves
nothing: the error of the base, the runtime's own costs without transfers), 75%
and 50% of the profiled peak and at the smallest budget any plan meets, `teraio plan` (at the
figures ``python -m runtime.calibrate`` measures on this machine once: the posix
backend's bandwidth beside training and each transfer's latency, NOTE [ Transfer
latency ], and the costs on the compute, NOTE [ Copies on the compute ], both in
planner/simulate.py; `teraio plan` measures all but the bandwidth by default for
a CPU profile) and one `teraio run` (posix backend). Predicted
against measured:

- iteration time: the plan's ``predicted_iteration_us`` against the run
  report's median iteration (iterations 1 on; iteration 0 has a plan of its own);
- tracked peak: the plan's ``peak_tracked_after_bytes`` (its peak without the ops'
  scratch, NOTE [ Scratch ] in torch_patch/tracer.py) against the highest of the run
  report's ``iteration_peak_bytes`` from iteration 1;
- with ``--gpu`` also CUDA's allocated peak from iteration 1 against the budget.

Errors are |measured - predicted| / measured.

This VM's speed drifts: the same run has measured 507 ms and, an hour later,
585-665 ms. So a plain run (no teraio) follows each `teraio run`, and the
*drift* of a budget is the mean of the plain runs just before and just after
its run over the first plain run, taken beside the profile. "Error at the
drift" scales the prediction by it: what is left is the model's own error, not
the machine's. The headline's ``time_error_max`` is the raw one.

    python bench/fidelity.py [--sizes small wide] [--steps 6]
    python bench/fidelity.py --gpu [--sizes tiny 2k 4k]

With ``--gpu``: the sizes of bench/rok_gpu.py, plans at the pinned link's measured bandwidth
(no copy costs on the compute: the GPU's copy engines move the bytes) and `teraio run` with the
host backend, pinned. ``--stream-copies`` (with ``--gpu``) runs each plan a second time, beside
the first, with `teraio run --stream-copies` (NOTE [ Copies ordered on streams ] in
runtime/engine.py), and adds ``stream_copies_speedup.<size>.<budget>=``: the first run's median
iteration over the second's.

The last line: ``time_error_max=... peak_error_max=... time_error_at_drift_max=...``
(fractions, the worst case of all), then each size's worst; with ``--gpu`` also
``cuda_over_budget_max``: CUDA's allocated peak over the budget, the worst of all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quiet  # noqa: E402
from demo import EXAMPLE, losses, sh, teraio  # noqa: E402
from rok import MIB, SIZES, machine  # noqa: E402
from rok_gpu import GPU_SIZES, pinned_bandwidth, pinned_plan_args  # noqa: E402
from run_overhead import steps  # noqa: E402

from planner import problem_from_profile  # noqa: E402
from planner.problem import resident_need_bytes  # noqa: E402
from profiles import read_profile  # noqa: E402


def moved(report: dict[str, Any]) -> str:
    """What a run wrote and read, and how fast while each direction moved bytes."""
    out = []
    for what, key, bw in (("wrote", "bytes_written", report["write_bandwidth_bytes_per_s"]),
                          ("read", "bytes_read", report["read_bandwidth_bytes_per_s"])):
        out.append(f"{what} {sum(report[key].values()) / 2**30:.1f} GiB" + (f" at {bw / 1e9:.1f} GB/s" if bw else ""))
    return ", ".join(out)


def written(summary: dict[str, Any], report: dict[str, Any]) -> str:
    """Bytes written an iteration: the plan's (what its moves write, kept copies not) against the
    run's median from iteration 1 on. A busy time measured over the predicted one is a slower
    link, or more bytes than the plan writes."""
    measured = report["iteration_moved_bytes"]["write"][1:]
    pred = summary["bytes_to_ssd"] + summary["bytes_to_host"]
    return (f"written an iteration, predicted / measured: {pred / 2**30:.2f} / "
            f"{(statistics.median(measured) if measured else 0) / 2**30:.2f} GiB")


def waits(report: dict[str, Any]) -> str:
    """The run's waits per iteration from iteration 1 on, by what each was for (``_wait`` in
    runtime/executor.py): where a GPU run's host loses its lead over the GPU."""
    per = max(len(report["iteration_s"]) - 1, 1)
    causes = sorted(report.get("steady_stalls", {}).items(), key=lambda kv: -kv[1][1])
    return "waits an iteration: " + (", ".join(f"{c} {n / per:.1f} ({s / per * 1e3:,.0f} ms)" for c, (n, s) in causes)
                                     or "none")


def busy(summary: dict[str, Any], report: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per direction, the seconds of an iteration the plan predicts its channels busy (moving bytes
    or in a transfer's latency), and the median the run measured (any transfer moving) from
    iteration 1 on. The plan's SSD and host channels are added, where the run counts a moment both
    move once: a plan that uses both (not this bench's) would read as over-predicted."""
    share, t = summary["bandwidth_utilisation"], summary["predicted_iteration_us"] / 1e6
    out = {}
    for d in ("write", "read"):
        measured = report["iteration_busy_s"][d][1:]
        out[d] = (t * (share[f"ssd_{d}"] + share[f"host_{d}"]), statistics.median(measured) if measured else 0.0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=None, choices=[*SIZES, *GPU_SIZES],
                   help=f"default: {' '.join(SIZES)}, or with --gpu 2k 4k")
    p.add_argument("--gpu", action="store_true", help="on a CUDA device: host backend, pinned")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--stream-copies", action="store_true",
                   help="with --gpu: each plan run again with `teraio run --stream-copies`, side by side")
    p.add_argument("--quiet-budget", type=float, default=quiet.BUDGET_S,
                   help="seconds the whole bench may spend waiting for an idle machine and repeating runs "
                        "another process disturbed (bench/quiet.py)")
    args = p.parse_args()
    sizes = GPU_SIZES if args.gpu else SIZES
    args.sizes = args.sizes or (["2k", "4k"] if args.gpu else list(SIZES))
    if not set(args.sizes) <= set(sizes):
        p.error(f"--sizes: choose from {' '.join(sizes)}" + (" with --gpu" if args.gpu else " without --gpu"))
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("fidelity: skipped: --gpu and no CUDA device here (without --gpu it measures the CPU)")
            return
    if args.stream_copies and not args.gpu:
        p.error("--stream-copies: with --gpu only (it changes nothing on the CPU)")
    quiet.BUDGET_S = args.quiet_budget
    started = time.monotonic()
    rows = []
    speedups: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="teraio-fidelity-", dir=args.swap_dir) as d:
        work = Path(d)
        if args.gpu:
            d2h, h2d, duplex = pinned_bandwidth()
            print(f"pinned copies: device to host {d2h / 1e9:.1f} GB/s, host to device {h2d / 1e9:.1f} GB/s, "
                  f"each keeping {duplex:.2f} of that both ways at once", flush=True)
            plan_args = pinned_plan_args(d2h, h2d, duplex)
        else:
            plan_args = machine(work)
        for size in args.sizes:
            ex = [*sizes[size], "--steps", str(args.steps)]
            prof = work / f"profile-{size}"
            quiet.sh(*teraio("profile", EXAMPLE, "--out", prof, "--force", "--", *ex))
            plain_run = quiet.sh(sys.executable, EXAMPLE, *ex, "--timing")
            plain = losses(plain_run.stdout)
            plain_s = statistics.median(steps(plain_run.stdout, 1)[0]) / 1e3
            before_s = plain_s
            problem = problem_from_profile(read_profile(prof))
            peak = int(problem.memory_bytes.max())
            # 100%: a plan that moves nothing, so the error of the rest can be told from the base's
            budgets = {"100%": peak, "75%": int(peak * 0.75), "50%": peak // 2,
                       "smallest": int(resident_need_bytes(problem).max())}
            for share, budget in budgets.items():
                plan, report = work / f"plan-{size}-{share}.json", work / "run.json"
                sh(*teraio("plan", prof, "--gpu-mem", str(budget), *plan_args, "--no-compare", "--out", plan),
                   quiet=True)
                backend = ["--backend", "host", "--host-mem", str(peak)] if args.gpu else ["--backend", "posix"]
                run = quiet.sh(*teraio("run", "--plan", plan, *backend, "--swap-dir", work,
                                 "--report", report, EXAMPLE, "--", *ex))
                if losses(run.stdout) != plain:
                    raise SystemExit(f"fidelity: {size} {share}: losses differ from the plain run's")
                after = quiet.sh(sys.executable, EXAMPLE, *ex, "--timing")
                after_s = statistics.median(steps(after.stdout, 1)[0]) / 1e3
                drift = (before_s + after_s) / 2 / plain_s
                before_s = after_s
                if args.stream_copies:
                    streamed = quiet.sh(*teraio("run", "--plan", plan, *backend, "--stream-copies", "--swap-dir",
                                                work, "--report", work / "streamed.json", EXAMPLE, "--", *ex))
                    if losses(streamed.stdout) != plain:
                        raise SystemExit(f"fidelity: {size} {share}: --stream-copies: losses differ from "
                                         "the plain run's")
                    rs = json.loads((work / "streamed.json").read_text())
                    streamed_s = statistics.median(rs["iteration_s"][1:])
                s = json.loads(plan.read_text())["summary"]
                r = json.loads(report.read_text())
                if args.stream_copies:
                    host_waits_s = statistics.median(r["iteration_s"][1:])
                    speedups[f"stream_copies_speedup.{size}.{share}"] = host_waits_s / streamed_s
                    print(f"{size} {share}: --stream-copies: measured {streamed_s * 1e3:,.0f} ms, peak "
                          f"{max(rs['iteration_peak_bytes'][1:]) / MIB:.1f} MiB, CUDA's "
                          f"{max(rs['iteration_peak_cuda_allocated_bytes'][1:]) / MIB:.1f} MiB; {waits(rs)}",
                          flush=True)
                time_pred, time_meas = s["predicted_iteration_us"] / 1e6, statistics.median(r["iteration_s"][1:])
                peak_pred = s.get("peak_tracked_after_bytes", s["peak_after_bytes"])
                peak_meas = max(r["iteration_peak_bytes"][1:])
                cuda = r["iteration_peak_cuda_allocated_bytes"][1:]
                rows.append({
                    "size": size, "share": share, "budget": budget, "time_pred": time_pred, "time_meas": time_meas,
                    "time_err": abs(time_meas - time_pred) / time_meas, "peak_pred": peak_pred,
                    "peak_meas": peak_meas, "peak_err": abs(peak_meas - peak_pred) / peak_meas,
                    "ideal": s["ideal_iteration_us"] / 1e6, "stall_pred": s["stall_us"] / 1e6,
                    "stall_meas": statistics.median(r["iteration_stall_s"][1:]),
                    # waits per iteration, all iterations together (the report counts them so); on a GPU
                    # each one costs the host its lead over the GPU, which the simulator does not model
                    "waits": r["stalls"] / max(len(r["iteration_s"]), 1), "stalls_pred": s["num_stalled_ops"],
                    "charge": s["copy_charge_us"] / 1e6, "overhead": s["op_overhead_us"] / 1e6,
                    "refault": s["refault_us"] / 1e6, "plain": plain_s, "drift": drift,
                    "drift_err": abs(time_meas - time_pred * drift) / time_meas,
                    "cuda_over": max(cuda) / budget - 1 if cuda else None, "busy": busy(s, r),
                })
                print(f"{size} {share}: predicted {time_pred * 1e3:,.0f} ms, measured {time_meas * 1e3:,.0f} ms "
                      f"(plain runs beside it {drift:.2f}x the first); "
                      f"peak predicted {peak_pred / MIB:.1f} MiB, measured {peak_meas / MIB:.1f} MiB"
                      + (f", CUDA's {max(cuda) / MIB:.1f} MiB" if cuda else "")
                      + "; " + moved(r) + "; " + written(s, r) + "; " + waits(r)
                      + "; busy an iteration, predicted / measured: "
                      + ", ".join(f"{d} {p * 1e3:,.0f} / {m * 1e3:,.0f} ms" for d, (p, m) in rows[-1]["busy"].items()),
                      flush=True)
    print()
    print("| example | budget | iteration predicted | measured | error | plain drift | error at the drift | "
          "predicted: ops (plain run) / runtime per op / faults / copies / stalls | stalls measured | "
          "ops stalled predicted / waits measured per iteration (all iterations, the first too) | "
          "writes busy predicted / measured | reads busy predicted / measured | "
          "tracked peak predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        busy_cells = " | ".join(f"{p * 1e3:,.0f} / {m * 1e3:,.0f} ms" for p, m in r["busy"].values())
        print(f"| {r['size']} | {r['share']}, {r['budget'] / MIB:.1f} MiB | {r['time_pred'] * 1e3:,.0f} ms | "
              f"{r['time_meas'] * 1e3:,.0f} ms | {r['time_err']:.1%} | {r['drift']:.2f}x | {r['drift_err']:.1%} | "
              f"{r['ideal'] * 1e3:,.0f} "
              f"({r['plain'] * 1e3:,.0f}) / "
              f"{r['overhead'] * 1e3:,.0f} / {r['refault'] * 1e3:,.0f} / {r['charge'] * 1e3:,.0f} / "
              f"{r['stall_pred'] * 1e3:,.0f} ms | {r['stall_meas'] * 1e3:,.0f} ms | "
              f"{r['stalls_pred']:,} / {r['waits']:,.0f} | {busy_cells} | "
              f"{r['peak_pred'] / MIB:.1f} MiB | {r['peak_meas'] / MIB:.1f} MiB | {r['peak_err']:.1%} |")
    worst = {"time_error_max": max(r["time_err"] for r in rows), "peak_error_max": max(r["peak_err"] for r in rows),
             "time_error_at_drift_max": max(r["drift_err"] for r in rows)}
    for size in args.sizes:
        worst[f"time_error_max_{size}"] = max(r["time_err"] for r in rows if r["size"] == size)
        worst[f"peak_error_max_{size}"] = max(r["peak_err"] for r in rows if r["size"] == size)
    if args.gpu:  # CUDA's allocated peak over the budget: what libraries hold outside any op
        worst["cuda_over_budget_max"] = max(r["cuda_over"] for r in rows)
    print(quiet.TALLY.line())
    print(f"bench time {time.monotonic() - started:.0f} s, of which {quiet.TALLY.spent_s:.0f} s waiting and repeating")
    print(" ".join(f"{k}={v:.3f}" for k, v in {**worst, **speedups}.items()))


if __name__ == "__main__":
    main()
