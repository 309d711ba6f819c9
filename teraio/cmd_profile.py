"""`teraio profile`: run a training script for a few iterations and record a profile."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.console import EXIT_BAD_INPUT, fail, info
from teraio.job import gather, job_place, launch, part_path, without_nproc

__all__ = ["profile"]

_FEWER_OPS = 0.9  # a set-aside iteration with fewer of the kept ones' ops than this may be a training step


def _default_out(script: Path) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # the same on every rank of a torchrun job
    stamp = f"job-{run_id[:8]}" if run_id else dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("profiles") / f"{script.stem}-{stamp}"


def profile(
    script: Annotated[Path | None, typer.Argument(
        help="The training script, run unmodified as __main__. Not with --model.",
        show_default=False)] = None,
    script_args: Annotated[
        list[str] | None,
        typer.Argument(help="Arguments for the script; put them after `--`.", show_default=False),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Profile directory to write. Default: ./profiles/<script or model>-<timestamp>/."),
    ] = None,
    iters: Annotated[int | None, typer.Option(
        min=1, help="Iterations to record. Default: 2, or 1 with --fake (fake iterations are "
                    "identical).", show_default=False)] = None,
    warmup: Annotated[
        int, typer.Option(min=1, help="Iterations to run first and not record (iteration 0 "
                                      "creates optimizer state). Raise it past steps unlike the "
                                      "rest (a layer unfrozen at step 3): `teraio run` runs those "
                                      "on demand and follows the plan from there.")
    ] = 1,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output directory.")] = False,
    fake: Annotated[bool, typer.Option(
        "--fake", help="Run under FakeTensorMode: no tensor memory is allocated and each op is "
                       "timed by a roofline model of --gpu (FLOPs over peak FLOP/s, bytes over "
                       "memory bandwidth).")] = False,
    gpu: Annotated[str | None, typer.Option(
        help="With --fake: the device to model: a100 (A100-SXM4-80GB), h100 (H100-SXM5-80GB) "
             "or h200 (H200-SXM-141GB).",
        show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        help="With --fake: profile a built-in model instead of a script: llama3-8b, llama3-70b, "
             "granite-8b-code-base or t5-11b.", show_default=False)] = None,
    batch: Annotated[int | None, typer.Option(
        min=1, help="With --model: global batch, sequences per iteration (optimizer step). "
                    "Default: the micro-batch.", show_default=False)] = None,
    micro_batch: Annotated[int | None, typer.Option(
        min=1, help="With --model: sequences per forward/backward pass; --batch / --micro-batch "
                    "passes accumulate gradients. Default: 1.", show_default=False)] = None,
    seq: Annotated[int | None, typer.Option(
        min=1, help="With --model: tokens per sequence. Default: 4096.", show_default=False)] = None,
    precision: Annotated[str | None, typer.Option(
        help="With --model: fp32, tf32 (fp32 tensors, TF32 matmuls) or bf16 (pure bf16: "
             "parameters, gradients, optimizer state). Default: fp32.", show_default=False)] = None,
    optimizer: Annotated[str | None, typer.Option(
        help="With --model: adamw (one parameter per op), adamw-foreach (each op over all "
             "parameters), adamw-in-backward (each parameter stepped and its gradient freed "
             "during backward; no gradient accumulation) or sgd (momentum 0.9). Default: adamw.",
        show_default=False)] = None,
    pipeline: Annotated[int | None, typer.Option(
        min=1, help="With --fake --model: profile a job of this many ranks (GPUs) training the "
                    "model as a pipeline (torch.distributed.pipelining) through a fake process "
                    "group: the blocks split evenly between the stages, the embeddings on the "
                    "first, the final norm, output projection and loss on the last; --batch / "
                    "--micro-batch micro-batches per iteration, at least as many as the stages. "
                    "Decoders without tied embeddings. Default: no job (one process).",
        show_default=False)] = None,
    schedule: Annotated[str | None, typer.Option(
        help="With --pipeline N: 1f1b (N stages, stage r on rank r), interleaved-1f1b (2N "
             "stages, r and r + N on rank r) or zbv (ZB-V, 2N stages: r and 2N - 1 - r). "
             "Default: 1f1b.",
        show_default=False)] = None,
    fsdp: Annotated[int | None, typer.Option(
        min=1, help="With --fake --model: profile a job of this many ranks (GPUs) training the "
                    "model with FSDP2 (fully_shard on every block, then the whole model) through "
                    "a fake process group; each rank trains on --batch / N sequences in "
                    "micro-batches (--batch a multiple of N x --micro-batch). Default: no job.",
        show_default=False)] = None,
    ddp: Annotated[int | None, typer.Option(
        min=1, help="Refused in fake mode, with the reason: DDP's reducer reads tensor data, "
                    "which fake tensors do not have. Profile a real DDP job (--nproc N) or use "
                    "--fsdp N.", show_default=False)] = None,
    rank: Annotated[int | None, typer.Option(
        min=0, help="With --pipeline or --fsdp: profile this rank only (0 to N - 1). Default: "
                    "every rank, one after another, each in a process of its own, into one "
                    "profile of the job.", show_default=False)] = None,
    nproc: Annotated[int | None, typer.Option(
        min=1, help="Profile a job of this many processes on this node, started by PyTorch's "
                    "launcher (torch.distributed.run, as torchrun --nproc-per-node does): every "
                    "rank is traced, and one profile holds them all. Inside a torchrun job "
                    "(`torchrun ... -m teraio profile ...`) teraio reads the rank from the "
                    "environment instead.", show_default=False)] = None,
    rank_wait: Annotated[float, typer.Option(
        min=1, help="In a job of several processes: how long, in seconds, a rank waits at the end "
                    "of an iteration for the others (or 10 times its longest iteration, if longer) "
                    "before it stops the job with an error. Ranks that do not step together (one "
                    "that ran out of data under DDP's join()) never meet there.")] = 120.0,
) -> None:
    """Profile SCRIPT (or, with --fake, a built-in --model): every op's timing, every tensor's
    size and accesses.

    An iteration ends when every optimizer has stepped (or at
    `teraio.mark_iteration()`). Once ITERS iterations after WARMUP are alike
    the script is stopped and the profile (kernels, tensors, accesses as
    Parquet, plus meta.json) is written. An iteration that differs (an
    evaluation, a smaller last batch) is set aside; of iterations that differ
    in their sizes alone, those of the most bytes are kept.

    With --fake nothing is computed: ops run on fake tensors and take the time
    the roofline model of --gpu gives. A script then must build its model and
    data through PyTorch and not branch on tensor values (`.item()` returns a
    placeholder 1). Example: `teraio profile --fake --gpu h100 --model
    llama3-8b --batch 32 --micro-batch 1 --seq 4096`.

    A job of several processes (`--nproc N`, or torchrun around `-m teraio
    profile`) writes one profile with every rank's tables; the ranks stop
    together. Multi-node: run torchrun on every node with --out on a file
    system they all see.

    A job of a built-in model needs no GPUs at all: `--fake --model llama3-70b
    --pipeline 2 --schedule 1f1b --batch 16` profiles both ranks of a 2-stage
    pipeline, one after the other, each in a process that plays its rank through
    a fake process group (`--rank R` profiles one).

    Exit codes: 0 done, 2 bad input, the script's own code if it fails (a
    failed rank's, for a job).
    """
    model_opts = {"--batch": batch, "--micro-batch": micro_batch, "--seq": seq,
                  "--precision": precision, "--optimizer": optimizer}
    if model is not None and script is not None:
        fail("give a SCRIPT or --model, not both")
    if model is None and script is None:
        fail(f"give a training SCRIPT, or --fake --model NAME (one of {', '.join(_model_names())})")
    if not fake:
        for name, value in (("--gpu", gpu), ("--model", model)):
            if value is not None:
                fail(f"{name} needs --fake (a real profile times the device it runs on)")
    given = [k for k, v in model_opts.items() if v is not None]
    if model is None and given:
        fail(f"{', '.join(given)} apply to --model only")
    job_opts = {"--pipeline": pipeline, "--schedule": schedule, "--fsdp": fsdp, "--ddp": ddp, "--rank": rank}
    given_job = [k for k, v in job_opts.items() if v is not None]
    if given_job and (model is None or not fake):
        fail(f"{', '.join(given_job)} apply to --fake --model (a job of a script of your own: "
             "teraio profile --nproc N, or torchrun)")
    if ddp is not None:
        fail("--ddp: DDP cannot run in fake mode: its C++ reducer reads tensor data (its "
             "parameter checks and bucket rebuilds), which fake tensors do not have. Profile a "
             "real DDP job (teraio profile --nproc N SCRIPT), or FSDP2 (--fsdp N) in fake mode")
    if script is not None and not script.is_file():
        fail(f"no such script: {script}")
    cost_model = None
    if fake:
        cost_model = _cost_model(gpu, precision)
    train_cfg = _train_config(model, batch, micro_batch, seq, precision, optimizer) if model else None
    job = _job_config(train_cfg, pipeline, schedule, fsdp, rank) if train_cfg is not None else None
    stem = script if script is not None else Path(str(model))
    out_dir = out if out is not None else _default_out(stem)
    job_rank, world_size = job_place()
    if out_dir.exists() and not force and job_rank == 0:
        fail(f"{out_dir} already exists; pass --force to overwrite it")
    if iters is None:
        iters = 1 if fake else 2
    if nproc is not None:
        if fake:
            fail("--nproc starts real processes; a fake job of a built-in model: --pipeline N or "
                 "--fsdp N (see --help)")
        if world_size > 1:
            fail("--nproc inside a torchrun job: give torchrun --nproc-per-node instead")
        argv = without_nproc(sys.argv[1:])
        cut = argv.index("--") if "--" in argv else len(argv)
        launch(nproc, [*argv[:cut], "--out", str(out_dir.resolve()), "--force", *argv[cut:]])
        return  # rank 0 printed where the profile is

    if job is not None and rank is None:
        _profile_every_rank(job.world_size, out_dir)
        return

    from teraio.console import teraio_warnings
    from torch_patch import ProfileComplete, ScriptFailed, Tracer, run_script
    from torch_patch.tracer import IrregularIterations

    def progress(s: dict[str, Any]) -> None:
        # which recorded iterations the profile keeps is known only at its end (_write says)
        what = ("warm-up" if s["iteration"] < warmup else "recorded" if s["time_us"] is not None
                else "not recorded: this rank has its iterations, and the others end theirs")
        took = ""
        if s["time_us"] is not None:
            took = f", {s['time_us'] / 1e3:.1f} ms" + (" predicted" if fake else "")
        why = f"; it {s['skipped']}" if s["skipped"] else ""
        whose = f"rank {rank} of {job.world_size}: " if job is not None else ""
        info(f"{whose}iteration {s['iteration']} ({what}): {s['num_ops']} ops{took}{why}")

    if cost_model is not None:
        from torch_patch.fake import FakeTracer

        tracer: Tracer = FakeTracer(cost_model, warmup=warmup, iters=iters, on_iteration=progress)
        info(f"fake mode: timing ops as on {cost_model.device.name}")
    else:
        tracer = Tracer(warmup=warmup, iters=iters, on_iteration=progress)
    tracer.rank_wait_s = rank_wait
    args = list(script_args or [])
    completed = False
    try:
        with teraio_warnings(), tracer:
            if train_cfg is not None:
                from torch_patch.builtin_train import train

                train(train_cfg, steps=warmup + iters + 1, job=job)
            else:
                assert script is not None
                run_script(script, args, passthrough=(IrregularIterations,))
    except ProfileComplete:
        completed = True
    except IrregularIterations as exc:
        fail(f"{exc}; no profile written", EXIT_BAD_INPUT)
    except ScriptFailed as exc:
        _stop_children()
        hint = " (in fake mode: see `teraio profile --help` for what a script needs)" if fake else ""
        fail(f"{script} failed (exit status {exc.exit_code}){hint}; no profile written", exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted; no profile written", 130)
    if completed:
        _stop_children()
    if not completed and tracer.settle():  # NOTE [ The larger shape ] in torch_patch.tracer
        completed = True
    if not completed:
        seen = tracer.iteration
        irregular = tracer.irregular_message()
        if irregular is not None:
            fail(f"{script} ended after {seen} iterations and {irregular}; no profile written",
                 EXIT_BAD_INPUT)
        idle, any_stepped = tracer.never_stepped()
        if seen == 0 and any_stepped and idle:
            fail(f"no iteration boundary seen: an iteration ends when every torch.optim optimizer "
                 f"the script built has stepped, and {len(idle)} never did ({', '.join(idle)}); call "
                 "teraio.mark_iteration() at the end of each training step, or build that optimizer "
                 "where it starts stepping", EXIT_BAD_INPUT)
        if seen == 0 and not idle and not any_stepped:  # no optimizer built here at all
            fail(f"no iteration boundary seen: {script} built no torch.optim optimizer in this process. "
                 "If it trains in processes it starts itself (torch.multiprocessing.spawn, "
                 "multiprocessing), teraio does not see them: start one process per rank with torchrun "
                 "instead (`teraio profile --nproc N SCRIPT`, or `torchrun ... -m teraio profile SCRIPT`). "
                 "If it steps by hand, call teraio.mark_iteration() at the end of each training step",
                 EXIT_BAD_INPUT)
        if seen == 0:
            fail(f"no iteration boundary seen: {script} ended without stepping a torch.optim "
                 "optimizer; call teraio.mark_iteration() at the end of each training step",
                 EXIT_BAD_INPUT)
        fail(f"{script} ended after {seen} iterations; profiling needs warmup + iters = "
             f"{warmup + iters} (run it for more steps, or lower --warmup/--iters)", EXIT_BAD_INPUT)

    meta: dict[str, Any] = {"script": str(script) if script is not None else None,
                            "script_args": args, "warmup": warmup}
    if cost_model is None:
        meta["cost_model"] = None  # the fake tracer records its own
    if train_cfg is not None:
        meta["builtin_model"] = {**dataclasses.asdict(train_cfg),
                                 "num_micro_batches": train_cfg.num_micro_batches}
        if job is not None:
            from torch_patch.models import CONFIGS

            meta["builtin_model"]["job"] = job.describe(CONFIGS[train_cfg.model])
            meta["builtin_model"]["num_micro_batches"] = job.micro_batches_per_rank(train_cfg)
    prof = tracer.profile(meta)
    num_ops = len(prof.kernels_of(prof.ranks[0]))  # this process's rank: a kept iteration's ops
    # where the kept iterations may be the evaluations, how to keep training steps: start recording at
    # the first one set aside (an evaluation every other step fills its group first, whatever --iters),
    # or where that is where recording starts already, record more
    # (an evaluation adds many ops: a transformers Trainer's step 855 against 1,315 with one; a step
    # a few ops shorter is something else, as L-BFGS's first steps, 710 against 720, or DDP's with
    # static_graph=True, 168 against 169, both told to record more, which kept the same)
    fewer = [s["iteration"] for s in prof.meta["skipped_iterations"]
             if s.get("num_ops", num_ops) < _FEWER_OPS * num_ops]
    keep_steps = (f"start recording at iteration {min(fewer)} (--warmup {min(fewer)})" if fewer and min(fewer) > warmup
                  else f"record more (--iters {iters + 1})")
    for skipped in prof.meta["skipped_iterations"]:
        if skipped["sizes_only"]:  # NOTE [ Other sizes ] in runtime/executor.py
            cause = ("its tensor sizes differ: a smaller last batch, or dynamic padding? pad to one shape for "
                     "every step to be planned")
            then = ("`teraio run` follows the plan in iterations like it, leaving tensors of other sizes in "
                    "memory, or runs them on demand where most of the plan's moves find other sizes")
        elif skipped.get("sizes_first"):  # a batch of another length, whose ops then differ too
            cause = ("its tensor sizes differ, and then its ops: batches of another length, as packed "
                     "sequences of two lengths, or an evaluation on batches of another size? pad to one shape "
                     "for every step to be planned")
            then = "`teraio run` runs iterations like it on demand"
        elif skipped["iteration"] in fewer:  # the kept ones may be the rarer kind
            cause = ("an evaluation or checkpoint between steps, or a branch some steps take? It runs fewer ops "
                     f"than the kept iterations, {skipped['num_ops']:,} against {num_ops:,}: if those hold an "
                     "evaluation or a checkpoint that comes every few steps, keep training steps instead: "
                     f"{keep_steps}")
            then = "`teraio run` runs iterations like it on demand"
        else:
            cause = "an evaluation or checkpoint between steps, or a branch some steps take?"
            then = "`teraio run` runs iterations like it on demand"
        info(f"iteration {skipped['iteration']} is not in the profile: {skipped['reason']} ({cause}); {then}")
    not_resizable = int((~prof.tensors["resizable"]).sum())
    if not_resizable:
        info(f"{not_resizable} storages cannot be freed in place (numpy, shared memory, DLPack or "
             "torch.load(mmap=True) memory, memory handed out through DLPack, a DDP communication "
             "hook's, FSDP2's unsharded parameters, which it resizes itself, what data loading reads, or "
             "written where teraio cannot see): they stay in "
             "memory; `teraio inspect` lists them")
    if tracer.num_unseen_unnamed:  # NOTE [ Writes teraio cannot see ] in torch_patch/tracer.py
        info(f"{tracer.num_unseen_unnamed} tensors that no model or optimizer names (a batch "
             "buffer filled again each step, say) changed between steps with no op that teraio saw "
             "writing them (an op on another thread, or an extension's kernel): they stay in memory, "
             "as freeing one while that code writes it would crash the process")
    unseen = sorted(tracer.written_unseen)
    if unseen:  # NOTE [ Writes teraio cannot see ] in torch_patch/tracer.py
        info(f"{len(unseen)} named tensors ({', '.join(unseen[:4])}{', ...' if len(unseen) > 4 else ''}) "
             "changed between steps with no op that teraio saw writing them: code below PyTorch's "
             "dispatcher writes them (an extension's kernel called directly, as apex's or DeepSpeed's "
             "fused Adam and bitsandbytes' 8-bit optimizers are, a CUDA graph replayed, or an op on "
             "another thread), and may read others teraio cannot see; plans keep every parameter, "
             "buffer, gradient and optimizer state in memory and move the rest")
    if world_size > 1:
        prof = _job_profile(prof, out_dir, job_rank, world_size)
    if prof is not None:
        _write(prof, out_dir)
    _leave_threads()


def _stop_children() -> None:
    """The processes the script started, stopped: the profile stopped the script mid-loop (or it
    failed), so none of them is read to its end, and Python waited at exit, for ever, for a
    non-daemon producer blocked on a full queue."""
    import multiprocessing

    children = multiprocessing.active_children()
    if children:
        info(f"stopping {len(children)} process{'es' if len(children) > 1 else ''} the script started "
             f"({', '.join(c.name for c in children[:3])}): the script was stopped mid-loop")
        for child in children:
            child.terminate()
        for child in children:
            child.join(10)


def _leave_threads(wait_s: float = 10.0) -> None:
    """Exit now if threads the script started still run (non-daemon ones given ``wait_s`` to end:
    a checkpoint being written): the profile stopped the script mid-loop, so its code that stops
    them never ran. Python waited at exit, for ever, for a non-daemon logger thread, and a daemon
    one running ops as the interpreter shut down aborted it (exit 134, "terminate called without
    an active exception") after the profile was written."""
    import threading
    import time

    alive = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
             and not t.name.startswith("teraio-") and not isinstance(t, threading._DummyThread)]
    until = time.monotonic() + wait_s
    for t in alive:
        if not t.daemon:
            t.join(max(0.0, until - time.monotonic()))
    alive = [t for t in alive if t.is_alive()]
    if not alive:
        return
    info(f"leaving {len(alive)} thread{'s' if len(alive) > 1 else ''} the script started "
         f"({', '.join(t.name for t in alive[:3])}) as they are: the script was stopped mid-loop")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write(prof: Any, out_dir: Path) -> None:
    """Write ``prof`` to ``out_dir`` (replacing it), say what it holds and print its path."""
    from profiles import write_profile

    if out_dir.exists():
        shutil.rmtree(out_dir)
    path = write_profile(prof, out_dir, force=True)
    # a job's ranks each keep their own iterations, and its meta.json holds rank 0's
    kept = [str(i) for i in prof.meta.get("iterations") or []] if len(prof.ranks) == 1 else []
    listed = ", ".join(kept[:-1]) + " and " + kept[-1] if len(kept) > 1 else "".join(kept)
    of = f", from iteration{'s' if len(kept) > 1 else ''} {listed}" if kept else ""
    for r in prof.ranks:
        whose = f" of rank {r}" if len(prof.ranks) > 1 else ""
        info(f"profile{whose}: {len(prof.kernels_of(r))} ops/iteration, {len(prof.tensors_of(r))} tensors{of}")
    info(f"written to {path}")
    print(path)


