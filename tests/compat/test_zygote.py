"""The compat tests' zygote: a child whose zygote died is reported at once, even after a
later test started a new zygote."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.compat import zygote


def test_a_child_of_a_dead_zygote_is_reported_at_once(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    orphan = zygote.start([script], tmp_path, tmp_path / "logs")
    assert orphan.zygote is not None
    orphan.zygote.kill()
    orphan.zygote.wait()
    quick = tmp_path / "quick.py"
    quick.write_text("print('ok')\n")
    assert zygote.start([quick], tmp_path, tmp_path / "logs").wait(60).stdout == "ok\n"  # a new zygote
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="zygote died"):
        orphan.wait(60)
    assert time.monotonic() - t0 < 10, f"waited {time.monotonic() - t0:.0f} s"
