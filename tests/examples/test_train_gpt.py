"""The example's peers for bench/rok_gpu.py train to the plain run's losses (the benches compare
their speed and memory, so they must be the same training)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLE, SMALL_GPT


def losses(*extra: str) -> list[str]:
    r = subprocess.run([sys.executable, str(EXAMPLE), *SMALL_GPT, "--steps", "3", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return re.findall(r"^step \d+ loss (\S+)$", r.stdout, re.M)


@pytest.mark.parametrize("peer", [["--checkpoint"], ["--offload", "save_on_cpu"]])
def test_a_peer_trains_to_the_plain_runs_losses(peer: list[str]) -> None:
    plain = losses()
    assert len(plain) == 3 and losses(*peer) == plain
