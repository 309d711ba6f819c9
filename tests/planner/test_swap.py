"""Weights traded with optimizer states where host memory's reads lag (planner.swap)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import Hardware, plan_rank, problem_from_profile
from planner.bound import iteration_bound
from planner.clean import host_held
from planner.greedy import Move, plan_greedy
from planner.problem import PlanProblem
from planner.rebalance import window_times_us
from planner.simulate import simulate
from planner.swap import _lag_bytes, _pairs, swap_weights
from profiles.synthetic import synthetic_profile
from tests.planner.helpers import assert_simulates_its_moves


def _case(host_share: float, seed: int = 1) -> tuple[PlanProblem, list[Move], Hardware]:
    """The greedy's plan with every weight moved to host memory and every other move to the SSD,
    as the greedy leaves weights where the optimizer step's writes fill the SSD; host memory holds
    ``host_share`` of the profile's peak."""
    problem = problem_from_profile(synthetic_profile(8, 6, 3, seed=seed))
    peak = int(problem.memory_bytes.max())
    hw = Hardware(gpu_mem_bytes=int(peak * 0.55), ssd_read_bw_bytes_per_s=2e8, ssd_write_bw_bytes_per_s=2e8,
                  host_bw_bytes_per_s=2e8, host_mem_bytes=max(1, int(peak * host_share)))
    moves = [replace(mv, target="host" if problem.kind[mv.period] == "param" else "ssd")
             for mv in plan_greedy(problem, hw)]
    return problem, moves, hw


def test_weights_read_from_host_memory_trade_places_with_their_optimizer_states() -> None:
    problem, moves, hw = _case(host_share=1.0)
    sim = simulate(problem, moves, hw.channel_bw(), hw.gpu_mem_bytes)
    bound = iteration_bound(problem, hw)
    assert (window_times_us(sim, bound.window_first_op) > bound.window_us).any()
    swapped = swap_weights(problem, moves, sim, hw, bound)
    assert swapped is not None
    assert [replace(b, target=a.target) for a, b in zip(moves, swapped, strict=True)] == moves  # only places
    changed = {b.tensor_id: b.target for a, b in zip(moves, swapped, strict=True) if a.target != b.target}
    names = problem.names
    weights = {tid for tid, target in changed.items() if target == "ssd"}
    states = {tid for tid, target in changed.items() if target == "host"}
    assert weights and all(names[t].count(".") == 2 for t in weights)  # "layers.<i>.w<j>"
    assert all(names[s].endswith((".exp_avg", ".exp_avg_sq")) for s in states)
    # each traded weight's whole chain moved, with one of its own states of its size
    assert {names[s].rsplit(".", 1)[0] for s in states} == {names[w] for w in weights}
    for w in weights:
        assert all(mv.target == "ssd" for mv in swapped if mv.tensor_id == w)
    # host memory holds no more at any op than before
    assert host_held(problem, swapped).max() <= max(host_held(problem, moves).max(), hw.host_mem_bytes)
    # enough weights to even out the lagging window's reads, within one weight, spread over the layers
    size = {mv.tensor_id: mv.size_bytes for mv in moves}
    lag = _lag_bytes(problem, moves, sim, hw, bound)
    assert lag > 0 and abs(sum(size[w] for w in weights) - lag) <= max(size[w] for w in all_weights(moves, problem))
    layers = sorted(int(names[w].split(".")[1]) for w in weights)
    assert layers[-1] - layers[0] >= 4  # of 8


def all_weights(moves: list[Move], problem: PlanProblem) -> set[int]:
    return {mv.tensor_id for mv in moves if problem.kind[mv.period] == "param"}


def test_nothing_to_trade_without_host_memory() -> None:
    problem, moves, hw = _case(host_share=1.0)
    ssd_only = replace(hw, host_mem_bytes=0)
    moves = [replace(mv, target="ssd") for mv in moves]
    sim = simulate(problem, moves, ssd_only.channel_bw(), ssd_only.gpu_mem_bytes)
    assert swap_weights(problem, moves, sim, ssd_only, iteration_bound(problem, ssd_only)) is None


