"""Start the compat tests' processes in milliseconds: a zygote imports torch and what the
scripts use once, then forks a child for each command.

A fresh Python here takes 5-7 s to import torch, dynamo (every optimizer imports it) and
transformers, four times a compat test: most of the test's time. A forked child shares what
the zygote imported. It runs its command as ``python ARGV`` would (a script as ``__main__``
with its directory first on ``sys.path``, or ``-m MODULE`` with the working directory first),
in its own working directory and environment, stdin from /dev/null and stdout and stderr to
files, and ends as Python ends (atexit handlers, non-daemon threads joined). The CLI's own
tests (tests/cli) start fresh interpreters; these test what training scripts do under teraio.

Requests are JSON lines on stdin: ``{"argv", "cwd", "env", "out", "err", "rc"}``. The zygote
answers each with the child's pid on a line of stdout and, when the child ends, writes its exit
code (negative: the signal that ended it) to the file ``rc``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Child", "start"]


# ---- the zygote -------------------------------------------------------------------------------
def _preload() -> None:
    import pandas  # noqa: F401 - teraio's profile and plan
    import pyarrow.parquet  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401 - the first optimizer imports it

    import teraio.cli  # noqa: F401
    import torch_patch  # noqa: F401
    from runtime import api  # noqa: F401

    try:
        import transformers  # noqa: F401

        # transformers imports lazily; these are what the hf_* scripts use
        from transformers import BertConfig, GPT2Config, LlamaConfig, T5Config, Trainer  # noqa: F401
    except ImportError:
        pass
    del torch


def _serve() -> None:
    _preload()
    rc_paths: dict[int, str] = {}
    lock = threading.Lock()

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                time.sleep(0.05)
                continue
            with lock:
                path = rc_paths.pop(pid)
            Path(f"{path}.tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(f"{path}.tmp", path)

    threading.Thread(target=reap, daemon=True).start()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        with lock:
            pid = os.fork()
            if pid == 0:
                _child(req)  # ends the child: it never returns here
            rc_paths[pid] = req["rc"]
        print(pid, flush=True)


def _child(req: dict[str, Any]) -> None:
    """Become ``python ARGV``, and exit as it would."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                  line_buffering=True)
    argv = req["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first
        sys.path[0] = os.getcwd()
        target, run = argv[1], lambda m: runpy.run_module(m, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        target, run = argv[0], lambda p: runpy.run_path(p, run_name="__main__")
    try:
        run(target)
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)  # up through _serve: the interpreter ends as after a script


# ---- the tests' side --------------------------------------------------------------------------
@dataclass
class Child:
    pid: int
    argv: list[str]
    out: Path
    err: Path
    rc: Path
    zygote: subprocess.Popen[str] | None = None  # the one it was forked from

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """The child's exit code and output; killed (and ``TimeoutExpired``) after ``timeout`` s."""
        end = time.monotonic() + timeout
        while not self.rc.exists():
            if self.zygote is not None and self.zygote.poll() is not None and not self.rc.exists():
                self._kill()  # no one is left to say how it ended
                raise RuntimeError(f"the compat tests' zygote died while {self.argv} ran")
            if time.monotonic() > end:
                self._kill()
                raise subprocess.TimeoutExpired(self.argv, timeout, self.out.read_text(), self.err.read_text())
            time.sleep(0.02)
        return subprocess.CompletedProcess(self.argv, int(self.rc.read_text()), self.out.read_text(),
                                           self.err.read_text())


_zygote: subprocess.Popen[str] | None = None
_lock = threading.Lock()
_count = iter(range(1 << 62))


def start(argv: list[str | os.PathLike[str]], cwd: Path, logs: Path) -> Child:
    """Start ``python ARGV`` forked from this process's zygote (started at the first call, and
    again if it died); its output goes to files under ``logs``."""
    global _zygote
    argv = [str(a) for a in argv]
    logs.mkdir(parents=True, exist_ok=True)
    with _lock:
        n = next(_count)
        child = Child(0, argv, logs / f"{n}.out", logs / f"{n}.err", logs / f"{n}.rc")
        if _zygote is None or _zygote.poll() is not None:
            root = Path(__file__).resolve().parents[2]
            _zygote = subprocess.Popen([sys.executable, "-m", "tests.compat.zygote"], cwd=root, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert _zygote.stdin is not None and _zygote.stdout is not None
        _zygote.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": dict(os.environ),
                                        "out": str(child.out), "err": str(child.err),
                                        "rc": str(child.rc)}) + "\n")
        _zygote.stdin.flush()
        answer = _zygote.stdout.readline()
        if not answer:
            raise RuntimeError("the compat tests' zygote died (python -m tests.compat.zygote)")
        child.pid, child.zygote = int(answer), _zygote
    return child


if __name__ == "__main__":
    _serve()
