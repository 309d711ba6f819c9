"""`teraio profile`: run a training script for a few iterations and record a profile."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from teraio.console import EXIT_BAD_INPUT, fail, info

__all__ = ["profile"]


def _default_out(script: Path) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("profiles") / f"{script.stem}-{stamp}"


def profile(
    script: Annotated[Path, typer.Argument(help="The training script, run unmodified as __main__.")],
    script_args: Annotated[
        list[str] | None,
        typer.Argument(help="Arguments for the script; put them after `--`.", show_default=False),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Profile directory to write. Default: ./profiles/<script>-<timestamp>/."),
    ] = None,
    iters: Annotated[int, typer.Option(min=1, help="Iterations to record.")] = 2,
    warmup: Annotated[
        int, typer.Option(min=1, help="Iterations to run first and not record (iteration 0 "
                                      "creates optimizer state).")
    ] = 1,
    force: Annotated[bool, typer.Option(help="Overwrite an existing output directory.")] = False,
) -> None:
    """Profile SCRIPT: record every op's timing and every tensor's size and accesses.

    An iteration ends when every optimizer has stepped (or at
    `teraio.mark_iteration()`). After WARMUP + ITERS iterations the script is
    stopped and the profile (kernels, tensors, accesses as Parquet, plus
    meta.json) is written. Exit codes: 0 done, 2 bad input, the script's own
    code if it fails.
    """
    if not script.is_file():
        fail(f"no such script: {script}")
    out_dir = out if out is not None else _default_out(script)
    if out_dir.exists() and not force:
        fail(f"{out_dir} already exists; pass --force to overwrite it")

    from profiles import write_profile
    from torch_patch import ProfileComplete, ScriptFailed, Tracer, run_script

    def progress(s: dict[str, Any]) -> None:
        what = "recorded" if s["recorded"] else "warm-up"
        took = f", {s['time_us'] / 1e3:.1f} ms" if s["time_us"] is not None else ""
        info(f"iteration {s['iteration']} ({what}): {s['num_ops']} ops{took}")

    tracer = Tracer(warmup=warmup, iters=iters, on_iteration=progress)
    args = list(script_args or [])
    completed = False
    try:
        with tracer:
            run_script(script, args)
    except ProfileComplete:
        completed = True
    except ScriptFailed as exc:
        fail(f"{script} failed (exit status {exc.exit_code}); no profile written", exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted; no profile written", 130)
    if not completed:
        seen = tracer.iteration
        if seen == 0:
            fail(f"no iteration boundary seen: {script} ended without stepping a torch.optim "
                 "optimizer; call teraio.mark_iteration() at the end of each training step",
                 EXIT_BAD_INPUT)
        fail(f"{script} ended after {seen} iterations; profiling needs warmup + iters = "
             f"{warmup + iters} (run it for more steps, or lower --warmup/--iters)", EXIT_BAD_INPUT)

    prof = tracer.profile({"script": str(script), "script_args": args,
                           "warmup": warmup, "cost_model": None})
    if not prof.meta["iterations_identical"]:
        info("warning: the recorded iterations differ in ops or tensors; "
             "plans follow the first one")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    path = write_profile(prof, out_dir, force=True)
    info(f"profile of {len(prof.kernels_of())} ops/iteration, {len(prof.tensors)} tensors "
         f"written to {path}")
    print(path)
