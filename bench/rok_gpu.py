"""The recompute-offload-keep curve on one GPU, with the peers a user would pick instead of teraio.

Issue 15, item 5: `bench/rok.py`'s curve where the copies run beside the compute.
For each example size, in one run, plain runs of the example first:

- *keep* (every activation stays) and *recompute* (``--checkpoint``: ``torch.utils.checkpoint``
  per block);
- *save_on_cpu*, *torchtune*, *compiled* and *compiled_sync*: the example's ``--offload`` peers
  (``offloading()`` in examples/train_gpt.py says what each is), and *compile* (torch.compile
  alone, the compiled peer's own reference);

then `teraio run` (host backend, pinned; planned at the pinned link's measured bandwidth) at 75%
and 50% of the profiled peak, at the smallest budget any plan meets, and at each peer's measured
peak: the equal-peak comparisons. A peer that fails (not installed, an error) is a row that says why.

Peak memory is CUDA's allocated peak (``torch.cuda.max_memory_allocated``): the example's per-step
figure for plain runs, the run report's per-iteration figure for `teraio run`, highest from step
``--skip`` on. A peer's peak becomes teraio's budget less what CUDA holds beyond teraio's tracked
bytes in the keep run (workspaces, rounding), so both sides count the same bytes. Throughput is
tokens/s from median step times, steps from ``--skip`` on. teraio's losses must equal keep's
(bit for bit); the peers' are reported (the compiled ones run other kernels).

    python bench/rok_gpu.py [--sizes 2k 4k 4k-s256] [--plot rok-gpu.png]

The last line holds ``teraio_over_<peer>`` (teraio's throughput at the peer's peak over the
peer's) for recompute and every peer that ran and saves memory, where teraio's measured peak did
not go over the peer's, ``teraio_over_keep`` (at 50%, same batch) and ``teraio_over_keep_75`` (at
75%), for the last size; then the same per size with the size's name appended.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import EXAMPLE, losses, sh, teraio  # noqa: E402
from rok import MIB, Config, _arg, plot  # noqa: E402

from planner import problem_from_profile  # noqa: E402
from planner.problem import resident_need_bytes  # noqa: E402
from profiles import read_profile  # noqa: E402

GPU_SIZES = {
    "tiny": ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--batch", "4"],  # a smoke test
    "2k": ["--layers", "4", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--batch", "8",
             "--vocab", "8192"],
    "4k": ["--layers", "2", "--hidden", "4096", "--heads", "32", "--seq", "1024", "--batch", "16",
              "--vocab", "8192"],
    # 4k's tokens in shorter sequences: less attention-score bytes per token, so its ops are long
    # against what it saves for backward (a fake H100 plan at 50% predicts 1.03x of ideal, 2k's 1.29x)
    "4k-s256": ["--layers", "2", "--hidden", "4096", "--heads", "32", "--seq", "256", "--batch", "64",
                "--vocab", "8192"],
}
PEERS = {"recompute": ["--checkpoint"], "save_on_cpu": ["--offload", "save_on_cpu"],
         "torchtune": ["--offload", "torchtune"], "compile": ["--compile"], "compiled": ["--offload", "compiled"],
         "compiled_sync": ["--offload", "compiled_sync"]}


def pinned_bandwidth(total: int = 1 << 30) -> tuple[float, float, float]:
    """(device-to-host, host-to-device) bytes/s of one ``total``-byte copy between the GPU and
    pinned host memory, best of 5: what teraio's host backend moves at best; and the share of it
    each way keeps with one copy each way at once (NOTE [ Duplex ] in planner/simulate.py)."""
    import torch

    dev = [torch.empty(total, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = [torch.empty(total, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    best = [float("inf")] * 3
    for _ in range(5):
        for i, pairs in enumerate([[(host[0], dev[0])], [(dev[0], host[0])], [(host[0], dev[0]), (dev[1], host[1])]]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for (dst, src), stream in zip(pairs, streams, strict=False):
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    # both share until the faster ends (at f of their rates), then the slower goes on alone:
    # T_both = T_min / f + T_max - T_min (NOTE [ Duplex ])
    t_min, t_max = min(best[:2]), max(best[:2])
    return total / best[0], total / best[1], min(max(t_min / max(best[2] - t_max + t_min, 1e-12), 0.05), 1.0)


def pinned_plan_args(d2h: float, h2d: float, duplex: float) -> list[str]:
    """`teraio plan`'s options for `teraio run --backend host` on a GPU: the host link in the SSD's
    channels, which that backend stands in for."""
    return ["--ssd-write-bw", f"{d2h / 1e9:.3f}", "--ssd-read-bw", f"{h2d / 1e9:.3f}", "--ssd-duplex", f"{duplex:.3f}"]


def cuda_peak(stdout: str, skip: int) -> int:
    peaks = [float(m) for s, m in re.findall(r"^step (\d+) .*peak_cuda_mib (\S+)", stdout, re.M) if int(s) >= skip]
    return int(max(peaks) * MIB) if peaks else 0


def step_times(stdout: str, skip: int) -> list[float]:
    return [float(t) for s, t in re.findall(r"^step (\d+) loss \S+ time_ms (\S+)", stdout, re.M) if int(s) >= skip]


def run_plain(cfg: Config, ex: list[str], skip: int) -> str | None:
    """Run one plain configuration; None, or why it did not run."""
    r = subprocess.run([sys.executable, str(EXAMPLE), *ex, *PEERS.get(cfg.name, [])], capture_output=True, text=True)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        errors = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception)\b", ln)]
        return (errors or lines or [f"exit status {r.returncode}"])[-1][:200]
    cfg.step_ms, cfg.losses = step_times(r.stdout, skip), losses(r.stdout)
    cfg.tracked_peak_bytes = cuda_peak(r.stdout, skip)  # CUDA's allocated peak on this bench
    return None


STREAM_COPIES: list[str] = []  # ["--stream-copies"] with that option


def run_teraio(cfg: Config, ex: list[str], work: Path, skip: int, pool: int) -> None:
    report = work / "run.json"
    r = sh(*teraio("run", "--plan", cfg.plan, "--backend", "host", "--host-mem", str(pool), "--report", report,
                   *STREAM_COPIES, EXAMPLE, "--", *ex), quiet=True)
    rep = json.loads(report.read_text())
    cfg.step_ms, cfg.losses = step_times(r.stdout, skip), losses(r.stdout)
    cuda = rep["iteration_peak_cuda_allocated_bytes"][skip:]
    cfg.tracked_peak_bytes = max(cuda) if cuda else 0


def measure_size(size: str, ex: list[str], work: Path, plan_args: list[str], skip: int,
                 peers: list[str]) -> tuple[list[Config], dict[str, str], dict[str, float]]:
    plain = [Config("keep", False), *(Config(p, p == "recompute") for p in peers)]
    failed: dict[str, str] = {}
    for cfg in plain:
        why = run_plain(cfg, ex, skip)
        print(f"{size}: {cfg.name}: " + (f"did not run: {why}" if why else
              f"{statistics.median(cfg.step_ms):,.1f} ms, peak {cfg.tracked_peak_bytes / MIB:,.1f} MiB"), flush=True)
        if why:
            failed[cfg.name] = why
    if "keep" in failed:
        raise SystemExit(f"rok_gpu: {size}: the plain example did not run: {failed['keep']}")
    ran = [c for c in plain if c.name not in failed]
    keep = ran[0]
    prof = work / f"profile-{size}"
    sh(*teraio("profile", EXAMPLE, "--out", prof, "--force", "--", *ex), quiet=True)
    problem = problem_from_profile(read_profile(prof))
    peak, least = int(problem.memory_bytes.max()), int(resident_need_bytes(problem).max())
    beyond = keep.tracked_peak_bytes - peak  # what CUDA holds beyond teraio's tracked bytes
    print(f"{size}: profiled peak {peak / MIB:,.1f} MiB (CUDA's {keep.tracked_peak_bytes / MIB:,.1f}), smallest "
          f"budget {least / MIB:,.1f} MiB", flush=True)
    budgets = {"teraio 75%": peak * 3 // 4, "teraio 50%": peak // 2, "teraio smallest": least}
    for cfg in ran[1:]:
        if cfg.tracked_peak_bytes < 0.95 * keep.tracked_peak_bytes:  # a peer that saves memory (not compile)
            budgets[f"teraio ={cfg.name}"] = max(least, cfg.tracked_peak_bytes - beyond)
    runs = []
    for i, (name, budget) in enumerate(budgets.items()):
        cfg = Config(name, False, budget, work / f"plan-{size}-{i}.json")
        sh(*teraio("plan", prof, "--gpu-mem", str(budget), *plan_args, "--no-compare", "--out", cfg.plan),
           quiet=True)
        run_teraio(cfg, ex, work, skip, peak)
        if cfg.losses != keep.losses:
            raise SystemExit(f"rok_gpu: {size}: {name} trained to other losses than keep")
        print(f"{size}: {name} (budget {budget / MIB:,.1f} MiB): {statistics.median(cfg.step_ms):,.1f} ms, "
              f"peak {cfg.tracked_peak_bytes / MIB:,.1f} MiB", flush=True)
        runs.append(cfg)
    tokens = _arg(ex, "--batch", 8) * _arg(ex, "--seq", 128)
    tput = {c.name: c.tokens_per_s(tokens) for c in [*ran, *runs]}
    ratios = {"teraio_over_keep": tput["teraio 50%"] / tput["keep"],
              "teraio_over_keep_75": tput["teraio 75%"] / tput["keep"]}
    by_name = {c.name: c for c in runs}
    for cfg in ran[1:]:
        mine = by_name.get(f"teraio ={cfg.name}")
        if mine is None:
            continue
        if mine.tracked_peak_bytes > cfg.tracked_peak_bytes:  # not at equal peak: no ratio
            print(f"{size}: teraio at {cfg.name}'s peak went over it ({mine.tracked_peak_bytes / MIB:,.1f} "
                  f"against {cfg.tracked_peak_bytes / MIB:,.1f} MiB): no ratio", flush=True)
            continue
        ratios[f"teraio_over_{cfg.name}"] = tput[mine.name] / tput[cfg.name]
    return [*plain, *runs], failed, ratios


def print_table(size: str, ex: list[str], configs: list[Config], failed: dict[str, str]) -> None:
    tokens = _arg(ex, "--batch", 8) * _arg(ex, "--seq", 128)
    keep = configs[0]
    print(f"\n{size}: {' '.join(ex)}")
    print("| configuration | budget | peak CUDA allocated | step (median) | tokens/s | vs keep | losses |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for c in configs:
        if c.name in failed:
            print(f"| {c.name} | - | - | - | - | - | did not run: {failed[c.name]} |")
            continue
        budget = "-" if c.budget_bytes is None else f"{c.budget_bytes / MIB:,.1f} MiB"
        same = "keep's" if c.losses == keep.losses else "differ from keep's"
        print(f"| {c.name} | {budget} | {c.tracked_peak_bytes / MIB:,.1f} MiB | "
              f"{statistics.median(c.step_ms):,.1f} ms | {c.tokens_per_s(tokens):,.0f} | "
              f"{c.tokens_per_s(tokens) / keep.tokens_per_s(tokens):.2f}x | {same} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["2k"], choices=list(GPU_SIZES))
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--skip", type=int, default=2, help="leave out steps before this one (compilation, warm-up)")
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--plot", type=Path, default=None, help="write the curve here (PNG)")
    p.add_argument("--stream-copies", action="store_true",
                   help="teraio's runs with `teraio run --stream-copies` (NOTE [ Copies ordered on streams ])")
    args = p.parse_args()
    if args.stream_copies:
        STREAM_COPIES.append("--stream-copies")
    import torch

    if not torch.cuda.is_available():
        print("rok_gpu: skipped: no CUDA device here (bench/rok.py is the CPU curve)")
        return
    started = time.monotonic()
    d2h, h2d, duplex = pinned_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; pinned copies: device to host "
          f"{d2h / 1e9:.1f} GB/s, host to device {h2d / 1e9:.1f} GB/s, each keeping {duplex:.2f} of that both "
          "ways at once (plans made at these)", flush=True)
    plan_args = pinned_plan_args(d2h, h2d, duplex)
    results: dict[str, tuple[list[str], list[Config]]] = {}
    last: dict[str, float] = {}
    per_size: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="teraio-rok-gpu-", dir=args.swap_dir) as d:
        for size in args.sizes:
            ex = [*GPU_SIZES[size], "--steps", str(args.steps), "--timing"]
            configs, failed, ratios = measure_size(size, ex, Path(d), plan_args, args.skip, args.peers)
            print_table(size, GPU_SIZES[size], configs, failed)
            results[size] = (GPU_SIZES[size], [c for c in configs if c.name not in failed])
            per_size.update({f"{k}_{size}": v for k, v in ratios.items()})
            last = ratios
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, results, xlabel="peak CUDA allocated (MiB)",
             title=f"recompute-offload-keep (ROK) curve, example GPT\non {torch.cuda.get_device_name()} "
                   "(bench/rok_gpu.py)")
        print(f"\ncurve written to {args.plot}")
    print(f"bench time {time.monotonic() - started:.0f} s")
    print(" ".join(f"{k}={v:.3f}" for k, v in {**last, **per_size}.items()))


if __name__ == "__main__":
    main()
