"""Unchanged periods and kept copies (NOTE [ Copies kept ] in planner.clean): which periods the
profile allows, what the planner marks, what the simulator charges."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given

from planner import Hardware, plan_rank, problem_from_profile
from planner.clean import host_held, keep_copies
from planner.greedy import Move
from planner.problem import PlanProblem, previous_periods, resident_need_bytes
from planner.simulate import simulate
from profiles.synthetic import synthetic_profile
from tests.planner.helpers import make_profile
from tests.planner.test_properties import SETTINGS, cases

SIZE = 1 << 20


def weight_profile():
    """Ten 100 us ops. W (1 MiB, persistent) is read at ops 0 (forward) and 4 (backward) and
    written at op 7 (the optimizer); X (1 MiB) is written at op 0 and read at op 5."""
    prof = make_profile([100.0] * 10, [{"tensor_id": 0, "size_bytes": SIZE}, {"tensor_id": 1, "size_bytes": SIZE}],
                        [(0, 0), (4, 0), (7, 0), (0, 1), (5, 1)], access="read")
    acc = prof.accesses
    acc.loc[((acc["op_index"] == 7) & (acc["tensor_id"] == 0)) | ((acc["op_index"] == 0) & (acc["tensor_id"] == 1)),
            "access"] = "write"
    return prof


def period(problem: PlanProblem, tid: int, start: int) -> int:
    return int(np.flatnonzero((problem.tensor_id == tid) & (problem.start_op == start))[0])


def moves_of(problem: PlanProblem, target: str = "ssd") -> list[Move]:
    """Every period moved: out right after its start, back right before its end."""
    return [Move(period=i, tensor_id=int(problem.tensor_id[i]), size_bytes=int(problem.size_bytes[i]),
                 target=target, start_op=int(problem.start_op[i]), end_op=int(problem.end_op[i]),
                 offload_trigger=int(problem.start_op[i]) + 1, offload_deadline=-1,
                 prefetch_trigger=int(problem.end_op[i]) - 1, prefetch_deadline=int(problem.end_op[i]),
                 priority=i) for i in range(problem.num_periods)]


def test_a_period_is_unchanged_when_nothing_wrote_its_storage_since_the_last_one() -> None:
    problem = problem_from_profile(weight_profile())
    assert problem.unchanged is not None
    # W: [0, 4] follows [7, 10] (of the iteration before), with only the read at 0 between: unchanged.
    # [4, 7] follows [0, 4] with the read at 4: unchanged. [7, 10] follows the write at 7: not.
    assert problem.unchanged[period(problem, 0, 0)] and problem.unchanged[period(problem, 0, 4)]
    assert not problem.unchanged[period(problem, 0, 7)]
    # X is written at 0 and read at 5: [0, 5] follows the write, [5, 10] only the read at 5.
    assert not problem.unchanged[period(problem, 1, 0)] and problem.unchanged[period(problem, 1, 5)]
    prev = previous_periods(problem.tensor_id, problem.start_op)
    assert prev[period(problem, 0, 0)] == period(problem, 0, 7)
    assert prev[period(problem, 0, 4)] == period(problem, 0, 0)


def test_a_storage_made_again_is_not_the_one_that_went_out() -> None:
    # T is made at op 5 (first seen as an input: no write), read at 50 and 150, and freed at 151,
    # right after its last read (no trailing period): its first period follows its death.
    prof = make_profile([10.0] * 200, [{"tensor_id": 0, "size_bytes": SIZE, "persistent": False,
                                        "alloc_op": 5, "free_op": 151}], [(5, 0), (50, 0), (150, 0)],
                        access="read")
    problem = problem_from_profile(prof)
    assert problem.unchanged is not None
    assert not problem.unchanged[period(problem, 0, 5)] and problem.unchanged[period(problem, 0, 50)]


def test_kept_copies_write_a_weight_once_an_iteration() -> None:
    problem = problem_from_profile(weight_profile())
    moves = [mv for mv in moves_of(problem) if mv.tensor_id == 0]
    bw = dict.fromkeys(("ssd_write", "ssd_read", "host_write", "host_read"), 1e12)
    plain = simulate(problem, moves, bw, np.inf)
    kept = keep_copies(problem, moves, 0)
    by_start = {mv.start_op: mv for mv in kept}
    # the prefetches before the unchanged periods keep their copies, and those periods reuse them
    assert by_start[7].keep_copy and by_start[0].reuse_copy and by_start[0].keep_copy and by_start[4].reuse_copy
    assert not by_start[7].reuse_copy and not by_start[4].keep_copy
    sim = simulate(problem, kept, bw, np.inf)
    assert plain.bytes_moved["ssd_write"] == 3 * SIZE
    assert sim.bytes_moved["ssd_write"] == SIZE  # only after the optimizer's write
    assert sim.bytes_moved["ssd_read"] == plain.bytes_moved["ssd_read"] == 3 * SIZE
    # the first iteration has no copy from the one before: [0, 4] is written too
    assert simulate(problem, kept, bw, np.inf, num_iterations=1).bytes_moved["ssd_write"] == 2 * SIZE


def test_no_copy_is_kept_across_places() -> None:
    problem = problem_from_profile(weight_profile())
    moves = [mv for mv in moves_of(problem) if mv.tensor_id == 0]
    moves = [replace(mv, target="host") if mv.start_op == 0 else mv for mv in moves]
    kept = keep_copies(problem, moves, 1 << 40)
    # [0, 4] on host follows [7, 10] on the SSD, and [4, 7] on the SSD follows it: no pair
    assert not any(mv.reuse_copy or mv.keep_copy for mv in kept)


@SETTINGS
@given(cases())
def test_kept_copies_stay_within_host_memory(case: tuple) -> None:
    _, problem, hw = case
    rp = plan_rank(problem, hw)
    assert problem.unchanged is not None
    assert rp.sim.host_peak_bytes <= hw.host_mem_bytes
    if any(mv.target == "host" for mv in rp.moves):
        assert host_held(problem, rp.moves).max() <= hw.host_mem_bytes
    # every reuse has a keeper of the same storage and place before it, and no keeper is idle
    keepers = {(mv.tensor_id, mv.target) for mv in rp.moves if mv.keep_copy}
    assert all((mv.tensor_id, mv.target) in keepers for mv in rp.moves if mv.reuse_copy)


def test_a_plan_of_weights_larger_than_activations_reuses_their_copies() -> None:
    profile = synthetic_profile(4, 4, 2, seed=1, activation_bytes=1 << 20, param_bytes=16 << 20, op_us=500.0)
    problem = problem_from_profile(profile)
    need = int(resident_need_bytes(problem).max())
    hw = Hardware(gpu_mem_bytes=need, ssd_read_bw_bytes_per_s=8e9, ssd_write_bw_bytes_per_s=8e9)
    rp = plan_rank(problem, hw)
    reused = [mv for mv in rp.moves if mv.reuse_copy]
    assert rp.sim.fits and reused and problem.unchanged is not None
    assert all(problem.unchanged[mv.period] for mv in reused)
    without = simulate(problem, [replace(mv, reuse_copy=False, keep_copy=False) for mv in rp.moves],
                       hw.channel_bw(), hw.gpu_mem_bytes)
    assert rp.sim.bytes_moved["ssd_write"] < without.bytes_moved["ssd_write"]
