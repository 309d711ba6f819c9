"""Run a user's training script as ``__main__``, with its own arguments, in this process."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path
from types import TracebackType

__all__ = ["ScriptFailed", "run_script"]


class ScriptFailed(Exception):  # noqa: N818
    """The script exited with a non-zero status; its traceback has been printed."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"the script exited with status {exit_code}")
        self.exit_code = exit_code


def _script_traceback(tb: TracebackType | None, script: Path) -> TracebackType | None:
    """The traceback from the script's own first frame on, as Python would show it."""
    target = str(script.resolve())
    t = tb
    while t is not None:
        if os.path.realpath(t.tb_frame.f_code.co_filename) == target:
            return t
        t = t.tb_next
    return tb


def run_script(script: Path, args: list[str],
               passthrough: tuple[type[BaseException], ...] = ()) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]``.

    A normal end or ``sys.exit(0)`` returns. An exception from the script
    prints its traceback (from the script's frames on) to stderr and raises
    ``ScriptFailed(1)``; ``sys.exit(n)`` raises ``ScriptFailed(n)``. Exceptions
    that are not ``Exception`` (``KeyboardInterrupt``, teraio's own stop
    signals) pass through, and so do the ``passthrough`` exception types.
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        raise ScriptFailed(code) from None
    except Exception as exc:
        if isinstance(exc, passthrough):
            raise
        traceback.print_exception(type(exc), exc, _script_traceback(exc.__traceback__, script))
        raise ScriptFailed(1) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
