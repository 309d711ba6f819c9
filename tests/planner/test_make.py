"""The passes of ``plan_rank`` after the greedy (planner/make.py)."""

from __future__ import annotations

import pytest

from planner import problem_from_profile
from planner.clean import keep_copies
from planner.greedy import Move
from planner.make import _without_one_op_moves
from planner.simulate import simulate
from tests.planner.helpers import make_profile
from tests.planner.test_bound import hw, two_phase_profile


def _move(problem, start: int, end: int, trigger: int, priority: int,  # type: ignore[no-untyped-def]
          target: str = "ssd") -> Move:
    (i,) = [i for i in range(problem.num_periods) if problem.start_op[i] == start and problem.end_op[i] == end
            and problem.size_bytes[i] >= 300 and problem.reads_back[i]]
    return Move(period=i, tensor_id=int(problem.tensor_id[i]), size_bytes=int(problem.size_bytes[i]),
                target=target, start_op=start, end_op=end, offload_trigger=start + 1, offload_deadline=start + 1,
                prefetch_trigger=trigger, prefetch_deadline=end, priority=priority)


def test_a_move_of_one_op_is_dropped_where_the_plan_fits_without_it() -> None:
    """NOTE [ Moves of one op ]: B (300 B, used at ops 6 and 8) out over op 7 alone, read back as op 8
    comes: op 8 waits for it, and 910 B fit at op 7 without it."""
    problem = problem_from_profile(two_phase_profile())
    h = hw(910, ssd=1e7)
    a = _move(problem, 0, 5, 4, 0)  # A (600 B) out over ops 1-4: 1,110 B there otherwise
    b = _move(problem, 6, 8, 8, 1)

    def sim_of(moves):  # type: ignore[no-untyped-def]
        return simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)

    sim = sim_of([a, b])
    assert sim.fits and sim.stall_us_before[8] == pytest.approx(30.0)
    moves, after = _without_one_op_moves(problem, [a, b], sim, h, sim_of)
    assert moves == [a] and after.fits and after.iteration_us < sim.iteration_us
    assert after.stall_us_before[8] == 0.0


def test_a_move_of_one_op_the_plan_needs_stays() -> None:
    # X (500 B) used at ops 0 and 2; Y (500 B) made and used at op 1: X must be out over op 1
    tensors = [{"tensor_id": 0, "size_bytes": 500},
               {"tensor_id": 1, "size_bytes": 500, "persistent": False, "alloc_op": 1, "free_op": 2}]
    problem = problem_from_profile(make_profile([100.0] * 4, tensors, [(0, 0), (2, 0), (1, 1)]))
    h = hw(600, ssd=1e7)
    x = _move(problem, 0, 2, 2, 0)

    def sim_of(moves):  # type: ignore[no-untyped-def]
        return simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)

    sim = sim_of([x])
    assert sim.fits and not sim_of([]).fits
    moves, after = _without_one_op_moves(problem, [x], sim, h, sim_of)
    assert moves == [x] and after is sim


def test_without_a_move_of_one_op_its_neighbours_share_a_kept_copy() -> None:
    """NOTE [ Moves of one op ]: W (400 B, read at ops 0, 3 and 5 of 8) out over ops 1-2 and 6-7 on the
    SSD, and over op 4 in host memory: the move of op 4 keeps the two others from sharing W's copy, and
    its read makes op 5 wait. Without it, the move over ops 6-7 frees W against the copy the one over
    ops 1-2 kept (NOTE [ Copies kept ] in planner.clean)."""
    problem = problem_from_profile(make_profile([100.0] * 8, [{"tensor_id": 0, "size_bytes": 400}],
                                                [(0, 0), (3, 0), (5, 0)], access="read"))
    h = hw(400, ssd=1e7, host_bw=1e7, host=400)
    first, short, last = _move(problem, 0, 3, 2, 0), _move(problem, 3, 5, 5, 1, "host"), _move(problem, 5, 8, 7, 2)

    def sim_of(moves):  # type: ignore[no-untyped-def]
        return simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)

    moves = keep_copies(problem, [first, short, last], h.host_mem_bytes)
    assert not any(mv.reuse_copy for mv in moves[1:])  # none shares a copy across the host move
    sim = sim_of(moves)
    assert sim.stall_us_before[5] > 0
    after, after_sim = _without_one_op_moves(problem, moves, sim, h, sim_of)
    assert [mv.period for mv in after] == [first.period, last.period]
    assert after[0].keep_copy and after[1].reuse_copy and after_sim.iteration_us < sim.iteration_us
