"""Prefetches started early where there is room and served by deadline (planner.early)."""

from __future__ import annotations

from hypothesis import given

from planner import Hardware, plan_rank, problem_from_profile
from planner.early import by_deadline, prefetch_early
from planner.greedy import Move, plan_greedy
from planner.problem import PlanProblem
from planner.simulate import simulate
from profiles.synthetic import synthetic_profile
from tests.planner.test_properties import SETTINGS, cases


def read_bound_case() -> tuple[PlanProblem, Hardware]:
    """A synthetic profile at 70% of its peak, 8 GB/s each way: its backward reads late and stalls."""
    problem = problem_from_profile(synthetic_profile(8, 6, 3, seed=1))
    return problem, Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.7),
                             ssd_read_bw_bytes_per_s=8e9, ssd_write_bw_bytes_per_s=8e9)


def assert_only_earlier_and_after_the_offload(problem: PlanProblem, before: list[Move], after: list[Move]) -> int:
    """Each prefetch starts no later than it did, after its offload started, in the same iteration;
    nothing else changes. Returns how many start earlier."""
    n, earlier = problem.num_ops, 0
    for a, b in zip(before, after, strict=True):
        assert b.prefetch_trigger <= a.prefetch_trigger
        assert b.prefetch_trigger // n == a.prefetch_trigger // n
        if b.prefetch_trigger < a.prefetch_trigger:
            assert a.reads_back and b.prefetch_trigger > b.offload_trigger
            earlier += 1
        assert (b.offload_trigger, b.prefetch_deadline, b.priority, b.target) == \
            (a.offload_trigger, a.prefetch_deadline, a.priority, a.target)
    return earlier


def test_prefetches_start_where_there_is_room_and_the_iteration_gets_faster() -> None:
    problem, h = read_bound_case()
    moves = plan_greedy(problem, h)
    sim = simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)
    early = prefetch_early(problem, moves, sim, h.gpu_mem_bytes)
    assert assert_only_earlier_and_after_the_offload(problem, moves, early) >= 3
    # On the memory curve the moves before them left: each still fits where it now starts.
    after = simulate(problem, by_deadline(early, problem.num_ops), h.channel_bw(), h.gpu_mem_bytes)
    assert after.fits and after.iteration_us < sim.iteration_us * 0.97  # measured: 400.0 -> 381.3 ms
    assert after.stall_us < sim.stall_us


def test_prefetches_are_served_in_the_order_of_their_deadlines() -> None:
    problem, h = read_bound_case()
    greedy = plan_greedy(problem, h)
    n = problem.num_ops
    moves = by_deadline(greedy, n)
    reads = sorted(moves, key=lambda m: m.read_priority)
    # deadlines and starts counted from the iteration that triggers each: most prefetches here are
    # triggered in the iteration after their offload's, beside that iteration's own
    keys = [(m.prefetch_deadline - m.prefetch_trigger // n * n, m.prefetch_trigger % n) for m in reads]
    assert keys == sorted(keys)
    assert sum(m.prefetch_trigger >= n for m in moves) > len(moves) // 2
    assert sorted(m.read_priority for m in moves) == list(range(len(moves)))
    assert [m.priority for m in moves] == [m.priority for m in greedy]  # offloads keep the greedy's order


def test_serving_by_deadline_keeps_a_plan_that_met_every_deadline_on_time() -> None:
    # review: ranked by deadlines counted from the offload's iteration, the prefetches triggered in
    # the next iteration went behind that iteration's own, and 4 of them were late
    problem = problem_from_profile(synthetic_profile(4, 6, 2, num_extra=1, seed=0, activation_bytes=64 << 20,
                                                     param_bytes=1 << 20, op_us=500))
    h = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.65), ssd_read_bw_bytes_per_s=64e9,
                 ssd_write_bw_bytes_per_s=64e9)
    moves = plan_greedy(problem, h)
    before = simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)
    assert before.stall_us == 0
    after = simulate(problem, by_deadline(moves, problem.num_ops), h.channel_bw(), h.gpu_mem_bytes)
    assert after.stall_us == 0 and after.iteration_us == before.iteration_us


def test_a_plan_served_by_deadline_marks_only_prefetches_across_the_boundary_urgent() -> None:
    problem, h = read_bound_case()
    rp = plan_rank(problem, h)
    n = problem.num_ops
    assert rp.sim.fits and rp.sim.waited_prefetches  # ops still wait on some reads ...
    # ... each served first by its deadline but one due in the iteration after its trigger's, which
    # ranks behind that iteration's own
    assert all(m.prefetch_trigger // n != m.prefetch_deadline // n for m in rp.moves if m.urgent_prefetch)
    assert any(not m.urgent_prefetch for i, m in enumerate(rp.moves) if i in rp.sim.waited_prefetches)
    assert any(m.urgent_offload for m in rp.moves)
    due = [m.prefetch_deadline - m.prefetch_trigger // n * n for m in sorted(rp.moves, key=lambda m: m.read_priority)]
    assert due == sorted(due)


@SETTINGS
@given(cases())
def test_prefetches_only_move_earlier_after_their_offload(case: tuple) -> None:
    _, problem, h = case
    moves = plan_greedy(problem, h)
    sim = simulate(problem, moves, h.channel_bw(), h.gpu_mem_bytes)
    early = prefetch_early(problem, moves, sim, h.gpu_mem_bytes)
    assert_only_earlier_and_after_the_offload(problem, moves, early)
    # Where a prefetch moved, the simulated memory curve plus the bytes it now holds earlier fits.
    n, extra = problem.num_ops, sim.resident_bytes.astype(float)
    for a, b in zip(moves, early, strict=True):
        for k in range(b.prefetch_trigger, a.prefetch_trigger):
            extra[k % n] += a.size_bytes
    assert extra.max() <= max(h.gpu_mem_bytes, sim.resident_bytes.max())
