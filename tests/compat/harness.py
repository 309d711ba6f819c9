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

from tests.compat import zygote
from tests.conftest import ROOT

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 300


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step \d+ loss (.+)$", stdout, re.M)


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


def teraio(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m teraio ARGS`, forked from the zygote (tests/compat/zygote.py)."""
    return zygote.start(["-m", "teraio", *args], cwd, cwd / "logs").wait(TIMEOUT_S)


def start_plain(script: Path, args: list[str], tmp: Path) -> zygote.Child:
    """The script without teraio, started in the background (``finish_plain`` collects it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return zygote.start([script, *args, "--save", tmp / "plain.pt"], tmp, tmp / "logs")


def finish_plain(child: zygote.Child, tmp: Path) -> Outcome:
    r = child.wait(TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    return Outcome(losses(r.stdout), torch.load(tmp / "plain.pt"), r.stdout, r.stderr)


def plain(script: Path, args: list[str], tmp: Path) -> Outcome:
    return finish_plain(start_plain(script, args, tmp), tmp)


def compare(script: Path, args: list[str], tmp: Path, plain_args: list[str] | None = None,
            **options: Any) -> tuple[Outcome, Outcome]:
    """The plain run (with ``plain_args`` if given) beside profile, plan and run under teraio."""
    proc = start_plain(script, args if plain_args is None else plain_args, tmp / "plain")
    try:
        (tmp / "teraio").mkdir()
        b = through_teraio(script, args, tmp / "teraio", **options)
    finally:
        a = finish_plain(proc, tmp / "plain")
    return a, b


def through_teraio(script: Path, args: list[str], tmp: Path, share: str = "50%",
                   profile_opts: tuple[str, ...] = (), backend: str = "posix",
                   run_opts: tuple[str, ...] = ()) -> Outcome:
    """Profile, plan at ``share`` of the peak (or the smallest budget any plan meets), run (with
    ``run_opts``)."""
    prof = tmp / "profile"
    r = teraio("profile", script, "--out", prof, *profile_opts, "--", *args, cwd=tmp)
    assert r.returncode == 0, r.stderr
    profile_stderr = r.stderr
    plan = tmp / "plan.json"
    r = teraio("plan", prof, "--gpu-mem", share, "--ssd-bw", "2", "--host-mem", "64M", "--out", plan, "--json",
               cwd=tmp)
    if r.returncode != 0 and "--gpu-mem min" in r.stderr:
        r = teraio("plan", prof, "--gpu-mem", "min", "--ssd-bw", "2", "--host-mem", "64M", "--out", plan, "--json",
                   cwd=tmp)
    assert r.returncode == 0, r.stderr
    plan_stderr = r.stderr
    doc = json.loads(plan.read_text())
    out = tmp / "teraio.pt"
    r = teraio("run", "--plan", plan, "--backend", backend, "--swap-dir", tmp, "--report", tmp / "run.json",
               *run_opts, script, "--", *args, "--save", out, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return Outcome(losses(r.stdout), torch.load(out), r.stdout, r.stderr,
                   json.loads((tmp / "run.json").read_text()), doc,
                   int(doc["parameters"]["gpu_mem_bytes"]), plan_stderr, profile_stderr)


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict (dicts, lists, tuples) as {dotted name: value}; a sparse tensor as
    its dense form."""
    if isinstance(obj, (dict, list, tuple)):
        out: dict[str, Any] = {}
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            out.update(flat(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, torch.Tensor) and obj.layout is not torch.strided:
        obj = obj.to_dense()
    return {prefix.rstrip("."): obj}


def assert_within_budget(b: Outcome, share: float = 1.05) -> None:
    """Every iteration that followed the steady plan within ``share`` of its budget."""
    assert b.report is not None and b.budget is not None
    peaks, followed = b.report["iteration_peak_bytes"], b.report["iteration_followed"]
    over = [(i, p) for i, (p, f) in enumerate(zip(peaks, followed, strict=True)) if i and f and p > b.budget * share]
    assert not over, (b.budget, peaks, followed)


def assert_identical(a: Outcome, b: Outcome) -> None:
    """The same losses and final parameters, bit for bit."""
    assert a.losses and a.losses == b.losses, (a.losses, b.losses)
    pa, pb = flat(a.params), flat(b.params)
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        assert torch.equal(value, pb[name]) if isinstance(value, torch.Tensor) else value == pb[name], name


def main() -> None:
    script, args = Path(sys.argv[1]), sys.argv[2:]
    if not script.exists():
        script = SCRIPTS / script
    with tempfile.TemporaryDirectory() as d:
        a, b = compare(script, args, Path(d))
        print(b.profile_stderr[-2000:], b.plan_stderr[-3000:], b.stderr[-3000:], sep="\n")
        assert b.report is not None
        print("budget", b.budget, "peaks", b.report["iteration_peak_bytes"])
        print("moved", b.report["bytes_written"], "unfollowed", b.report["unfollowed_iterations"])
        assert_identical(a, b)
        print("IDENTICAL", len(a.losses), "steps")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
