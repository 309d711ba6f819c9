"""NOTE [ Where the time goes ] (planner/phases.py): the plan report's time per phase."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given

from planner import plan_rank, problem_from_profile
from planner.bound import iteration_bound, phase_windows
from planner.greedy import Move
from planner.phases import phase_report
from planner.simulate import simulate
from tests.planner.test_bound import hw, two_phase_profile
from tests.planner.test_properties import SETTINGS, cases


def test_each_channel_is_busy_where_its_transfers_run() -> None:
    problem = problem_from_profile(two_phase_profile())  # forward ops 0-4, optimizer 5-9, 100 us each
    h = hw(910, ssd=1e7)  # 1,110 B over ops 1-3: A (600 B, idle over ops 1-4) goes out, 60 us each way
    (a,) = [i for i in range(problem.num_periods) if problem.size_bytes[i] == 600 and problem.start_op[i] == 0]
    move = Move(period=a, tensor_id=int(problem.tensor_id[a]), size_bytes=600, target="ssd", start_op=0,
                end_op=5, offload_trigger=1, offload_deadline=1, prefetch_trigger=4, prefetch_deadline=5,
                priority=0)
    sim = simulate(problem, [move], h.channel_bw(), h.gpu_mem_bytes)
    # op 1 waits for the write (100-160 us); the read runs beside op 4 (460-520 us)
    assert sim.fits and sim.stall_us == pytest.approx(60.0)
    rows = {r["phase"]: r for r in phase_report(problem, sim, iteration_bound(problem, h))}
    forward, optimizer = rows["forward"], rows["optimizer"]
    assert forward["predicted_us"] == pytest.approx(560.0) and optimizer["predicted_us"] == pytest.approx(500.0)
    assert forward["busy"]["ssd_write"] * 560.0 == pytest.approx(60.0)
    assert forward["busy"]["ssd_read"] * 560.0 == pytest.approx(60.0)
    assert forward["busy"]["host_write"] == forward["busy"]["host_read"] == 0.0
    assert optimizer["busy"] == {c: 0.0 for c in optimizer["busy"]}
    # Read back only as op 5 comes: op 5 waits for it, in the optimizer step's time
    late = simulate(problem, [replace(move, prefetch_trigger=5)], h.channel_bw(), h.gpu_mem_bytes)
    assert late.fits and late.stall_us_before[5] == pytest.approx(60.0)
    rows = {r["phase"]: r for r in phase_report(problem, late, iteration_bound(problem, h))}
    forward, optimizer = rows["forward"], rows["optimizer"]
    assert forward["predicted_us"] == pytest.approx(560.0) and optimizer["predicted_us"] == pytest.approx(560.0)
    assert forward["busy"]["ssd_read"] == 0.0 and optimizer["busy"]["ssd_read"] * 560.0 == pytest.approx(60.0)


@SETTINGS
@given(cases())
def test_the_phases_split_the_iteration_and_none_beats_its_bound(case: tuple) -> None:
    _, problem, h = case
    rp = plan_rank(problem, h)
    bound = iteration_bound(problem, h)
    rows = phase_report(problem, rp.sim, bound)
    assert sum(r["windows"] for r in rows) == len(phase_windows(problem))
    assert sum(r["predicted_us"] for r in rows) == pytest.approx(rp.sim.iteration_us)
    assert sum(r["compute_us"] for r in rows) == pytest.approx(problem.ideal_iteration_us)
    for r in rows:
        assert all(0.0 <= share <= 1.0 + 1e-9 for share in r["busy"].values())
        # NOTE [ Transfer bound ]: each window's stretch takes at least its bound, in a plan that fits
        if rp.sim.fits and rp.sim.host_peak_bytes <= h.host_mem_bytes:
            assert r["predicted_us"] >= r["bound_us"] * (1 - 1e-9)
    for c, busy in rp.sim.busy_us.items():  # the channels' busy time, window by window
        assert sum(r["busy"][c] * r["predicted_us"] for r in rows) == pytest.approx(busy, abs=1e-6)
