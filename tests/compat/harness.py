"""Run a compat script plainly and through profile, plan and run; compare bit for bit.

Used by ``test_compat.py``; also by hand: ``python -m tests.compat.harness SCRIPT [ARGS...]``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import ROOT, run_teraio

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 300


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+ loss (\S+)$", stdout, re.M)


@dataclass
class Outcome:
    losses: list[str]
    params: dict[str, torch.Tensor]
    stdout: str
    stderr: str
    report: dict[str, Any] | None = None
    plan: dict[str, Any] | None = None
    budget: int | None = None
    plan_stderr: str = ""
    profile_stderr: str = ""


def plain(script: Path, args: list[str], tmp: Path) -> Outcome:
    out = tmp / "plain.pt"
    r = subprocess.run([sys.executable, str(script), *args, "--save", str(out)], capture_output=True,
                       text=True, timeout=TIMEOUT_S, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return Outcome(losses(r.stdout), torch.load(out), r.stdout, r.stderr)


def through_teraio(script: Path, args: list[str], tmp: Path, share: str = "50%",
                   profile_opts: tuple[str, ...] = (), backend: str = "posix") -> Outcome:
    """Profile, plan at ``share`` of the peak (or the smallest budget any plan meets), run."""
    prof = tmp / "profile"
    r = run_teraio("profile", script, "--out", prof, *profile_opts, "--", *args, cwd=tmp, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    profile_stderr = r.stderr
    plan = tmp / "plan.json"
    r = run_teraio("plan", prof, "--gpu-mem", share, "--ssd-bw", "2", "--host-mem", "64M", "--out", plan,
                   "--json", cwd=tmp, timeout=TIMEOUT_S)
    if r.returncode != 0 and "--gpu-mem min" in r.stderr:
        r = run_teraio("plan", prof, "--gpu-mem", "min", "--ssd-bw", "2", "--host-mem", "64M", "--out",
                       plan, "--json", cwd=tmp, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    plan_stderr = r.stderr
    doc = json.loads(plan.read_text())
    out = tmp / "teraio.pt"
    r = run_teraio("run", "--plan", plan, "--backend", backend, "--swap-dir", tmp, "--report",
                   tmp / "run.json", script, "--", *args, "--save", out, cwd=tmp, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    return Outcome(losses(r.stdout), torch.load(out), r.stdout, r.stderr,
                   json.loads((tmp / "run.json").read_text()), doc,
                   int(doc["parameters"]["gpu_mem_bytes"]), plan_stderr, profile_stderr)


def assert_identical(a: Outcome, b: Outcome) -> None:
    assert a.losses and a.losses == b.losses, (a.losses, b.losses)
    assert a.params.keys() == b.params.keys()
    for name, value in a.params.items():
        assert torch.equal(value, b.params[name]), name


def main() -> None:
    script, args = Path(sys.argv[1]), sys.argv[2:]
    if not script.exists():
        script = SCRIPTS / script
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "plain").mkdir()
        (tmp / "teraio").mkdir()
        a = plain(script, args, tmp / "plain")
        b = through_teraio(script, args, tmp / "teraio")
        print(b.profile_stderr[-2000:], b.plan_stderr[-3000:], b.stderr[-3000:], sep="\n")
        assert b.report is not None
        print("budget", b.budget, "peaks", b.report["iteration_peak_bytes"])
        print("moved", b.report["bytes_written"], "unfollowed", b.report["unfollowed_iterations"])
        assert_identical(a, b)
        print("IDENTICAL", len(a.losses), "steps")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
