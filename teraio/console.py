"""Diagnostics for the CLI: results go to stdout, everything else to stderr."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "fail", "info", "warn"]

EXIT_FAILED = 1  # the work itself failed (I/O error, script failure without its own code)
EXIT_BAD_INPUT = 2  # bad arguments, missing or damaged input files


def info(message: str) -> None:
    print(f"teraio: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"teraio: warning: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print a one-line error and exit with ``code``."""
    print(f"teraio: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)
