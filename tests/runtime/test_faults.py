"""Faults in their own processes: a full disk, Ctrl-C. Training goes on correctly or
stops with a clear error; nothing is silently wrong and no swap file is left."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from runtime.swapdir import _start_time
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
    try:
        assert list(tmp_path.glob("teraio-swap-*")), "no swap directory while training"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # (a run left going loads every test after it)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert not list(tmp_path.iterdir())



def kill_while_training(swap: Path) -> Path:
    """Start training under a plan, SIGKILL it mid-run (from step 4 on, once bytes are on disk:
    no op waits for a write it does not need the room of, so on a busy machine the files can
    still be empty at step 4); the swap directory it leaves."""
    before = set(swap.glob("teraio-swap-*"))
    proc = subprocess.Popen([sys.executable, "-m", "tests.runtime.fault_script", "forever", str(swap)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120

    def written() -> bool:
        for f in (f for d in set(swap.glob("teraio-swap-*")) - before for f in d.glob("*.bin")):
            try:
                if f.stat().st_size:
                    return True
            except FileNotFoundError:  # read back and deleted meanwhile
                pass
        return False

    try:
        for line in proc.stdout:
            if time.monotonic() > deadline:
                break
            if line.startswith("step ") and int(line.split()[1]) >= 4 and written():
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    (left,) = set(swap.glob("teraio-swap-*")) - before
    assert list(left.glob("*.bin")), "nothing was on disk when the run was killed"
    return left


def test_a_killed_runs_swap_files_are_removed_by_the_next_run_and_by_teraio_clean(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer, a preempted node) leaves swap files: the next run on that swap
    directory removes them and says how much it freed; `teraio clean` does it on request.
    A directory whose owner lives, or that has no owner record, is left alone."""
    from tests.conftest import run_teraio

    alive = tmp_path / "teraio-swap-alive"
    alive.mkdir()
    (alive / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "start": _start_time(os.getpid())}))
    unowned = tmp_path / "teraio-swap-old"
    unowned.mkdir()

    left = kill_while_training(tmp_path)
    r = run_teraio("clean", "--swap-dir", tmp_path, "--dry-run")
    assert r.returncode == 0 and left.exists() and str(left) in r.stdout
    r = run_teraio("clean", "--swap-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert not left.exists() and str(left) in r.stdout
    assert re.search(r"removed 1 swap directories of runs that are gone, (?!0\.0 )[\d.,]+ MiB", r.stderr)
    assert f"left {unowned}: no owner record" in r.stderr
    assert alive.exists() and unowned.exists()

    left = kill_while_training(tmp_path)
    r = run_fault("fsize", tmp_path, "3")
    assert r.returncode == 0, r.stderr
    assert not left.exists()
    assert re.search(r"removed 1 swap directories left by runs that were killed \((?!0\.0 )[\d.,]+ MiB freed\)",
                     r.stderr)
    assert alive.exists() and unowned.exists()


def test_a_live_owner_in_another_pid_namespace_keeps_its_swap_directory(tmp_path: Path) -> None:
    """Another container on this host (same host name, another pid namespace) shares the swap
    mount: its pid means nothing here, but it holds its directory's lock, so no sweep takes it;
    once it is killed, the next sweep does."""
    from runtime.swapdir import sweep

    owner = subprocess.Popen([sys.executable, "-c", "import sys; from runtime.swapdir import make_swap_dir; "
                              "print(make_swap_dir(sys.argv[1]), flush=True); sys.stdin.read()", str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert owner.stdout is not None
        path = Path(owner.stdout.readline().strip())
        record = json.loads((path / "owner.json").read_text())
        assert record["locked"] and record["pid"] == owner.pid
        # as seen from another pid namespace: a pid that is nobody here
        (path / "owner.json").write_text(json.dumps({**record, "pid": 2**22 + 7}))
        assert sweep(tmp_path).removed == () and path.exists()
    finally:
        owner.kill()
        owner.wait(timeout=60)
    assert sweep(tmp_path).removed == (path,) and not path.exists()
