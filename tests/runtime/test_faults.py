"""Faults in their own processes: a full disk, Ctrl-C. Training goes on correctly or
stops with a clear error; nothing is silently wrong and no swap file is left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT
from tests.runtime.test_executor import train


def run_fault(mode: str, swap: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.runtime.fault_script", mode, str(swap),
                           *extra], capture_output=True, text=True, cwd=ROOT, timeout=300)


def expected_lines(steps: int = 6) -> list[str]:
    losses, params = train(steps)
    lines = [f"loss {i} {loss!r}" for i, loss in enumerate(losses)]
    return [*lines, f"checksum {sum(float(p.double().sum()) for p in params)!r}"]


def result_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("loss ", "checksum "))]


def test_disk_full_moves_to_host_and_stays_exact(tmp_path: Path) -> None:
    r = run_fault("fsize", tmp_path)
    assert r.returncode == 0, r.stderr
    assert result_lines(r.stdout) == expected_lines()
    assert r.stderr.count("could not write tensor") == 1  # warned once
    report = r.stdout.splitlines()[-1]
    assert "failed_writes=0" not in report and "host=0" not in report
    assert not list(tmp_path.iterdir())


def test_disk_full_without_host_room_keeps_tensors(tmp_path: Path) -> None:
    r = run_fault("fsize-nohost", tmp_path)
    assert r.returncode == 0, r.stderr
    assert result_lines(r.stdout) == expected_lines()
    assert "could not write tensor" in r.stderr
    assert not list(tmp_path.iterdir())


def test_ctrl_c_removes_swap_files(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tests.runtime.fault_script", "forever",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("step 5") or time.monotonic() > deadline:
            break
    assert list(tmp_path.glob("teraio-swap-*")), "no swap directory while training"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert not list(tmp_path.iterdir())

