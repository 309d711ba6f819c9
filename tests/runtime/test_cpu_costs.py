"""NOTE [ Figures measured beside other work ] in runtime/cpu_costs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import cpu_costs
from runtime.cpu_costs import CpuCosts, _cpu_now, _key, _others_cores, cached_cpu_costs

FIGURES = CpuCosts(copy_cost_s_per_byte=3e-10, op_overhead_s=5e-5, refault_s_per_byte=8e-10, transfer_cost_s=2e-4,
                   transfer_latency_s=3e-4, posix_write_bw_bytes_per_s=1e9, posix_read_bw_bytes_per_s=1e9,
                   ssd_duplex=0.6)


def test_the_cores_other_processes_use_are_counted_and_this_ones_are_not() -> None:
    if _cpu_now() is None:
        pytest.skip("no /proc/stat on this system: other processes' CPU time is not counted")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started
        start = _cpu_now()
        time.sleep(1.0)
        beside = _others_cores(start)
    finally:
        busy.kill()
        busy.wait()
    assert beside > 0.5  # a whole core, less what the scheduler gave others
    # this process's own work is not the others': 10 s of a 4-core machine's busy time over 4 s, 6 of them ours
    assert _others_cores((100.0, 50.0, 20.0), (104.0, 60.0, 26.0)) == pytest.approx(1.0)
    assert _others_cores((100.0, 50.0, 20.0), (104.0, 56.0, 26.0)) == 0.0


class Measuring(Exception):
    """Raised where ``cached_cpu_costs`` would measure (10-20 s) instead of reading its cache."""


def _measuring() -> None:
    raise Measuring


@pytest.mark.parametrize(("age_s", "others", "kept"), [
    (1800, 1.2, True), (7200, 1.2, False), (7200, 0.1, True), (8 * 86400, 0.1, False)])
def test_figures_measured_beside_other_work_are_kept_an_hour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              age_s: float, others: float, kept: bool) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cpu_costs.cache_path()
    path.parent.mkdir(parents=True)
    entry = {"measured_at": time.time() - age_s, "costs": FIGURES.__dict__, "others_cores": others}
    path.write_text(json.dumps({_key(tmp_path): entry}))
    if not kept:
        with pytest.raises(Measuring):
            cached_cpu_costs(tmp_path, measuring=_measuring)
        return
    figures, how = cached_cpu_costs(tmp_path, measuring=_measuring)
    assert figures == FIGURES
    assert ("while other processes kept 1.2 cores busy" in how) == (others > cpu_costs.BUSY_CORES), how


def test_figures_cached_before_the_others_were_counted_are_read_as_quiet(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cpu_costs.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({_key(tmp_path): {"measured_at": time.time() - 86400, "costs": FIGURES.__dict__}}))
    figures, how = cached_cpu_costs(tmp_path, measuring=_measuring)
    assert figures == FIGURES and "busy" not in how


def test_figures_of_another_key_stay_and_an_entry_of_other_fields_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU's and a GPU's figures share the file: measuring one keeps the other (a review found
    a miss wiping every other key, so each kind of plan measured again after the other). An
    entry whose fields differ (a field added since) is measured again, not a crash."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = cpu_costs.cache_path()
    path.parent.mkdir(parents=True)
    entry = {"measured_at": time.time(), "costs": FIGURES.__dict__, "others_cores": 0.0}
    path.write_text(json.dumps({_key(tmp_path): entry}))
    costs, how = cpu_costs._cached("gpu", ("transfer_cost_s",), lambda: {"transfer_cost_s": 3e-4}, None)
    assert costs == {"transfer_cost_s": 3e-4} and "now" in how
    assert cached_cpu_costs(tmp_path, measuring=_measuring)[0] == FIGURES  # still there
    assert cpu_costs._cached("gpu", ("transfer_cost_s",), _measuring_figures, None)[0] == {"transfer_cost_s": 3e-4}
    doc = json.loads(path.read_text())
    doc[_key(tmp_path)]["costs"] = {**FIGURES.__dict__, "a_field_added_since": 1.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(Measuring):
        cached_cpu_costs(tmp_path, measuring=_measuring)


def _measuring_figures() -> dict[str, float]:
    raise Measuring
