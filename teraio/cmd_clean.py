"""`teraio clean`: remove the swap files of runs that were killed before they could."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from teraio.console import info

__all__ = ["clean"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def clean(
    swap_dir: Annotated[Path | None, typer.Option(
        help="The swap directory runs used (their --swap-dir). Default: the system temporary "
             "directory.", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Only list what would be removed.")] = False,
) -> None:
    """Remove the swap directories of teraio runs whose process is gone.

    A run killed outright (SIGKILL: the OOM killer, a preempted node) leaves
    its swap files behind; every run removes those of dead runs on its swap
    directory when it starts, and this command does it on request. Only
    directories whose owner record names this host and a process that no
    longer runs are removed. Directories of teraio 0.1 (no owner record) and
    teraio-kept-* directories (bytes teraio could not restore, named in the
    error of the run that kept them) are listed, never removed. Exit code 0.
    """
    from runtime.swapdir import sweep

    found = sweep(swap_dir, remove=not dry_run)
    verb = "would remove" if dry_run else "removed"
    for path in found.removed:
        print(path)
    info(f"{verb} {len(found.removed)} swap directories of runs that are gone, "
         f"{_mib(found.removed_bytes)}")
    for path in found.unowned:
        info(f"left {path}: no owner record (made by teraio 0.1); remove it by hand if no run uses it")
    for path in found.kept:
        info(f"left {path}: bytes a run could not restore (see kept.json there)")
