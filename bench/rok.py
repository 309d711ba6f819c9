"""The recompute-offload-keep (ROK) curve: peak memory against throughput of real CPU training.

After the SSD activation-offloading paper's ROK curve (shared/papers): every
configuration of one model is one point, x its peak memory, y its throughput.
For each example size, in one run:

- *keep*: the plain example (every activation stays);
- *recompute*: the plain example with ``--checkpoint`` (``torch.utils.checkpoint``
  per transformer block, ``use_reentrant=False``: PyTorch's recommended form);
- *teraio*: `teraio run` of the plain example, planned at 75% and 50% of its
  profiled peak, at the recompute run's peak (the equal-peak comparison), and at
  the smallest budget any plan meets;
- *teraio+ckpt*: `teraio run` of the checkpointed example at 50% of its peak
  and at its smallest budget.

Every configuration trains at the same batch, so tokens/s compare directly.
Step times are the example's own ``--timing`` figures, medians of the steps
from ``--skip`` on (iteration 0 builds the optimizer's state); the
configurations run alternately, ``--rounds`` times. Peak memory is tracked
bytes (the storages PyTorch ops see: the profiled peak for plain runs, the run
report's per-iteration peaks from iteration 1 for `teraio run`) and peak RSS
(the example's per-step peak for plain runs, the run report's per-iteration
peak for `teraio run`). Plans use the figures ``runtime.calibrate`` measures
on this machine (``machine``: the posix backend's bandwidth beside training,
each transfer's latency, the costs on the compute) and `teraio plan`'s
defaults otherwise (posix backend).

    python bench/rok.py [--sizes small wide] [--rounds 1] [--plot rok.png]

The last line holds the headline figures as ``key=value`` pairs:
``teraio_over_recompute`` (teraio's throughput at the recompute run's peak over
recompute's) and ``teraio_over_keep`` (teraio's throughput at 50% of the peak
over keep's, same batch), both at the last size; the same per size with the
size's name appended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quiet  # noqa: E402
from demo import EXAMPLE, losses, sh, teraio  # noqa: E402
from io_bandwidth import raw_o_direct  # noqa: E402
from run_overhead import steps  # noqa: E402

from planner import problem_from_profile  # noqa: E402
from planner.problem import resident_need_bytes  # noqa: E402
from profiles import read_profile  # noqa: E402

SIZES = {
    "small": ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "256", "--batch", "8"],
    "wide": ["--layers", "2", "--hidden", "512", "--heads", "8", "--seq", "512", "--batch", "8"],
}
MIB = 2**20


def _arg(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


@dataclass
class Config:
    """One point of the curve."""

    name: str
    checkpoint: bool
    budget_bytes: int | None = None  # None: a plain run
    plan: Path | None = None
    step_ms: list[float] = field(default_factory=list)
    tracked_peak_bytes: int = 0
    rss_peak_bytes: int = 0
    losses: list[str] | None = None

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step / (statistics.median(self.step_ms) / 1e3)


def machine(work: Path) -> list[str]:
    """`teraio plan`'s options for this machine (``runtime.calibrate``, measured once for every plan):
    what copies and transfers cost the compute here, each transfer's latency, and the posix backend's
    bandwidth beside training (beyond that latency), which the runtime gets, not the disk's raw
    O_DIRECT bandwidth (printed beside it)."""
    quiet.wait_idle()
    bw_w, bw_r = raw_o_direct(work, 256 * MIB)
    costs = json.loads(quiet.sh(sys.executable, "-m", "runtime.calibrate", "--json", "--swap-dir", work,
                                    label="calibrate").stdout)
    plan_w, plan_r = costs["posix_write_bw_bytes_per_s"], costs["posix_read_bw_bytes_per_s"]
    print(f"disk (O_DIRECT, 256 MiB): write {bw_w / 1e9:.2f} GB/s, read {bw_r / 1e9:.2f} GB/s; the posix backend "
          f"beside training {plan_w / 1e9:.2f} and {plan_r / 1e9:.2f} GB/s, each transfer holding its channel "
          f"{costs['transfer_latency_s'] * 1e6:.0f} us more, each direction keeping {costs['ssd_duplex']:.2f} of "
          f"its rate while both move; copies cost "
          f"the compute {costs['copy_cost_s_per_byte'] * 1e9:.3f} ns/byte, teraio run's dispatch "
          f"{costs['op_overhead_s'] * 1e6:.1f} us/op, faulting memory in again "
          f"{costs['refault_s_per_byte'] * 1e9:.3f} ns/byte, {costs['transfer_cost_s'] * 1e6:.0f} us per transfer "
          "(runtime.calibrate); plans made at these", flush=True)
    return ["--ssd-write-bw", f"{plan_w / 1e9:.3f}", "--ssd-read-bw", f"{plan_r / 1e9:.3f}",
            "--copy-cost", f"{costs['copy_cost_s_per_byte'] * 1e9:.4f}",
            "--op-overhead", f"{costs['op_overhead_s'] * 1e6:.3f}",
            "--refault-cost", f"{costs['refault_s_per_byte'] * 1e9:.4f}",
            "--transfer-cost", f"{costs['transfer_cost_s'] * 1e6:.3f}",
            "--transfer-latency", f"{costs['transfer_latency_s'] * 1e6:.3f}",
            "--ssd-duplex", f"{costs['ssd_duplex']:.3f}"]


def _profile(work: Path, name: str, ex: list[str]) -> tuple[Path, int, int]:
    """Profile the example; (profile dir, its tracked peak, the smallest budget any plan meets)."""
    prof = work / f"profile-{name}"
    quiet.sh(*teraio("profile", EXAMPLE, "--out", prof, "--force", "--", *ex))
    problem = problem_from_profile(read_profile(prof))
    return prof, int(problem.memory_bytes.max()), int(resident_need_bytes(problem).max())


def _run(cfg: Config, ex: list[str], work: Path, skip: int) -> None:
    args = [*ex, "--checkpoint"] if cfg.checkpoint else ex
    if cfg.plan is None:
        r = quiet.sh(sys.executable, EXAMPLE, *args)
        t, rss = steps(r.stdout, skip)
        cfg.rss_peak_bytes = max(cfg.rss_peak_bytes, int(max(rss) * MIB))
    else:
        report = work / "run.json"
        r = quiet.sh(*teraio("run", "--plan", cfg.plan, "--backend", "posix", "--swap-dir", work,
                       "--report", report, EXAMPLE, "--", *args))
        t, _ = steps(r.stdout, skip)
        rep = json.loads(report.read_text())
        cfg.tracked_peak_bytes = max(cfg.tracked_peak_bytes, max(rep["iteration_peak_bytes"][1:]))
        cfg.rss_peak_bytes = max(cfg.rss_peak_bytes, max(rep["iteration_peak_rss_bytes"][1:]))
    cfg.step_ms += t
    if cfg.losses is None:
        cfg.losses = losses(r.stdout)
    elif cfg.losses != losses(r.stdout):
        raise SystemExit(f"rok: {cfg.name}: losses differ between rounds")


def measure_size(size: str, ex: list[str], work: Path, plan_args: list[str], rounds: int,
                 skip: int) -> tuple[list[Config], dict[str, float]]:
    """Profile, plan and run every configuration of one size; (configs, headline ratios)."""
    keep_prof, keep_peak, keep_min = _profile(work, f"{size}-keep", ex)
    ckpt_prof, ckpt_peak, ckpt_min = _profile(work, f"{size}-ckpt", [*ex, "--checkpoint"])
    equal = max(ckpt_peak, keep_min)  # the recompute run's peak, if any plan can meet it
    configs = [
        Config("keep", False), Config("recompute", True),
        Config("teraio 75%", False, int(keep_peak * 0.75)), Config("teraio 50%", False, keep_peak // 2),
        Config("teraio =recompute" if equal == ckpt_peak else "teraio smallest (> recompute)", False, equal),
        Config("teraio smallest", False, keep_min),
        Config("teraio+ckpt 50%", True, ckpt_peak // 2), Config("teraio+ckpt smallest", True, ckpt_min),
    ]
    configs[0].tracked_peak_bytes, configs[1].tracked_peak_bytes = keep_peak, ckpt_peak
    for i, cfg in enumerate(configs):
        if cfg.budget_bytes is None:
            continue
        least = ckpt_min if cfg.checkpoint else keep_min
        if cfg.budget_bytes < least:  # no plan meets it: the smallest budget one meets, and say so
            print(f"{size}: {cfg.name}: {cfg.budget_bytes / MIB:,.1f} MiB is below the smallest budget any plan "
                  f"meets; planned at that, {least / MIB:,.1f} MiB")
            cfg.budget_bytes = least
        cfg.plan = work / f"plan-{size}-{i}.json"
        sh(*teraio("plan", ckpt_prof if cfg.checkpoint else keep_prof, "--gpu-mem", str(cfg.budget_bytes),
                   *plan_args, "--no-compare", "--out", cfg.plan), quiet=True)
    for _ in range(rounds):
        for cfg in configs:
            _run(cfg, ex, work, skip)
    by_name = {c.name: c for c in configs}
    for cfg in configs[2:]:
        base = by_name["recompute" if cfg.checkpoint else "keep"]
        if cfg.losses != base.losses:
            raise SystemExit(f"rok: {size}: {cfg.name} trained to other losses than {base.name}")
    tokens = _arg(ex, "--batch", 8) * _arg(ex, "--seq", 128)
    tput = {c.name: c.tokens_per_s(tokens) for c in configs}
    return configs, {
        "teraio_over_recompute": tput[configs[4].name] / tput["recompute"],
        "teraio_over_keep": tput["teraio 50%"] / tput["keep"],
    }


def print_table(size: str, ex: list[str], configs: list[Config]) -> None:
    tokens = _arg(ex, "--batch", 8) * _arg(ex, "--seq", 128)
    keep = configs[0]
    print(f"\n{size}: {' '.join(ex)}")
    print("| configuration | budget | peak tracked | peak RSS | step (median) | tokens/s | vs keep |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        budget = "-" if c.budget_bytes is None else f"{c.budget_bytes / MIB:,.1f} MiB"
        print(f"| {c.name} | {budget} | {c.tracked_peak_bytes / MIB:,.1f} MiB | {c.rss_peak_bytes / MIB:,.1f} MiB | "
              f"{statistics.median(c.step_ms):,.1f} ms | {c.tokens_per_s(tokens):,.0f} | "
              f"{c.tokens_per_s(tokens) / keep.tokens_per_s(tokens):.2f}x |")


def plot(path: Path, results: dict[str, tuple[list[str], list[Config]]],
         xlabel: str = "peak tracked memory (MiB)",
         title: str = "recompute-offload-keep (ROK) curve, example GPT on the CPU (bench/rok.py)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    marks = {"keep": ("o", "C0"), "recompute": ("s", "C3"), "teraio+ckpt": ("D", "C2"), "teraio": ("^", "C1"),
             "save_on_cpu": ("v", "C4"), "torchtune": ("P", "C5"), "compile": ("X", "C7"), "compiled": ("*", "C6"),
             "compiled_sync": ("h", "C8")}
    for ax, (size, (ex, configs)) in zip(axes[0], results.items(), strict=True):
        tokens = _arg(ex, "--batch", 8) * _arg(ex, "--seq", 128)
        for kind, (marker, color) in marks.items():
            pts = sorted((c.tracked_peak_bytes / MIB, c.tokens_per_s(tokens)) for c in configs
                         if c.name.split(" ")[0] == kind)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=kind,
                        linestyle="-" if len(pts) > 1 else "none")
        ax.set_title(f"{size}: {' '.join(ex)}", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput (tokens/s)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--rounds", type=int, default=1, help="times each configuration runs, alternated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip", type=int, default=1, help="leave out steps before this one")
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--quiet-budget", type=float, default=quiet.BUDGET_S,
                   help="seconds the whole bench may spend waiting for an idle machine and repeating runs "
                        "another process disturbed (bench/quiet.py)")
    p.add_argument("--plot", type=Path, default=None, help="write the curve here (PNG)")
    args = p.parse_args()
    quiet.BUDGET_S = args.quiet_budget
    started = time.monotonic()
    results: dict[str, tuple[list[str], list[Config]]] = {}
    headline: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="teraio-rok-", dir=args.swap_dir) as d:
        work = Path(d)
        plan_args = machine(work)
        for size in args.sizes:
            ex = [*SIZES[size], "--steps", str(args.steps), "--timing"]
            configs, ratios = measure_size(size, ex, work, plan_args, args.rounds, args.skip)
            results[size] = (SIZES[size], configs)
            print_table(size, SIZES[size], configs)
            headline = {**ratios, **{k: v for k, v in headline.items() if k not in ratios}}  # the last size's
            headline.update({f"{k}_{size}": v for k, v in ratios.items()})
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, results)
        print(f"\ncurve written to {args.plot}")
    print(quiet.TALLY.line())
    print(f"bench time {time.monotonic() - started:.0f} s, of which {quiet.TALLY.spent_s:.0f} s waiting and repeating")
    print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()))


if __name__ == "__main__":
    main()
