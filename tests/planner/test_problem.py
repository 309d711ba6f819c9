"""Profile -> planning arrays (planner.problem)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from planner import Hardware, problem_from_profile
from planner.make import plan_rank, summarize
from tests.planner.helpers import make_profile


def _two_iterations(second_op_names: list[str] | None = None):
    prof = make_profile([100.0, 200.0, 300.0], [{"tensor_id": 0, "size_bytes": 8}], [(0, 0), (2, 0)])
    again = prof.kernels.assign(iteration=2, duration_us=[300.0, 200.0, 100.0])
    if second_op_names is not None:
        again = again.assign(op_name=second_op_names)
    return dataclasses.replace(prof, kernels=pd.concat([prof.kernels, again], ignore_index=True))


def test_op_times_are_the_median_of_the_recorded_iterations() -> None:
    prof = _two_iterations()
    assert problem_from_profile(prof).duration_us.tolist() == pytest.approx([200.0, 200.0, 200.0])
    assert problem_from_profile(prof, iteration=2).duration_us.tolist() == [300.0, 200.0, 100.0]  # as asked


def test_an_iteration_of_other_ops_is_left_out_of_the_times() -> None:
    prof = _two_iterations(["op0", "other", "op2"])
    assert problem_from_profile(prof).duration_us.tolist() == [100.0, 200.0, 300.0]


def _with_scratch(scratch: list[int]):
    """Four ops of 1 ms; a (100 B) used at ops 0 and 3, b (50 B) at every op; ``scratch`` per op."""
    prof = make_profile([1000.0] * 4, [{"tensor_id": 0, "size_bytes": 100}, {"tensor_id": 1, "size_bytes": 50}],
                        [(0, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)])
    return dataclasses.replace(prof, kernels=prof.kernels.assign(scratch_bytes=scratch))


def test_an_ops_scratch_is_memory_it_needs_and_room_the_runtime_makes() -> None:
    # NOTE [ Scratch ] in torch_patch.tracer: what an op allocates inside itself counts while it runs
    problem = problem_from_profile(_with_scratch([0, 60, 0, 0]))
    assert problem.memory_bytes.tolist() == [150, 210, 150, 150]
    assert problem.made_bytes.tolist() == [0, 60, 0, 0]
    assert problem_from_profile(_with_scratch([0, 0, 0, 0])).scratch_bytes is None


def test_the_largest_scratch_of_the_recorded_iterations_is_planned_for() -> None:
    prof = _with_scratch([0, 60, 0, 0])
    again = prof.kernels.assign(iteration=2, scratch_bytes=[0, 40, 0, 70])
    prof = dataclasses.replace(prof, kernels=pd.concat([prof.kernels, again], ignore_index=True))
    assert problem_from_profile(prof).scratch_bytes.tolist() == [0, 60, 0, 70]


def test_a_plan_makes_room_for_scratch_and_reports_the_tracked_peak_without_it() -> None:
    hw = Hardware(gpu_mem_bytes=160, ssd_read_bw_bytes_per_s=1e9, ssd_write_bw_bytes_per_s=1e9,
                  host_bw_bytes_per_s=1e9, host_mem_bytes=0)
    assert plan_rank(problem_from_profile(_with_scratch([0, 0, 0, 0])), hw).moves == ()  # 150 B fit
    planned = plan_rank(problem_from_profile(_with_scratch([0, 60, 0, 0])), hw)
    assert [mv.tensor_id for mv in planned.moves] == [0]  # a is out while op 1's scratch is in
    assert planned.sim.fits and planned.sim.resident_bytes[1] == 50 + 60
    s = summarize(planned, hw)
    assert s["max_scratch_bytes"] == 60 and s["peak_after_bytes"] <= 160
    assert s["peak_tracked_after_bytes"] == 150  # ops 0 and 3, with a and b in and no scratch


@pytest.mark.parametrize(("all_reduce_at", "view_at", "tanh_at", "alloc_op", "free_op"), [
    (1, 2, 7, -1, -1),  # in one iteration
    (8, 1, 5, 8, 6),  # made before the boundary (the optimizer's step), viewed after it, freed at op 6
    (8, 1, 5, -1, -1),  # alive throughout
])
def test_a_view_of_a_functional_collectives_result_starts_no_planned_period(
        all_reduce_at: int, view_at: int, tanh_at: int, alloc_op: int, free_op: int) -> None:
    """NOTE [ Busy in a collective ]: the result of ``fc.all_reduce`` runs a view without waiting
    for the collective, so the period from the view to the op that waits (``tanh``) is no more
    planned than one from the collective itself, also where the view comes after the boundary."""
    names = ["aten.mm.default"] * 10
    names[all_reduce_at], names[view_at], names[tanh_at] = (
        "_c10d_functional.all_reduce.default", "aten.view.default", "aten.tanh.default")
    profile = make_profile([10.0] * 10, [{"tensor_id": 2, "size_bytes": 64 << 20, "alloc_op": alloc_op,
                                          "free_op": free_op}],
                           [(all_reduce_at, 2), (view_at, 2), (tanh_at, 2)])
    profile.kernels["op_name"] = names
    problem = problem_from_profile(profile)
    assert view_at not in problem.start_op[problem.tensor_id == 2], problem.start_op
    names[all_reduce_at] = "aten.add.Tensor"  # a result no collective fills: the same period is planned
    profile.kernels["op_name"] = names
    problem = problem_from_profile(profile)
    assert view_at in problem.start_op[problem.tensor_id == 2], problem.start_op


def test_an_input_read_before_its_functional_collective_is_waited_for_starts_no_planned_period() -> None:
    """NOTE [ Busy in a collective ]: ``y = fc.all_gather_tensor(x, ...)`` then ``x * 2`` (op 2),
    before the op that waits for ``y`` (op 6): the gather still reads ``x``, so the period from
    op 2 is no more planned than one from the gather itself; the one from ``x``'s read after the
    wait (op 7) is, and all of them are where no collective reads ``x``."""
    names = ["aten.mm.default"] * 10
    names[2], names[3], names[6], names[7] = (
        "aten.mul.Tensor", "_c10d_functional._wrap_tensor_autograd.default", "aten.tanh.default", "aten.add.Tensor")
    x, y = {"tensor_id": 2, "size_bytes": 64 << 20}, {"tensor_id": 3, "size_bytes": 256 << 20, "alloc_op": 1,
                                                    "free_op": 9}
    profile = make_profile([10.0] * 10, [x, y], [(1, 2), (1, 3), (2, 2), (3, 3), (6, 3), (7, 2)], access="read")
    made = (profile.accesses["op_index"] == 1) & (profile.accesses["tensor_id"] == 3)
    profile.accesses.loc[made, "access"] = "write"  # the gather's result
    for collective in (True, False):  # without, nothing reads it from op 1: the period from op 2 is planned
        names[1] = "_c10d_functional.all_gather_into_tensor.default" if collective else "aten.cat.default"
        profile.kernels["op_name"] = names
        problem = problem_from_profile(profile)
        starts = problem.start_op[problem.tensor_id == 2]
        assert (2 not in starts) == collective and 7 in starts, starts


def test_an_in_place_functional_collective_keeps_its_tensor_busy_until_its_wait() -> None:
    """NOTE [ Busy in a collective ]: ``all_reduce_(x)`` fills ``x`` in place until the explicit
    ``wait_tensor(x)`` at op 2; from the wait on, ``x``'s periods are planned (with no result of its
    own, the collective once kept every later period busy to the iteration's end)."""
    names = ["aten.mm.default"] * 12
    names[1], names[2], names[3] = ("_c10d_functional.all_reduce_.default", "_c10d_functional.wait_tensor.default",
                                    "aten.mul.Tensor")
    profile = make_profile([10.0] * 12, [{"tensor_id": 2, "size_bytes": 64 << 20}], [(1, 2), (2, 2), (3, 2), (10, 2)])
    profile.kernels["op_name"] = names
    problem = problem_from_profile(profile)
    starts = problem.start_op[problem.tensor_id == 2]
    assert 1 not in starts and 3 in starts and 10 in starts, starts
