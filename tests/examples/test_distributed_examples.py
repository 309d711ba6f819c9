"""The distributed example trainers under torchrun, CPU, gloo: with one process, DDP and
FSDP2 train exactly as ``train_gpt.py`` does. (With two, each is trained plainly and under
teraio in ``tests/distributed/test_jobs.py``: the loss falls, the saved parameters are the
GPT's, and the two runs agree bit for bit.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, ROOT, SMALL_GPT, pytorch_teardown_abort

EXAMPLES = ROOT / "examples"
STEPS = 6
# 4 layers so that interleaved 1F1B and ZB-V have a block per stage (4 stages on 2 ranks);
# a learning rate at which 6 steps take the loss well down.
ARGS = [*SMALL_GPT, "--layers", "4", "--batch", "8", "--steps", str(STEPS), "--lr", "1e-2"]
LINE = re.compile(r"step (\d+) loss (\S+)")
TIMEOUT_S = 120
# One intra-op thread per process, as torchrun sets for more than one process per node: the
# bits of a result depend on the thread count, and 2 cores spin-wait less.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(script: str, nproc: int, *args: str | Path) -> list[str]:
    """Run ``examples/SCRIPT`` under ``python -m torch.distributed.run``; its loss lines'
    values as printed (repr text, so equal text is equal bits). A run PyTorch's teardown
    aborts runs once more (``pytorch_teardown_abort``).

    ``--standalone`` has torchrun bind a free port for its rendezvous itself (no race
    between finding a port and using it). On a timeout torchrun gets SIGTERM, which it
    passes on to its workers (each in a session of its own) before it exits."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(EXAMPLES / script), *map(str, args)]
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            pytest.fail(f"{script} ran past {TIMEOUT_S} s")
        if attempt == 1 and pytorch_teardown_abort(proc.returncode, err):
            print(f"{script}: PyTorch's teardown aborted the run (no teraio in it); running it again")
            continue
        break
    assert proc.returncode == 0, err[-4000:]
    found = [LINE.fullmatch(line) for line in out.splitlines()]
    steps = [(int(m[1]), m[2]) for m in found if m]
    assert [n for n, _ in steps] == list(range(STEPS)), out  # one line per step, printed once
    return [loss for _, loss in steps]


def test_one_process_is_train_gpt() -> None:
    """A world of one: DDP's all-reduce and FSDP2's collectives change no bit."""
    plain = subprocess.run([sys.executable, str(EXAMPLE), *ARGS], capture_output=True, text=True,
                           cwd=ROOT, env=ENV, timeout=TIMEOUT_S)
    assert plain.returncode == 0, plain.stderr
    expected = [m[2] for m in map(LINE.fullmatch, plain.stdout.splitlines()) if m]
    assert len(expected) == STEPS
    for script in ("train_gpt_ddp.py", "train_gpt_fsdp.py"):
        assert torchrun(script, 1, *ARGS) == expected, script