def test_host_memory_never_holds_more_than_it_may() -> None:
    """A state is out from one step to the next; a weight only over the periods moved. Where some
    of a weight's periods stay resident, its state takes more of host memory than it gives back."""
    for seed in range(3):
        problem, moves, hw = _case(host_share=1.0, seed=seed)
        first_period: dict[int, int] = {}
        for mv in moves:
            first_period.setdefault(mv.tensor_id, mv.period)
        # each weight's first period alone moved
        moves = [mv for mv in moves if problem.kind[mv.period] != "param" or first_period[mv.tensor_id] == mv.period]
        before = host_held(problem, moves).max()
        for limit in (before, 1.5 * before):
            tight = replace(hw, host_mem_bytes=int(limit))
            sim = simulate(problem, moves, tight.channel_bw(), tight.gpu_mem_bytes)
            swapped = swap_weights(problem, moves, sim, tight, iteration_bound(problem, tight))
            assert swapped is not None or limit == before
            if swapped is not None:
                assert host_held(problem, swapped).max() <= limit


def test_a_weight_pairs_with_its_own_state_alone() -> None:
    """Only a weight all in host memory pairs, only with a state named after it (not with those of
    a weight whose name it begins: "w" and "w1"), of its size, all on the SSD."""
    problem, moves, _ = _case(host_share=1.0)
    names = dict(problem.names)
    by_name = {name: tid for tid, name in names.items()}
    split, short, mismatched = (by_name[f"layers.{k}.w0"] for k in (1, 2, 3))
    names[short] = "layers.2.w"  # its states stay "layers.2.w0.exp_avg": none is its own
    problem = replace(problem, names=names)
    first = next(i for i, mv in enumerate(moves) if mv.tensor_id == split)
    moves[first] = replace(moves[first], target="ssd")  # the weight is no longer all in host memory
    for key in ("exp_avg", "exp_avg_sq"):  # neither state has the weight's size
        moves = [replace(mv, size_bytes=mv.size_bytes + 1) if mv.tensor_id == by_name[f"layers.3.w0.{key}"] else mv
                 for mv in moves]
    pairs = [(moves[mine[0]].tensor_id, moves[theirs[0]].tensor_id) for mine, theirs in _pairs(problem, moves)]
    paired = {w for w, _ in pairs}
    assert not paired & {split, short, mismatched} and len(paired) >= 10
    assert all(names[s].rsplit(".", 1)[0] == names[w] for w, s in pairs)


def test_plan_rank_keeps_a_trade_that_makes_the_plan_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights read from host memory beside an idle SSD: ``plan_rank`` trades them, runs the passes
    after the greedy again, and keeps the faster plan, its kept copies in pairs of one place each."""
    problem = problem_from_profile(synthetic_profile(8, 6, 3, seed=0, param_bytes=64 << 20))
    peak = int(problem.memory_bytes.max())
    hw = Hardware(gpu_mem_bytes=int(peak * 0.3), ssd_read_bw_bytes_per_s=2e8, ssd_write_bw_bytes_per_s=2e8,
                  host_bw_bytes_per_s=4e8, host_mem_bytes=int(peak * 0.6))
    traded = plan_rank(problem, hw)
    monkeypatch.setattr("planner.make.swap_weights", lambda *_: None)
    untraded = plan_rank(problem, hw)
    assert traded.sim.fits and traded.sim.iteration_us < untraded.sim.iteration_us
    assert traded.sim.host_peak_bytes <= hw.host_mem_bytes
    assert_simulates_its_moves(traded, hw)
    keepers = {(mv.tensor_id, mv.target) for mv in traded.moves if mv.keep_copy}
    assert all((mv.tensor_id, mv.target) in keepers for mv in traded.moves if mv.reuse_copy)
    assert any(mv.reuse_copy for mv in traded.moves)


def test_a_traded_plan_keeps_its_copies_in_pairs_of_one_place() -> None:
    """The trade is made on a finished plan, its copies kept; filling host memory again may send one
    of a traded weight's periods back alone, so the copies are marked again from none: a reuse on
    the SSD whose keeper was in host memory was left (a review's case: a summary that counted a
    write as reused, and a host copy held for nothing)."""
    problem = problem_from_profile(synthetic_profile(4, 2, 1, seed=1, activation_bytes=16 << 20,
                                                     param_bytes=1 << 20, op_us=50.0))
    hw = Hardware(gpu_mem_bytes=31_601_032, ssd_read_bw_bytes_per_s=8e9, ssd_write_bw_bytes_per_s=8e9,
                  host_bw_bytes_per_s=4e9, host_mem_bytes=64 << 20)
    rp = plan_rank(problem, hw)
    keepers = {(mv.tensor_id, mv.target) for mv in rp.moves if mv.keep_copy}
    assert all((mv.tensor_id, mv.target) in keepers for mv in rp.moves if mv.reuse_copy)
    assert any(mv.target == "ssd" for mv in rp.moves if problem.kind[mv.period] == "param")  # traded
