"""The greedy planner on hand-built profiles, the capacity error, and lazy == eager."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner import Hardware, InfeasibleBudgetError, greedy, plan_greedy, plan_rank, problem_from_profile
from planner.greedy import _Planner
from profiles.synthetic import synthetic_profile
from tests.planner.helpers import make_profile

GB = 1e9


def two_tensor_profile():
    """Ten 100 us ops. A (100 B, persistent) idle over ops 1-8; B (100 B, alive over ops 2-6)
    idle over ops 3-5; C (10 B) used by every op. Memory: 110 B, 210 B over ops 2-6."""
    accesses = [(0, 0), (9, 0), (2, 1), (6, 1)] + [(k, 2) for k in range(10)]
    return make_profile([100.0] * 10, [{"tensor_id": 0, "size_bytes": 100},
                                       {"tensor_id": 1, "size_bytes": 100, "persistent": False,
                                        "alloc_op": 2, "free_op": 7},
                                       {"tensor_id": 2, "size_bytes": 10}], accesses)


def hw(capacity: int, bw: float = 1e7, host: int = 0) -> Hardware:
    # 1e7 B/s moves 1000 B per 100 us op: transfers of 100 B take a tenth of an op.
    return Hardware(gpu_mem_bytes=capacity, ssd_read_bw_bytes_per_s=bw, ssd_write_bw_bytes_per_s=bw,
                    host_bw_bytes_per_s=bw, host_mem_bytes=host)


def test_nothing_moves_when_memory_fits() -> None:
    problem = problem_from_profile(two_tensor_profile())
    assert plan_greedy(problem, hw(210)) == []


def test_offloads_the_longest_idle_tensor_first() -> None:
    problem = problem_from_profile(two_tensor_profile())
    moves = plan_greedy(problem, hw(150))
    assert [m.tensor_id for m in moves] == [0]  # A covers the whole over-capacity stretch
    m = moves[0]
    assert (m.offload_trigger, m.offload_deadline, m.prefetch_trigger, m.prefetch_deadline) == (1, 2, 8, 9)
    result = plan_rank(problem, hw(150))
    assert result.sim.fits and result.sim.stall_us == 0
    assert result.sim.iteration_us == pytest.approx(1000.0)


def test_capacity_below_one_op_names_the_op_and_bytes() -> None:
    problem = problem_from_profile(two_tensor_profile())
    # Op 0 uses A (100) and C (10): 110 bytes must be resident.
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_greedy(problem, hw(105))
    assert err.value.op_index == 0 and err.value.op_name == "op0"
    assert err.value.need_bytes == 110
    assert "op 0 (op0) needs 110 bytes" in str(err.value) and "105 bytes" in str(err.value)
    assert isinstance(err.value, ValueError)
    assert "inside itself" not in str(err.value)
    assert str(err.value).endswith("raise --gpu-mem to that (`--gpu-mem min` plans at it) or shrink the batch")
    # an optimizer step over every parameter at once: the batch is not in it (a sweep's fused AdamW)
    fused = InfeasibleBudgetError(117, "aten._fused_adamw_.default", 6_656_012, 6_656_012, 4_000_000, 0, "optimizer")
    assert "shrink the batch" not in str(fused) and "foreach=False" in str(fused)
    assert str(InfeasibleBudgetError(3, "aten.addcdiv_.Tensor", 9, 9, 8, 0, "optimizer")).endswith("plans at it)")


def test_capacity_below_one_op_counts_its_scratch() -> None:
    prof = two_tensor_profile()
    prof = dataclasses.replace(prof, kernels=prof.kernels.assign(scratch_bytes=[30] + [0] * (len(prof.kernels) - 1)))
    with pytest.raises(InfeasibleBudgetError) as err:  # NOTE [ Scratch ]: 110 + 30 bytes at op 0
        plan_greedy(problem_from_profile(prof), hw(135))
    assert err.value.need_bytes == 140 and err.value.scratch_bytes == 30
    assert "110 bytes of its own inputs and outputs, 30 it allocates inside itself" in str(err.value)


def test_slow_bandwidth_plans_stalls_that_become_urgent() -> None:
    problem = problem_from_profile(two_tensor_profile())
    result = plan_rank(problem, hw(150, bw=1e5))  # 10 B per op: a 100 B transfer takes 10 ops
    assert result.sim.fits
    assert result.sim.stall_us > 0
    assert any(m.urgent_offload or m.urgent_prefetch for m in result.moves)


def test_host_memory_is_used_when_the_ssd_is_too_slow() -> None:
    problem = problem_from_profile(two_tensor_profile())
    slow_ssd = Hardware(gpu_mem_bytes=150, ssd_read_bw_bytes_per_s=1e4, ssd_write_bw_bytes_per_s=1e4,
                        host_bw_bytes_per_s=1e7, host_mem_bytes=1000)
    moves = plan_greedy(problem, slow_ssd)
    assert [m.target for m in moves] == ["host"]


def test_a_trailing_host_copy_is_held_through_the_op_its_storage_dies_at() -> None:
    """T (100 B) dies at op 4 after its last use at op 0; U (100 B) is idle over ops 4-7.
    The simulator starts op 4's offloads before it drops T's copy, so with room for one
    100 B copy on the host T and U's offload at op 4 cannot both go there."""
    accesses = [(0, 0), (3, 1), (8, 1), (5, 2), (6, 2)] + [(k, 3) for k in range(10)]
    profile = make_profile([100.0] * 10, [
        {"tensor_id": 0, "size_bytes": 100, "persistent": False, "alloc_op": 0, "free_op": 4},
        {"tensor_id": 1, "size_bytes": 100},
        {"tensor_id": 2, "size_bytes": 100, "persistent": False, "alloc_op": 5, "free_op": 7},
        {"tensor_id": 3, "size_bytes": 10}], accesses)
    slow_ssd = Hardware(gpu_mem_bytes=150, ssd_read_bw_bytes_per_s=1e3, ssd_write_bw_bytes_per_s=1e3,
                        host_bw_bytes_per_s=1e7, host_mem_bytes=100)
    result = plan_rank(problem_from_profile(profile), slow_ssd)
    assert result.sim.fits
    assert result.sim.host_peak_bytes <= 100


