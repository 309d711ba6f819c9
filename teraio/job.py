"""Jobs of several processes: launching them through PyTorch's launcher, and the files their
ranks write side by side.

A job is started by ``torch.distributed.run`` (torchrun): ``teraio profile|run --nproc N``
calls it for this node with ``python -m teraio ...`` as every worker's command, as
``torchrun --nproc-per-node N -m teraio ...`` does; a multi-node job runs torchrun on each
node. A worker reads its rank and the job's size from torchrun's environment. Each rank
writes its own part of a profile or a run report next to the output; rank 0 waits for all
parts and writes the job's one file (for a multi-node job the output must be on a file
system every node sees).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from teraio.console import EXIT_FAILED, fail, info

__all__ = ["gather", "job_place", "launch", "part_path", "without_nproc"]

T = TypeVar("T")
GATHER_TIMEOUT_S = 600.0


def job_place() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside a job."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N``: the workers' own command line."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == "--":
            return out + argv[i:]
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _exit_of(failure: Any) -> str:
    code = int(failure.exitcode)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def launch(nproc: int, argv: list[str], after: Callable[[], None] | None = None) -> None:
    """Run ``python -m teraio ARGV`` as ``nproc`` workers of one job on this node (torchrun's
    standalone rendezvous, no restarts). A failed rank ends the job (torchrun stops the
    others); this fails naming it. Returns when every worker is done; ``after`` runs
    then, failed or not, before the error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                       "--module", "teraio", *argv])
    # torchrun handles these four (passing each on to every rank) even where this process ignores
    # one, as under nohup, whose closed terminal then stopped the job: it handles those not ignored
    # (ignored here, they are in the ranks too, which then run on as a single process does)
    if hasattr(args, "signals_to_handle"):  # torch 2.6 and later
        args.signals_to_handle = ",".join(
            name for name in args.signals_to_handle.split(",")
            if (sig := getattr(signal, name.strip(), None)) is not None and signal.getsignal(sig) != signal.SIG_IGN)
    info(f"starting {nproc} workers with torch.distributed.run (ranks 0-{nproc - 1})")
    try:
        run(args)
    except SignalException as exc:  # Ctrl-C, SIGTERM, SIGHUP or SIGQUIT to this process
        # torchrun passed it on to every rank and waited for them: each cleaned up as a single
        # process does (runtime.api) and said so above
        if after is not None:
            after()
        name = signal.Signals(exc.sigval).name
        fail(f"the job was stopped by {name}, which every rank was sent too",
             128 + int(exc.sigval))
    except ChildFailedError as exc:
        if after is not None:
            after()
        rank, first = exc.get_first_failure()
        others = sorted(r for r in exc.failures if r != rank)
        also = (f"; then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} ended"
                if others else "")
        code = int(first.exitcode)
        fail(f"rank {rank} failed ({_exit_of(first)}){also}: the job was stopped (rank {rank}'s own "
             "error is above)", code if code > 0 else EXIT_FAILED)
    if after is not None:
        after()


def part_path(out: Path, rank: int) -> Path:
    """Where rank ``rank`` of a job writes its part of ``out``: a directory of this job's own
    (torchrun's run id, the same on every node), so that the parts a killed job left are not
    taken for this one's. That holds where run ids differ from job to job: `--nproc N` and
    `torchrun --standalone` make a new one each time; a multi-node job needs its own
    ``--rdzv-id``. A killed job's directory stays (``.NAME.ranks-ID``), for the user to remove."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    run = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) or "none"
    return out.parent / f".{out.name}.ranks-{run}" / f"rank-{rank}{out.suffix}"


def gather(out: Path, world_size: int, read: Callable[[Path], T],
           timeout_s: float = GATHER_TIMEOUT_S) -> list[T]:
    """Every rank's part of ``out`` (waiting for them, rank 0 only), read with ``read``; the
    parts are removed. Fails naming the ranks whose part did not come in ``timeout_s``."""
    paths = [part_path(out, r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not p.exists()]
            fail(f"ranks {missing} wrote no part of {out} in {timeout_s:.0f} s; is {out.parent} on a "
                 "file system every node sees?", EXIT_FAILED)
        time.sleep(0.05)
    parts = [read(p) for p in paths]
    shutil.rmtree(paths[0].parent, ignore_errors=True)
    return parts


def write_json_part(out: Path, rank: int, doc: dict[str, Any]) -> None:
    """Rank ``rank``'s part of the JSON file ``out``, written atomically."""
    path = part_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
