"""`teraio plan`: build the offload/prefetch plan of a profile and predict what it costs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.console import fail, info, warn

__all__ = ["cpu_costs_from_options", "hardware_from_options", "job_keys", "load_profile", "plan"]

_SIZE_HELP = "K/M/G/T are binary (powers of 1024); a plain number is bytes."
PROFILE_ARG = typer.Argument(
    help="A profile directory written by `teraio profile`. Default: the newest under ./profiles/.",
    show_default=False,
)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if abs(n) < 2**30 else f"{n / 2**30:,.2f} GiB"


def load_profile(path: Path | None) -> Any:
    """The profile at ``path`` or the newest under ./profiles/; exits 2 with a message if bad."""
    from profiles import ProfileFormatError, find_newest_profile, read_profile

    try:
        return read_profile(path if path is not None else find_newest_profile("profiles"))
    except ProfileFormatError as exc:
        fail(str(exc))


def hardware_from_options(profile: Any, gpu_mem: str | None, ssd_bw: str, ssd_read_bw: str | None,
                          ssd_write_bw: str | None, host_mem: str, host_bw: str,
                          problems: list[Any] | None = None) -> Any:
    """A ``planner.Hardware`` from the command-line strings; exits 2 naming a bad value.
    ``problems`` (the ranks' planning problems) resolve ``--gpu-mem 50%`` and ``min``; they
    are made from ``profile`` when not given."""
    from planner import Hardware
    from teraio.units import parse_bandwidth, parse_size

    def parse(option: str, fn: Any, text: str, **kw: Any) -> Any:
        try:
            return fn(text, **kw)
        except ValueError as exc:
            fail(f"{option}: {exc}")

    if gpu_mem is None:
        known = profile.meta.get("device_memory_bytes")
        if not known:
            fail("--gpu-mem is required: the profile does not record the device's memory (e.g. --gpu-mem 80G)")
        gpu_bytes = int(known)
    elif gpu_mem.strip().lower() == "min" or gpu_mem.strip().endswith("%"):
        gpu_bytes = _relative_budget(gpu_mem.strip().lower(), problems or _problems(profile))
    else:
        gpu_bytes = parse("--gpu-mem", parse_size, gpu_mem)
    ssd = parse("--ssd-bw", parse_bandwidth, ssd_bw)
    return Hardware(
        gpu_mem_bytes=gpu_bytes,
        ssd_read_bw_bytes_per_s=parse("--ssd-read-bw", parse_bandwidth, ssd_read_bw) if ssd_read_bw else ssd,
        ssd_write_bw_bytes_per_s=parse("--ssd-write-bw", parse_bandwidth, ssd_write_bw) if ssd_write_bw else ssd,
        host_bw_bytes_per_s=parse("--host-bw", parse_bandwidth, host_bw),
        host_mem_bytes=parse("--host-mem", parse_size, host_mem, allow_zero=True),
    )


def _problems(profile: Any) -> list[Any]:
    from planner import problem_from_profile

    return [problem_from_profile(profile, rank) for rank in profile.ranks]


def _relative_budget(text: str, problems: list[Any]) -> int:
    """``--gpu-mem min``: the smallest capacity any plan can meet on every rank; ``N%``: that
    share of the largest rank's profiled peak, the ops' scratch counted (`teraio inspect`'s
    ``peak_needed_bytes``)."""
    from planner.problem import resident_need_bytes

    if not any(p.num_ops for p in problems):
        fail(f"--gpu-mem {text}: the profile has no ops to take a budget from; give the budget in bytes")
    if text == "min":
        return max(int(resident_need_bytes(p).max()) for p in problems if p.num_ops)
    try:
        share = float(text.removesuffix("%")) / 100
    except ValueError:
        share = float("nan")
    if not 0 < share <= 10:
        fail(f"--gpu-mem: bad share {text!r}: give a percentage of the profiled peak, e.g. 50%")
    return int(share * max(int(p.memory_bytes.max()) for p in problems if p.num_ops))


def cpu_costs_from_options(profile: Any, copy_cost: str, op_overhead: str, refault_cost: str,
                           transfer_cost: str = "auto", transfer_latency: str = "auto",
                           ssd_duplex: str = "auto",
                           swap_dir: Path | None = None) -> tuple[dict[str, float], str | None]:
    """``Hardware``'s costs of the compute (NOTE [ Copies on the compute ] in ``planner.simulate``)
    and the SSD's duplex (NOTE [ Duplex ] there) from the command-line strings, and how they were
    had (None: given, or the default).

    ``auto`` measures a figure here (``runtime.calibrate``) for a profile taken on the CPU, where
    the cores that train also copy, and is 0 (a duplex 1) for any other profile, but for a CUDA
    profile's per-transfer figure (``_gpu_transfer_cost``). Exits 2 naming a bad value.
    """
    options = {  # Hardware field: (option, its text, seconds per unit of the option)
        "copy_cost_s_per_byte": ("--copy-cost", copy_cost, 1e-9),
        "op_overhead_s": ("--op-overhead", op_overhead, 1e-6),
        "refault_s_per_byte": ("--refault-cost", refault_cost, 1e-9),
        "transfer_cost_s": ("--transfer-cost", transfer_cost, 1e-6),
        "transfer_latency_s": ("--transfer-latency", transfer_latency, 1e-6),
        "ssd_duplex": ("--ssd-duplex", ssd_duplex, 1.0),
    }
    defaults = {field: 1.0 if field == "ssd_duplex" else 0.0 for field in options}
    costs: dict[str, float] = {}
    for field, (option, text, unit) in options.items():
        if text == "auto":
            continue
        try:
            value = float(text)
        except ValueError:
            fail(f"{option}: bad value {text!r}: give a number or auto")
        if field == "ssd_duplex" and not 0 < value <= 1:
            fail(f"{option}: bad value {text!r}: the share of each direction's bandwidth left while both "
                 "move, more than 0 and at most 1")
        elif not 0 <= value * unit <= 1.0:  # more than a second per byte, op or transfer is a typo
            fail(f"{option}: bad value {text!r}: must be a number from 0 to {1 / unit:.0e}")
        costs[field] = value * unit
    fake = profile.meta.get("mode") == "fake"  # a GPU it models, not this machine's: 0, as before
    if profile.meta.get("device_type") == "cuda" and not fake and "transfer_cost_s" not in costs:
        costs["transfer_cost_s"] = _gpu_transfer_cost()
    if profile.meta.get("device_type") != "cpu" or len(costs) == len(options):
        return {field: costs.get(field, defaults[field]) for field in options}, None
    from runtime.cpu_costs import cached_cpu_costs

    measured, how = cached_cpu_costs(swap_dir, measuring=lambda: info(
        "measuring what moving tensors costs the compute on this machine, once (the profile ran on the "
        "CPU; --copy-cost, --op-overhead, --refault-cost, --transfer-cost, --transfer-latency and "
        "--ssd-duplex give the figures instead)"))
    return {field: costs.get(field, getattr(measured, field)) for field in options}, how


# NOTE [ Small transfers on a GPU ]: a plan for a GPU counted no cost per transfer, and at a
# budget a little above another it moved 192 more tensors of 8-32 KiB, which take the link
# nothing: on an H200 (bench/rok_gpu.py's 2k example, BENCHMARKS.md, 2026-11-28) the plan at
# 6,188 MiB made 363 migrations to the plan at 5,236 MiB's 182, and ran 353 ms against 326, where
# it predicted 266 against 285. Each run's time beyond its prediction was 0.24 ms a migration,
# in both. So `--transfer-cost auto` for a CUDA profile measures the runtime's time per transfer
# on this machine's GPU (``runtime.calibrate``: the small model's steps, every idle stretch moved
# through the host backend, pinned, as bench/rok_gpu.py runs; the posix backend, which `teraio
# run` takes without kvikio, costs the CPU more per transfer, 304 against 133 us on this 2-core
# machine, and may on a GPU machine too), where CUDA is here; planned without a GPU, or where the
# measurement fails, it is 0, as before, and the info line says so. A fake profile (`teraio
# profile --fake`) models a GPU that is not this machine's: 0, and no line.


def _gpu_transfer_cost() -> float:
    """``--transfer-cost auto`` for a CUDA profile: seconds, measured on this machine's GPU (or
    read from the cache), 0 where there is none or the measurement fails; said either way."""
    why = "no GPU here to measure the runtime's work for each on"
    if _cuda_here():
        from runtime.cpu_costs import cached_cuda_transfer_cost

        try:
            cost, how = cached_cuda_transfer_cost(measuring=lambda: info(
                "measuring what each transfer costs the training on this machine's GPU, once "
                "(--transfer-cost gives the figure instead)"))
        except Exception as exc:  # noqa: BLE001 - a GPU another job fills, a driver error: planned without
            first = str(exc).splitlines()[0] if str(exc) else ""
            why = f"measuring it on this GPU failed ({type(exc).__name__}: {first})"
        else:
            info(f"--transfer-cost auto: {cost * 1e6:.0f} us per transfer, the runtime's own work for each on "
                 f"this GPU ({how}; NOTE [ Small transfers on a GPU ] in teraio/cmd_plan.py)")
            return cost
    info(f"--transfer-cost auto: 0 us per transfer: {why}, so moving many small tensors looks free to the "
         "plan; plan on the machine that trains, or give --transfer-cost (NOTE [ Small transfers on a GPU ] "
         "in teraio/cmd_plan.py)")
    return 0.0


def _cuda_here() -> bool:
    """Whether this machine has a CUDA device torch can use (torch imported only where a driver's
    device node is: NVIDIA's, WSL's, or ROCm's, which torch.cuda drives too)."""
    if not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _auto_ssd_bw(profile: Any, read: str | None, write: str | None) -> tuple[str, str | None, str | None]:
    """``--ssd-bw auto``: 16 GB/s for a profile not taken on the CPU; for one that was, the posix
    backend's measured rates beside training (``runtime.calibrate``), where ``--ssd-read-bw`` and
    ``--ssd-write-bw`` do not give them. Returns ``(ssd_bw, ssd_read_bw, ssd_write_bw)``."""
    if profile.meta.get("device_type") != "cpu" or (read and write):
        return "16", read, write
    from runtime.cpu_costs import cached_cpu_costs

    measured, how = cached_cpu_costs(measuring=lambda: info(
        "measuring what moving tensors costs the compute on this machine and the rate of `teraio run`'s "
        "posix backend, once (the profile ran on the CPU; --ssd-bw and the cost options give the figures "
        "instead)"))
    read = read or f"{measured.posix_read_bw_bytes_per_s / 1e9:.4g}"
    write = write or f"{measured.posix_write_bw_bytes_per_s / 1e9:.4g}"
    info(f"--ssd-bw auto: {write} GB/s out and {read} GB/s back, the posix backend beside training ({how})")
    return read, read, write


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _print_summary(s: dict[str, Any], profile_path: object, out: Path,
                   comparison: dict[str, dict[str, Any]], first: dict[str, Any] | None) -> None:
    fits = "fits" if s["fits"] else "DOES NOT FIT"
    print(f"profile     {profile_path}: {s['num_ops']:,} ops, {s['num_inactive_periods']:,} inactive periods"
          f" (rank {s['rank']})")
    print(f"memory      peak {_mib(s['peak_before_bytes'])} before, {_mib(s['peak_after_bytes'])} after, "
          f"capacity {_mib(s['gpu_mem_bytes'])} ({fits})"
          + (f"; ops' scratch counted, up to {_mib(s['max_scratch_bytes'])}" if s.get("max_scratch_bytes") else ""))
    if first is not None:
        print(f"iteration 0 {first['num_ops']:,} ops (set-up, optimizer state made): peak "
              f"{_mib(first['peak_before_bytes'])} before, {_mib(first['peak_after_bytes'])} after, "
              f"{first['predicted_iteration_us'] / 1e3:,.2f} ms predicted")
    print(f"time        {s['predicted_iteration_us'] / 1e3:,.2f} ms per iteration predicted, ideal "
          f"{s['ideal_iteration_us'] / 1e3:,.2f} ms ({s['slowdown']:.3f}x); stalls "
          f"{s['stall_us'] / 1e3:,.2f} ms before {s['num_stalled_ops']:,} ops")
    if "job_iteration_us" in s:
        print(f"job         {s['job_iteration_us'] / 1e3:,.2f} ms per iteration predicted for all ranks "
              f"together, ideal {s['job_ideal_iteration_us'] / 1e3:,.2f} ms ({s['job_slowdown']:.3f}x); "
              f"critical rank {s['critical_rank']}")
    if "bound_us" in s:
        print(f"bound       no plan is faster than {s['bound_us'] / 1e3:,.2f} ms (bytes out at the peak "
              f"moved once: {s['bound_peak_us'] / 1e3:,.2f} ms; per phase: {s['bound_phases_us'] / 1e3:,.2f} ms"
              + (f"; adjacent phases together: {s['bound_merged_us'] / 1e3:,.2f} ms" if "bound_merged_us" in s else "")
              + "); "
              f"predicted {s['bound_ratio']:.3f}x of it")
    if s.get("copy_charge_us") or s.get("op_overhead_us") or s.get("refault_us"):
        print(f"            of which copies and transfers on the compute {s['copy_charge_us'] / 1e3:,.2f} ms, "
              f"the runtime's per-op cost {s['op_overhead_us'] / 1e3:,.2f} ms, faulting memory in again "
              f"{s['refault_us'] / 1e3:,.2f} ms")
    reused = (f"; {s['num_reused']:,} offloads ({_mib(s['bytes_reused'])}) free their tensor against the copy "
              "its last prefetch kept, writing nothing" if s.get("num_reused") else "")
    print(f"moved       {_mib(s['bytes_to_ssd'])} to SSD, {_mib(s['bytes_to_host'])} to host per iteration; "
          f"{s['num_migrations']:,} migrations ({s['num_urgent']:,} urgent){reused}")
    u = s["bandwidth_utilisation"]
    print(f"bandwidth   SSD write {_pct(u['ssd_write'])}, SSD read {_pct(u['ssd_read'])}, "
          f"host write {_pct(u['host_write'])}, host read {_pct(u['host_read'])} of the iteration")
    for j, ph in enumerate(s.get("phases", [])):  # NOTE [ Where the time goes ] in planner/phases.py
        b = ph["busy"]
        windows = f"{ph['windows']:,} window{'s' if ph['windows'] > 1 else ''}"
        print(f"{'phases' if j == 0 else '':<12}{ph['phase']} ({windows}): {ph['predicted_us'] / 1e3:,.2f} ms "
              f"predicted, bound {ph['bound_us'] / 1e3:,.2f} ms, ops {ph['compute_us'] / 1e3:,.2f} ms; busy: SSD "
              f"write {_pct(b['ssd_write'])}, read {_pct(b['ssd_read'])}, host write {_pct(b['host_write'])}, "
              f"read {_pct(b['host_read'])}")
    life = s["ssd_life_years"]
    print(f"ssd wear    {_mib(s['ssd_bytes_per_iteration'])} written per iteration, "
          f"{s['ssd_bytes_per_day'] / 1e12:,.1f} TB per day at the predicted speed; a "
          f"{s['ssd_endurance_pbw']:g} PBW drive lasts "
          + ("for ever (nothing written)" if life is None else f"{life:,.1f} years"))
    if "bw_needed_gb_per_s" in s:
        need = [f"{float(k):.0%} of ideal at " + ("more than 4096 GB/s" if v is None else f"{v:,.1f} GB/s")
                for k, v in s["bw_needed_gb_per_s"].items()]
        print(f"needs       {', '.join(need)} of SSD bandwidth each way")
    if comparison:
        print("compared    policy                 iteration   vs ideal   peak          fits")
        for name, c in comparison.items():
            print(f"            {name:<22} {c['iteration_us'] / 1e3:>8,.2f} ms {c['slowdown']:>8.3f}x   "
                  f"{_mib(c['peak_bytes']):<13} {'yes' if c['fits'] else 'no'}")
    print(f"plan        written to {out}")


def plan_first(prof: Any, hw: Any) -> Any:
    """Iteration 0's plan (NOTE [ The first iteration's plan ] in ``planner.plan``), every rank's,
    or None when the profile did not record it. Held to ``hw``'s capacity, or to the least
    iteration 0 of every rank can fit in when that is more (said in a warning)."""
    from dataclasses import replace

    from planner import build_plan, plan_rank
    from planner.problem import first_problem, resident_need_bytes

    if prof.first is None:
        return None
    problems = {r: p for r in prof.first.ranks if (p := first_problem(prof, r)) is not None and p.num_ops}
    if not problems:
        return None
    need = {r: resident_need_bytes(p) for r, p in problems.items()}
    worst = max(need, key=lambda r: int(need[r].max()))
    k = int(need[worst].argmax())
    most = int(need[worst][k])
    if most > hw.gpu_mem_bytes:
        where = f"rank {worst}'s op {k}" if len(problems) > 1 else f"its op {k}"
        need_s, budget_s = _mib(most), _mib(hw.gpu_mem_bytes)
        if need_s == budget_s:  # bytes, where the two round alike
            need_s, budget_s = f"{most:,} bytes", f"{hw.gpu_mem_bytes:,}"
        warn(f"iteration 0 (the script's set-up, and the optimizer making its state) needs "
             f"{need_s} resident at {where} ({problems[worst].op_names[k]}), more than the budget's "
             f"{budget_s}: it is planned for {_mib(most)} and will go over the budget")
    hw0 = replace(hw, gpu_mem_bytes=max(hw.gpu_mem_bytes, most))
    rank_plans = {}
    for r, problem in problems.items():
        info(f"planning iteration 0{f' of rank {r}' if len(problems) > 1 else ''}: {problem.num_ops:,} ops, "
             f"{problem.num_periods:,} inactive periods")
        rank_plans[r] = plan_rank(problem, hw0, progress=lambda line: info(f"planning iteration 0: {line}"))
    carried = prof.first.meta.get("carried_into_next", {})
    return build_plan(rank_plans, hw0, prof.first.signature, carried_into_next={
        int(r): {int(steady): int(now) for steady, now in carried.get(str(r), {}).items()} for r in problems})


def job_keys(prof: Any, rank_plans: dict[int, Any]) -> dict[str, Any]:
    """The summary's keys for the job as a whole (``planner.make.job_summary``), or none, with a
    warning that says why, when the profile lacks ranks of its job or the ranks' sends, receives
    and collectives do not fit together (the ranks' own plans stand)."""
    from planner.errors import JobGraphError
    from planner.make import job_summary

    world = int(prof.meta.get("world_size") or len(prof.ranks))
    if len(prof.ranks) < world:
        warn(f"the profile holds ranks {prof.ranks} of a job of {world}: the job's iteration time "
             "needs every rank, so it is not predicted")
        return {}
    try:
        return job_summary(rank_plans)
    except JobGraphError as exc:
        warn(f"the job's iteration time is not predicted: {exc}")
        return {}


def compare_policies(profile: Any, problem: Any, hw: Any, rank_plan: Any, rank: int) -> dict[str, dict[str, Any]]:
    """Planner and baselines side by side, as plain data."""
    from planner.baselines import run_baselines

    rows = {"planner": rank_plan, **run_baselines(profile, problem, hw, rank)}
    return {
        name: {"iteration_us": rp.sim.iteration_us, "slowdown": rp.sim.slowdown,
               "peak_bytes": rp.sim.peak_bytes, "fits": rp.sim.fits, "stall_us": rp.sim.stall_us,
               "bytes_moved": int(sum(m.size_bytes for m in rp.moves))}
        for name, rp in rows.items()
    }


def _warn_early_on_demand(meta: dict[str, Any], first_kept: dict[int, int], peak: int, budget: int) -> None:
    """Iterations after iteration 0 that a rank's profile set aside for their ops (DDP rebuilds its
    buckets in its second step; a barrier, a branch or a checkpoint every other step) run on demand,
    up to about the profiled peak: said where that is over the budget, with --hold-on-demand, since
    on a device of about the budget such an iteration runs out of memory before `teraio run` can
    say anything. Before the first kept iteration or after it (a sweep's branch every other step and
    evaluation every third went 1.98-2.09x unsaid, for coming after). ``first_kept``: rank -> the
    first iteration its profile kept."""
    last = max(first_kept.values(), default=0)
    skipped = sorted({(int(k["iteration"]), str(k["reason"]), int(k["iteration"]) < first_kept.get(
        int(k.get("rank", -1)), last)) for k in meta.get("skipped_iterations") or []
        if int(k["iteration"]) > 0 and not k.get("sizes_only")})
    if not skipped or peak <= 1.05 * budget:
        return
    early = sorted({i for i, _, before in skipped if before})
    later = sorted({i for i, _, before in skipped if not before})
    ddp = early and int(meta.get("world_size") or 1) > 1
    why = "; as DDP's second step does, which rebuilds its buckets" if ddp else ""
    like = ("the run's steps like them will too (steps that differ every few, as with a barrier, a branch, an "
            "evaluation or a checkpoint every few steps)")
    again = (f"; so did iteration{'s' if len(later) > 1 else ''} {', '.join(map(str, later))} after the first kept "
             f"one, and {like}" if early and later else f", and {like}" if later else "")
    its = early or later
    warn(f"iteration{'s' if len(its) > 1 else ''} {', '.join(map(str, its))} differed from the profiled ones "
         f"({skipped[0][1]}{why}){again}: `teraio run` runs such iterations on demand, what each op uses "
         f"brought back, up to about the profiled peak, {peak / 2**20:,.1f} MiB ({peak / budget:.2f}x the "
         "budget); on a device that holds little more than the budget, run with --hold-on-demand, which sends "
         "tensors out in them to keep near it")


def plan(
    profile: Annotated[Path | None, PROFILE_ARG] = None,
    gpu_mem: Annotated[str | None, typer.Option(
        help=f"Device memory to fit in, e.g. 80G ({_SIZE_HELP}); or a share of the profiled peak (with "
             "what ops allocate inside themselves, as `teraio inspect` shows it), "
             "e.g. 50%; or min, the smallest capacity any plan can meet. Default: the profiled "
             "device's. It bounds the bytes of the tensors ops see and, from a GPU profile, what "
             "each op allocates inside itself while it runs: on a real GPU leave room for CUDA's "
             "context and libraries' workspaces (`teraio run` reports CUDA's own peak).",
        show_default=False)] = None,
    ssd_bw: Annotated[str, typer.Option(
        help="SSD bandwidth each way in GB/s (1e9 bytes/s). auto: 16 (a data-center NVMe drive) for a GPU "
             "profile; for a profile taken on the CPU, the rates `teraio run`'s posix backend reaches beside "
             "training on this machine, each way, measured with the CPU costs below (a disk's raw rate is "
             "more than that: 1.8-2.5 GB/s raw against 1.0-1.4 here).")] = "auto",
    ssd_read_bw: Annotated[str | None, typer.Option(
        help="SSD read (prefetch) bandwidth in GB/s, when it differs from --ssd-bw.", show_default=False)] = None,
    ssd_write_bw: Annotated[str | None, typer.Option(
        help="SSD write (offload) bandwidth in GB/s, when it differs from --ssd-bw.", show_default=False)] = None,
    host_mem: Annotated[str, typer.Option(
        help=f"Host memory the plan may use for offloaded tensors; 0 keeps all on the SSD. {_SIZE_HELP}")] = "0",
    host_bw: Annotated[str, typer.Option(help="Host link bandwidth each way in GB/s (1e9 bytes/s).")] = "25",
    out: Annotated[Path, typer.Option(help="Where to write the plan (JSON).")] = Path("plan.json"),
    trace: Annotated[Path | None, typer.Option(
        help="Also write the simulated iteration as a Chrome trace (open it in Perfetto).",
        show_default=False)] = None,
    compare: Annotated[bool, typer.Option(
        help="Simulate the baselines side by side: ideal (infinite memory), activation offload, ZeRO-Offload "
             "and ZeRO-Infinity, each as its users make it fit (planner/baselines.py).")] = True,
    ssd_endurance_pbw: Annotated[float | None, typer.Option(
        help="Endurance of the SSD in petabytes written (PBW), for its predicted life. Default: "
             "70, a mainstream data-centre drive (Solidigm D7-P5620 12.8 TB: 3 drive writes a "
             "day for 5 years).", show_default=False)] = None,
    bw_needed: Annotated[bool, typer.Option(
        help="Also find the SSD bandwidth that reaches 90% and 95% of ideal throughput (about "
             "16 more plans; see `teraio roofline` for the whole curve).")] = False,
    copy_cost: Annotated[str, typer.Option(
        help="Compute time each byte moved takes from the training, in nanoseconds per byte: on a CPU the "
             "cores that train also copy. auto: measured on this machine (10-20 s, then kept a week in "
             "~/.cache/teraio/cpu-costs.json, an hour if other processes kept the cores busy meanwhile; "
             "plan on the machine that trains, when it is quiet) for a profile taken on the "
             "CPU, 0 for any other (a GPU copies beside the compute).")] = "auto",
    op_overhead: Annotated[str, typer.Option(
        help="Time `teraio run` adds to every op, in microseconds (its dispatch mode). auto: measured "
             "on this machine for a profile taken on the CPU, 0 for any other.")] = "auto",
    refault_cost: Annotated[str, typer.Option(
        help="Time to fault memory in again, in nanoseconds per byte: on a CPU `teraio run` gives an "
             "iteration's freed memory back to the OS at its end, and the next faults it in again up to "
             "its peak. auto: measured on this machine for a profile taken on the CPU, 0 for any "
             "other.")] = "auto",
    transfer_cost: Annotated[str, typer.Option(
        help="Compute time `teraio run` spends on each transfer (out or back) beyond its bytes' copy "
             "cost, in microseconds: its own work for the transfer, which makes moving a small tensor "
             "cost far more than its bytes. auto: measured on this machine for a profile taken on the "
             "CPU or on CUDA (on this machine's GPU; 0 where there is none), 0 for a fake profile and any "
             "other.")] = "auto",
    transfer_latency: Annotated[str, typer.Option(
        help="Time each transfer to or from the SSD holds its channel before its bytes move, in "
             "microseconds (a worker picking it up, a swap file opened and closed): with the bandwidth, "
             "what a transfer of a small tensor takes. auto: measured on this machine for a profile "
             "taken on the CPU, 0 for any other.")] = "auto",
    ssd_duplex: Annotated[str, typer.Option(
        help="The share of each direction's bandwidth the SSD keeps while reads and writes move at once "
             "(1: they do not slow each other; 0.5: they share one rate). auto: measured on this machine "
             "for a profile taken on the CPU (the posix backend's writes and reads beside training), 1 "
             "for any other.")] = "auto",
    host_duplex: Annotated[float, typer.Option(
        help="The same for host memory's link, each way (a PCIe link carries both ways at once, a "
             "little slower: an H200's pinned link kept 0.86-0.91 of each).")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Plan which tensors go to SSD or host memory and when, and predict the cost.

    Prints peak memory before and after against the capacity, the predicted
    iteration time against the ideal (infinite memory) time, stalls, bytes
    moved and bandwidth use, and writes the plan (format teraio-plan/6, docs/formats.md).
    Exit codes: 0 done, 2 bad input (options, profile, a capacity no plan can
    meet).
    """
    from planner import InfeasibleBudgetError, build_plan, plan_rank, problem_from_profile, save_plan
    from planner.operate import DEFAULT_SSD_ENDURANCE_PBW, bandwidth_needed, ssd_wear
    from planner.plan import signatures_of
    from planner.problem import written_unseen

    if ssd_endurance_pbw is None:
        ssd_endurance_pbw = DEFAULT_SSD_ENDURANCE_PBW
    if not ssd_endurance_pbw > 0:
        fail(f"--ssd-endurance-pbw must be positive, not {ssd_endurance_pbw:g}")
    prof = load_profile(profile)
    problems = {rank: problem_from_profile(prof, rank) for rank in prof.ranks}
    for rank in prof.ranks:
        if unseen := written_unseen(prof, rank):  # NOTE [ Writes teraio cannot see ] in torch_patch/tracer.py
            info(f"{'rank ' + str(rank) + ': ' if len(prof.ranks) > 1 else ''}code teraio cannot see wrote "
                 f"{len(unseen)} named tensors ({', '.join(unseen[:4])}{', ...' if len(unseen) > 4 else ''}) "
                 "while it was profiled: this plan keeps every parameter, buffer, gradient and optimizer "
                 "state in memory and moves the rest")
    if ssd_bw.strip().lower() == "auto":
        ssd_bw, ssd_read_bw, ssd_write_bw = _auto_ssd_bw(prof, ssd_read_bw, ssd_write_bw)
    hw = hardware_from_options(prof, gpu_mem, ssd_bw, ssd_read_bw, ssd_write_bw, host_mem, host_bw,
                               list(problems.values()))
    if gpu_mem is not None and gpu_mem.strip().lower() == "min":
        info(f"--gpu-mem min: planning for {hw.gpu_mem_bytes:,} bytes ({_mib(hw.gpu_mem_bytes)}), the "
             "smallest capacity any plan of the steady iterations can meet")
    elif gpu_mem is not None and gpu_mem.strip().endswith("%"):
        info(f"--gpu-mem {gpu_mem.strip()}: planning for {hw.gpu_mem_bytes:,} bytes ({_mib(hw.gpu_mem_bytes)}) "
             "of the profiled peak")
    costs, how = cpu_costs_from_options(prof, copy_cost, op_overhead, refault_cost, transfer_cost,
                                        transfer_latency, ssd_duplex)
    if not 0 < host_duplex <= 1:
        fail(f"--host-duplex: bad value {host_duplex:g}: the share of each direction's bandwidth left while "
             "both move, more than 0 and at most 1")
    hw = replace(hw, **costs, host_duplex=host_duplex)
    if how is not None:
        info(f"copies cost the compute {hw.copy_cost_s_per_byte * 1e9:.3f} ns per byte moved, the runtime "
             f"{hw.op_overhead_s * 1e6:.1f} us per op and {hw.transfer_cost_s * 1e6:.0f} us per transfer "
             f"(which holds its channel {hw.transfer_latency_s * 1e6:.0f} us more; "
             f"while both directions move, each keeps {hw.ssd_duplex:.2f} of its rate), "
             f"faulting memory in again {hw.refault_s_per_byte * 1e9:.3f} ns per byte ({how}; NOTE [ Copies "
             "on the compute ] in planner/simulate.py)")
    rank_plans = {}
    comparison: dict[str, Any] = {}
    for rank, problem in problems.items():
        info(f"planning rank {rank}: {problem.num_ops:,} ops, {problem.num_periods:,} inactive periods")
        try:
            rank_plans[rank] = plan_rank(problem, hw, progress=lambda line: info(f"planning: {line}"))
        except InfeasibleBudgetError as exc:
            fail(f"rank {rank}: {exc}" if len(problems) > 1 else str(exc))
        if compare and rank == prof.ranks[0]:
            comparison = compare_policies(prof, problem, hw, rank_plans[rank], rank)
    first_plan = plan_first(prof, hw)
    job = job_keys(prof, rank_plans) if len(rank_plans) > 1 else None
    # the first iteration every rank's profile kept: past --warmup, and past those it set aside
    firsts = {r: int(prof.kernels_of(r)["iteration"].min()) for r in prof.ranks if len(prof.kernels_of(r))}
    made_for = {"profile": str(prof.path), "device_type": prof.meta.get("device_type"),
                "warmup": max(firsts.values()) if firsts else prof.meta.get("warmup")}
    doc = build_plan(rank_plans, hw, prof.signature, comparison=comparison,
                     extra_parameters=made_for, first=first_plan, job=job,
                     world_size=int(prof.meta.get("world_size") or len(prof.ranks)),
                     signatures=signatures_of(prof.meta),
                     kept_for_good={r: k for r in rank_plans if (k := prof.kept_for_good(r))})
    s = doc.summary
    s.update(ssd_wear(s["bytes_to_ssd"], s["predicted_iteration_us"], ssd_endurance_pbw))
    _warn_early_on_demand(prof.meta, firsts, s["peak_before_bytes"], hw.gpu_mem_bytes)
    if bw_needed:
        slowest = rank_plans[s["rank"]].problem
        s["bw_needed_gb_per_s"] = {}
        for fraction in (0.9, 0.95):
            info(f"finding the SSD bandwidth for {fraction:.0%} of ideal")
            s["bw_needed_gb_per_s"][f"{fraction:.2f}"] = bandwidth_needed(slowest, hw, fraction)
    try:
        save_plan(doc, out)
        if trace is not None:
            from planner.trace import chrome_trace

            first = rank_plans[prof.ranks[0]]
            trace.write_text(json.dumps(chrome_trace(first)) + "\n")
            info(f"trace written to {trace} (open it in https://ui.perfetto.dev)")
    except OSError as exc:
        fail(f"cannot write {exc.filename}: {exc.strerror}")
    if json_out:
        j = doc.to_json()
        print(json.dumps({"summary": j["summary"], "comparison": j["comparison"],
                          "first_iteration": j.get("first_iteration", {}).get("summary"),
                          "plan": str(out)}, indent=2))
    else:
        _print_summary(doc.summary, prof.path, out, comparison, None if first_plan is None else first_plan.summary)