def _eager_ssd_choices(planner: _Planner) -> list[int]:
    """Algorithm 1 as written: re-score every candidate each round (SSD only)."""
    p = planner.p
    chosen = []
    while planner.excess.num_over > 0:
        cand = np.flatnonzero(~planner.selected & (p.end_op - p.start_op >= 4))
        score, first, start = planner._scores(cand, "ssd")
        entries = zip(-score, -p.size_bytes[cand].astype(float), cand.tolist(), first, start, strict=True)
        best = min((e for e in entries if e[0] < 0), default=None)
        if best is None:
            break
        planner._accept(best[2], "ssd", best[3], best[4])
        chosen.append(best[2])
    return chosen


@pytest.mark.parametrize("seed", range(6))
def test_lazy_queue_makes_the_same_choices_as_rescoring_everything(seed: int) -> None:
    problem = problem_from_profile(synthetic_profile(3, 4, 2, num_extra=3, seed=seed))
    peak = int(problem.memory_bytes.max())
    rng = np.random.default_rng(seed)
    h = hw(int(peak * rng.uniform(0.6, 0.95)), bw=rng.uniform(4, 64) * GB)
    lazy = _Planner(problem, h)
    lazy.greedy_stage("ssd", tolerance=0.0)
    eager = _Planner(problem, h)
    assert [m.period for m in lazy.moves] == _eager_ssd_choices(eager)


class _CheckedPlanner(_Planner):
    """Checks at each acceptance that the choice scores within ``1 - tolerance`` of the best now."""

    tolerance = 0.0
    num_checked = 0

    def _accept(self, i: int, target: str, first: int, start: int) -> None:
        p = self.p
        cand = np.flatnonzero(~self.selected & (p.end_op - p.start_op >= np.where(p.reads_back, 4, 3)))
        if target == "host":
            cand = np.array([c for c in cand if self._host_fits(int(c))], np.int64)
        score, firsts, starts = self._scores(cand, target)
        mine = int(np.flatnonzero(cand == i)[0])
        assert score[mine] >= (1 - self.tolerance) * score.max() * (1 - 1e-9)
        assert (firsts[mine], starts[mine]) == (first, start)  # the window it is accepted with is current
        for c, sc, f, st in zip(cand.tolist(), score, firsts, starts, strict=True):  # one at a time: the same
            one, f1, st1 = self._score_one(c, target)
            assert (f1, st1) == (f, st) and one == pytest.approx(sc, rel=1e-9, abs=0)
        self.num_checked += 1
        super()._accept(i, target, first, start)


