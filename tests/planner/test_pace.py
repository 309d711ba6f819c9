"""Planning on the paced clock (planner.pace) and the stall fixes' ledger (planner.excess.OverLedger)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner import Hardware, plan_rank, problem_from_profile
from planner.bound import iteration_bound
from planner.excess import Excess, OverLedger
from planner.greedy import plan_greedy
from planner.make import settle_urgency
from planner.pace import paced_durations
from planner.simulate import simulate
from profiles.synthetic import synthetic_profile
from tests.planner.helpers import assert_simulates_its_moves
from tests.planner.test_bound import two_phase_profile
from tests.planner.test_properties import SETTINGS, cases


def hw(capacity: int, bw: float) -> Hardware:
    return Hardware(gpu_mem_bytes=capacity, ssd_read_bw_bytes_per_s=bw, ssd_write_bw_bytes_per_s=bw)


def test_only_windows_slower_than_their_ops_are_stretched() -> None:
    problem = problem_from_profile(two_phase_profile())
    assert paced_durations(problem, iteration_bound(problem, hw(2000, 1e6)), 0.0) is None  # nothing moves
    h = hw(400, 1e5)
    bound = iteration_bound(problem, h)
    # [0, 4]: 500 us of ops, bound 4,500 us; [5, 9]: 500 us, bound 5,500 us (test_bound).
    paced = paced_durations(problem, bound, 0.0)
    assert paced is not None
    assert paced[:5].sum() == pytest.approx(4500.0) and paced[5:].sum() == pytest.approx(5500.0)
    assert np.allclose(paced[:5] / problem.duration_us[:5], paced[0] / problem.duration_us[0])  # in proportion
    assert paced_durations(problem, bound, 0.5)[5:].sum() == pytest.approx(5500.0 * 1.5)  # type: ignore[index]
    with pytest.raises(ValueError):
        paced_durations(problem, bound, -0.1)


def test_a_window_of_ops_that_take_no_time_gets_its_bound_spread_evenly() -> None:
    problem = problem_from_profile(two_phase_profile())
    d = problem.duration_us.copy()
    d[5:] = 0.0
    problem = replace(problem, duration_us=d)
    bound = iteration_bound(problem, hw(400, 1e5))
    paced = paced_durations(problem, bound, 0.0)
    # [5, 9] takes no time: its writes by op 6 (5,100 us) are all its bound
    assert paced is not None and np.allclose(paced[5:], 5100.0 / 5)
    assert paced[:5].sum() == pytest.approx(4500.0)


def test_plan_rank_keeps_the_fastest_clock() -> None:
    problem = problem_from_profile(synthetic_profile(8, 6, 3, seed=1))
    h = hw(int(problem.memory_bytes.max() * 0.55), 8e9)
    bound = iteration_bound(problem, h)
    plans, times = [], []
    for durations in (problem.duration_us, paced_durations(problem, bound, 0.0),
                      paced_durations(problem, bound, 0.25)):
        assert durations is not None
        plans.append(plan_greedy(replace(problem, duration_us=durations), h))
        times.append(simulate(problem, plans[-1], h.channel_bw(), h.gpu_mem_bytes).iteration_us)
    best = plan_rank(problem, h, margins=(0.0, 0.25))
    # The fastest clock's moves, their prefetches perhaps started earlier (planner.early)
    fastest = plans[int(np.argmin(times))]
    assert best.sim.fits and {m.period for m in best.moves} == {m.period for m in fastest}
    assert best.sim.iteration_us <= settle_urgency(problem, fastest, h.channel_bw(), h.gpu_mem_bytes).sim.iteration_us
    assert best.problem is problem  # simulated on the ops' own durations
    assert len(set(times)) == 3  # the clocks made different plans


@SETTINGS
@given(cases(), st.sampled_from([0.0, 0.25]))
def test_paced_plans_fit_and_report_their_own_moves(case: tuple, margin: float) -> None:
    _, problem, h = case
    result = plan_rank(problem, h, margins=(margin,))
    assert result.sim.fits
    assert_simulates_its_moves(result, h)


@given(st.integers(1, 300), st.lists(st.tuples(st.integers(0, 299), st.integers(0, 300),
                                               st.integers(0, 1 << 20)), max_size=40), st.integers(0, 9))
def test_the_ledger_agrees_with_the_excess_blocks(n: int, frees: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    over = np.where(rng.random(n) < 0.7, rng.integers(1, 1 << 21, n), 0).astype(np.float64)
    excess, ledger = Excess(rng.uniform(1, 10, n), over), OverLedger(over)
    for lo, hi, size in frees:
        lo, hi = min(lo, n), min(hi, n)
        excess.free(lo, hi, float(size))
        ledger.free(lo, hi, float(size))
    assert np.array_equal(ledger.values(), excess.values())
    assert [ledger.at(k) for k in range(n)] == excess.values().tolist()
    assert ledger.num_over == excess.num_over
