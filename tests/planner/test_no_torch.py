"""planner/ must plan without torch: importing it (and the synthetic profiles) loads no torch."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_import_planner_does_not_load_torch() -> None:
    code = ("import sys, planner, planner.baselines, planner.trace, profiles.synthetic; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_runtime_starts_without_pandas() -> None:
    """`teraio run` reads a plan, not a profile: its modules load no pandas (0.5-0.7 s of every
    run's start, and of every rank's, on a 2-core machine)."""
    code = ("import sys, teraio.cli, teraio.cmd_run, runtime.api, runtime.executor, torch_patch; "
            "print(sorted({'pandas', 'pyarrow'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