@pytest.mark.parametrize("tolerance", [0.02, 0.1, 0.3])
@pytest.mark.parametrize("seed", range(4))
def test_threshold_levels_choose_within_the_tolerance_of_the_best(seed: int, tolerance: float) -> None:
    problem = problem_from_profile(synthetic_profile(4, 4, 2, num_extra=4, seed=seed))
    peak = int(problem.memory_bytes.max())
    rng = np.random.default_rng(seed)
    h = hw(int(peak * rng.uniform(0.5, 0.9)), bw=rng.uniform(2, 64) * GB, host=peak)
    planner = _CheckedPlanner(problem, h)
    planner.tolerance = tolerance
    planner.greedy_stage("ssd", tolerance)
    planner.greedy_stage("host", tolerance)
    assert planner.num_checked == len(planner.moves) > 0


def test_progress_is_reported_on_long_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(greedy, "_REPORT_EVERY_S", 0.0)  # every move, not every few seconds
    problem = problem_from_profile(synthetic_profile(4, 4, 2, num_extra=4, seed=0))
    lines: list[str] = []
    moves = plan_greedy(problem, hw(int(problem.memory_bytes.max() * 0.6), bw=16 * GB), progress=lines.append)
    # a line per move chosen; relax_deadlines may leave some of them out
    assert len(lines) >= len(moves) > 0
    assert lines[0].startswith("0 moves so far; ") and "ops still over capacity" in lines[-1]
    assert plan_greedy(problem, hw(int(problem.memory_bytes.max() * 0.6), bw=16 * GB)) == moves


def _planned_memory(problem, moves) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Memory per op with each move's bytes free over [offload_deadline, prefetch_trigger)."""
    n = problem.num_ops
    freed = np.zeros(n)
    for m in moves:
        for k in range(m.offload_deadline, m.prefetch_trigger):
            freed[k % n] += m.size_bytes
    return problem.memory_bytes - freed


@pytest.mark.parametrize("share", [0.4, 0.6, 0.8])
def test_deadlines_are_where_the_room_is_needed(share: float) -> None:
    """NOTE [ Deadlines where memory is needed ]: the plan fits counting each move free only from
    its deadline, and no move is there for nothing: without any one of them some op goes over."""
    problem = problem_from_profile(synthetic_profile(4, 4, 2, num_extra=4, seed=0))
    cap = int(problem.memory_bytes.max() * share)
    planner = _Planner(problem, hw(cap, bw=16 * GB))
    planner.greedy_stage("ssd", greedy.DEFAULT_TOLERANCE)
    if planner.excess.num_over:
        planner.fix_with_stalls()
    chosen = list(planner.moves)
    moves = planner.relax_deadlines()
    assert 0 < len(moves) < len(chosen)  # the greedy chose some the others made needless
    by_period = {m.period: m for m in chosen}
    for m in moves:
        assert m.offload_deadline >= by_period[m.period].offload_deadline
        assert m.prefetch_trigger == by_period[m.period].prefetch_trigger
    before, after = _planned_memory(problem, chosen), _planned_memory(problem, moves)
    assert (after <= np.maximum(before, cap)).all() and after.max() <= cap
    n = problem.num_ops
    for i, m in enumerate(moves):  # needed at its deadline (or kept in its own iteration), not for nothing
        wrapped = m.offload_deadline == n - 1 < m.prefetch_trigger
        assert after[m.offload_deadline % n] + m.size_bytes > cap or wrapped
        assert _planned_memory(problem, moves[:i] + moves[i + 1:]).max() > cap
    assert any(m.offload_deadline > by_period[m.period].offload_deadline for m in moves)
    assert plan_rank(problem, hw(cap, bw=16 * GB)).sim.fits
