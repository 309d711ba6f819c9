"""Shared test helpers: the CLI runs as a real subprocess, the example as a real script."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A shell without job control starts a job put in the background with SIGINT ignored, which the
# processes it starts inherit, and Python then installs no handler of its own: the tests that
# press Ctrl-C on a run saw nothing happen (and a run left going loaded the rest of the suite).
# Python's own handler is installed again here, which the runs these tests start then have too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
EXAMPLE = ROOT / "examples" / "train_gpt.py"
# Small enough for a CPU step of a few tens of milliseconds.
SMALL_GPT = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "4",
             "--vocab", "128"]


def pytorch_teardown_abort(returncode: int, stderr: str) -> bool:
    """Whether a torchrun run without teraio died in PyTorch's own teardown: a gloo worker thread
    left joinable at exit aborts the process ("terminate called without an active exception",
    SIGABRT; the kind of crash pytorch/pytorch#179291 is about). Seen in 2 of about 30 runs of the
    suite here, both in plain FSDP2 runs under load. Tests run such a plain run once more, never a
    run under teraio, whose failures are ours to see."""
    return returncode != 0 and "terminate called without an active exception" in stderr


def run_teraio(*args: str | os.PathLike[str], cwd: Path | None = None, timeout: float = 300,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m teraio ARGS` and capture its output (``env``: more environment)."""
    return subprocess.run(
        [sys.executable, "-m", "teraio", *map(str, args)],
        capture_output=True, text=True, cwd=cwd or ROOT, timeout=timeout,
        env={**os.environ, **env} if env else None,
    )


@pytest.fixture(scope="session", autouse=True)
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' own cache (``teraio plan``'s measured CPU costs, runtime.calibrate): measured
    once per test process, never the user's."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["XDG_CACHE_HOME"] = str(path)
    return path


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-iteration profile of the small example GPT, made once per test session."""
    out = tmp_path_factory.mktemp("gpt") / "profile"
    r = run_teraio("profile", EXAMPLE, "--out", out, "--iters", "3", "--", *SMALL_GPT,
                   "--steps", "5")
    assert r.returncode == 0, r.stderr
    return out
