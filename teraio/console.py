"""Diagnostics for the CLI: results go to stdout, everything else to stderr."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "fail", "info", "teraio_warnings", "warn", "who"]

EXIT_FAILED = 1  # the work itself failed (I/O error, script failure without its own code)
EXIT_BAD_INPUT = 2  # bad arguments, missing or damaged input files


def who() -> str:
    """``teraio``, or ``teraio[rank R]`` in a worker of a job of several processes."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return f"teraio[rank {os.environ.get('RANK', '?')}]"
    return "teraio"


def info(message: str) -> None:
    print(f"{who()}: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"{who()}: warning: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print a one-line error and exit with ``code``."""
    print(f"{who()}: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


@contextmanager
def teraio_warnings() -> Iterator[None]:
    """Show teraio's own warnings (``warnings.warn("teraio: ...")`` in the runtime and the
    tracer) as one ``teraio: warning: ...`` line each; other warnings as Python shows them."""
    show = warnings.showwarning

    def one_line(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Any = None) -> None:
        text = str(message)
        if text.startswith("teraio: "):
            warn(text.removeprefix("teraio: "))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = one_line
    try:
        yield
    finally:
        warnings.showwarning = show