def _profile_every_rank(world_size: int, out_dir: Path) -> None:
    """Profile every rank of a fake job, one after another, each in a process of its own (a
    process makes one process group), and write one profile of the job."""
    from profiles import merge_ranks, read_profile

    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    parts = part_path(out_dir, 0).parent
    try:
        for r in range(world_size):
            info(f"rank {r} of {world_size}: profiling it in a process of its own")
            cmd = [sys.executable, "-m", "teraio", *argv[:cut], "--rank", str(r),
                   "--out", str(part_path(out_dir, r).resolve()), "--force"]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
            if done.returncode != 0:
                fail(f"rank {r} of {world_size} failed (exit status {done.returncode}; its error is "
                     "above); no profile written", done.returncode if done.returncode > 0 else 1)
        prof = merge_ranks(gather(out_dir, world_size, read_profile))
    except KeyboardInterrupt:
        fail("interrupted; no profile written", 130)
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    _write(prof, out_dir)


def _job_profile(prof: Any, out_dir: Path, rank: int, world_size: int) -> Any:
    """This rank's part of a job's profile written beside ``out_dir``; on rank 0, every
    rank's parts merged into one profile (None on the others)."""
    from profiles import merge_ranks, read_profile, write_profile

    write_profile(prof, part_path(out_dir, rank), force=True)
    if rank != 0:
        info("its part of the profile is written; rank 0 writes the job's")
        return None
    return merge_ranks(gather(out_dir, world_size, read_profile))


