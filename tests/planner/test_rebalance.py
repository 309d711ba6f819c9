"""Host memory left idle beside a saturated SSD (planner.rebalance)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner import Hardware, Move, problem_from_profile
from planner.bound import iteration_bound
from planner.greedy import plan_greedy
from planner.rebalance import _batches, fill_host, window_times_us
from planner.simulate import SimResult, simulate
from profiles.synthetic import synthetic_profile


def _case(host_share: float) -> tuple:
    """A plan made for the SSD alone (10x slower than the host link), then given host memory of
    ``host_share`` of the profile's peak."""
    problem = problem_from_profile(synthetic_profile(8, 6, 3, seed=1))
    ssd_only = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.55), ssd_read_bw_bytes_per_s=2e8,
                        ssd_write_bw_bytes_per_s=2e8, host_bw_bytes_per_s=2e9)
    moves = plan_greedy(problem, ssd_only)  # every move on the SSD
    hw = replace(ssd_only, host_mem_bytes=max(1, int(problem.memory_bytes.max() * host_share)))

    def sim_of(ms: Sequence[Move]) -> SimResult:
        return simulate(problem, ms, hw.channel_bw(), hw.gpu_mem_bytes)

    return problem, moves, hw, sim_of


def test_ssd_moves_go_to_idle_host_memory_where_that_is_faster() -> None:
    problem, moves, hw, sim_of = _case(host_share=0.2)
    before = sim_of(moves)
    assert before.fits and before.stall_us > 0  # the SSD is the bottleneck
    filled, sim = fill_host(problem, moves, before, hw, iteration_bound(problem, hw), sim_of)
    assert sim.fits and sim.iteration_us < before.iteration_us
    assert sim.iteration_us == sim_of(filled).iteration_us  # the simulation returned is of the moves returned
    assert 0 < sim.host_peak_bytes <= hw.host_mem_bytes
    assert [replace(m, target="ssd") for m in filled] == moves  # only destinations change
    assert any(m.target == "host" for m in filled)


def test_no_move_fits_in_too_little_host_memory() -> None:
    problem, moves, hw, sim_of = _case(host_share=0.0)
    before = sim_of(moves)
    filled, sim = fill_host(problem, moves, before, hw, iteration_bound(problem, hw), sim_of)
    assert filled == moves and sim is before



def test_a_balancing_batch_evens_out_every_window_above_its_bound() -> None:
    problem, moves, hw, sim_of = _case(host_share=1.0)
    before, bound = sim_of(moves), iteration_bound(problem, hw)
    above = window_times_us(before, bound.window_first_op) > bound.window_us
    assert above.sum() >= 2
    n, bw = problem.num_ops, hw.channel_bw()
    for side in ("read", "write"):
        balancing, worst = _batches(problem, moves, before, bound, hw, side)
        at = [(m.end_op if side == "read" else m.start_op + 1) % n for m in moves]
        window = np.searchsorted(bound.window_first_op, at, side="right") - 1
        assert {int(window[i]) for i in worst} == {int(np.argmax(window_times_us(before, bound.window_first_op)
                                                                   - bound.window_us))}
        assert {int(window[i]) for i in balancing} == set(np.flatnonzero(above).tolist())
        for w in np.flatnonzero(above):
            # every move is on the SSD: x bytes off it even the two out at x = ssd * host_bw / (both)
            ssd = sum(m.size_bytes for i, m in enumerate(moves)
                      if window[i] == w and (m.reads_back or side == "write"))
            even = ssd * bw[f"host_{side}"] / (bw[f"ssd_{side}"] + bw[f"host_{side}"])
            sent = sum(moves[i].size_bytes for i in balancing if window[i] == w)
            assert 0 < sent <= 1.5 * even