def _device_names() -> list[str]:
    from torch_patch.devices import DEVICES

    return list(DEVICES)


def _model_names() -> list[str]:
    from torch_patch.models import CONFIGS

    return list(CONFIGS)


def _cost_model(gpu: str | None, precision: str | None) -> Any:
    from torch_patch.builtin_train import PRECISIONS
    from torch_patch.costmodel import RooflineCostModel
    from torch_patch.devices import get_device

    if gpu is None:
        fail(f"--fake needs --gpu NAME, one of {', '.join(_device_names())}")
    try:
        device = get_device(gpu)
    except ValueError as exc:
        fail(f"--gpu: {exc}")
    tf32 = PRECISIONS[precision][1] if precision in PRECISIONS else False
    return RooflineCostModel(device, tf32=tf32)


def _job_config(train_cfg: Any, pipeline: int | None, schedule: str | None, fsdp: int | None,
                rank: int | None) -> Any:
    """The fake job of ``--pipeline``/``--fsdp`` (rank ``rank``, or 0 to check it), or None."""
    from torch_patch.builtin_train import SCHEDULES, JobConfig
    from torch_patch.models import CONFIGS

    if pipeline is not None and fsdp is not None:
        fail("give --pipeline N or --fsdp N, not both")
    if schedule is not None and pipeline is None:
        fail("--schedule applies to --pipeline N only (a pipeline's stages)")
    if schedule is not None and schedule not in SCHEDULES:
        fail(f"--schedule: unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if pipeline is None and fsdp is None:
        if rank is not None:
            fail("--rank needs a job: --pipeline N or --fsdp N")
        return None
    size = pipeline if pipeline is not None else fsdp
    assert size is not None
    try:
        job = JobConfig(parallelism="pipeline" if pipeline is not None else "fsdp", world_size=size,
                        rank=rank or 0, schedule=schedule or "1f1b")
        job.check(train_cfg, CONFIGS[train_cfg.model])
    except ValueError as exc:
        fail(f"{'--pipeline' if pipeline is not None else '--fsdp'}: {exc}")
    return job


def _train_config(model: str, batch: int | None, micro_batch: int | None, seq: int | None,
                  precision: str | None, optimizer: str | None) -> Any:
    from torch_patch.builtin_train import TrainConfig

    micro = micro_batch or 1
    try:
        return TrainConfig(model=model, batch=batch or micro, micro_batch=micro, seq=seq or 4096,
                           precision=precision or "fp32", optimizer=optimizer or "adamw")
    except ValueError as exc:
        fail(str(exc))
