"""Properties of planned and simulated iterations on random synthetic profiles (hypothesis)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import Hardware, InfeasibleBudgetError, plan_rank, problem_from_profile
from planner.greedy import _Planner
from planner.problem import resident_need_bytes
from profiles.synthetic import synthetic_profile
from tests.planner.helpers import assert_simulates_its_moves

GB = 1e9


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    layers = draw(st.integers(1, 4))
    per_layer = draw(st.integers(2, 6))
    params = draw(st.integers(1, per_layer))
    profile = synthetic_profile(
        layers, per_layer, params, num_extra=draw(st.integers(0, 4)), seed=draw(st.integers(0, 10_000)),
        activation_bytes=draw(st.sampled_from([1 << 20, 16 << 20, 64 << 20])),
        param_bytes=draw(st.sampled_from([1 << 20, 16 << 20])), op_us=draw(st.sampled_from([50.0, 500.0])),
    )
    scratch_seed = draw(st.one_of(st.none(), st.integers(0, 10_000)))
    if scratch_seed is not None:  # NOTE [ Scratch ]: what some ops allocate inside themselves
        rng = np.random.default_rng(scratch_seed)
        n = len(profile.kernels)
        scratch = np.where(rng.random(n) < 0.2, rng.integers(1, 64 << 20, n), 0)
        profile = dataclasses.replace(profile, kernels=profile.kernels.assign(scratch_bytes=scratch))
    problem = problem_from_profile(profile)
    need = int(resident_need_bytes(problem).max())
    peak = int(problem.memory_bytes.max())
    capacity = int(need + draw(st.floats(0.0, 1.0)) * (peak - need))
    bw = draw(st.sampled_from([1.0, 8.0, 64.0])) * GB
    hw = Hardware(gpu_mem_bytes=max(capacity, 1), ssd_read_bw_bytes_per_s=bw,
                  ssd_write_bw_bytes_per_s=bw * draw(st.sampled_from([0.5, 1.0])),
                  host_bw_bytes_per_s=draw(st.sampled_from([4.0, 25.0])) * GB,
                  host_mem_bytes=draw(st.sampled_from([0, 64 << 20, 1 << 30])))
    return profile, problem, hw


SETTINGS = settings(max_examples=int(os.environ.get("TERAIO_HYPOTHESIS_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_simulated_memory_never_exceeds_capacity(case: tuple) -> None:
    _, problem, hw = case
    result = plan_rank(problem, hw)
    assert result.sim.peak_bytes <= hw.gpu_mem_bytes
    assert result.sim.iteration_us >= problem.ideal_iteration_us * (1 - 1e-9)


@SETTINGS
@given(cases())
def test_prefetches_are_on_time_or_urgent_with_the_stall_counted(case: tuple) -> None:
    _, problem, hw = case
    result = plan_rank(problem, hw)
    assert_simulates_its_moves(result, hw)
    sim, n = result.sim, problem.num_ops
    for i, mv in enumerate(result.moves):
        if i in sim.waited_prefetches or i in sim.waited_offloads:
            assert sim.stall_us > 0  # urgency: test_simulate's test of ``settled``
        if not result.settled:
            continue
        same_iteration = mv.prefetch_trigger // n == mv.prefetch_deadline // n
        if not mv.urgent_prefetch and same_iteration and not np.isnan(sim.prefetch_us[i, 1]):
            assert sim.prefetch_us[i, 1] <= sim.op_start_us[mv.prefetch_deadline % n] + 1e-6


@SETTINGS
@given(cases())
def test_no_tensor_moves_while_active(case: tuple) -> None:
    profile, problem, hw = case
    result = plan_rank(problem, hw)
    n = problem.num_ops
    used = profile.accesses.groupby("tensor_id")["op_index"].apply(set).to_dict()
    sim = result.sim
    for i, mv in enumerate(result.moves):
        assert mv.start_op < mv.offload_trigger <= mv.prefetch_trigger <= mv.prefetch_deadline == mv.end_op
        assert mv.offload_trigger <= mv.offload_deadline <= mv.end_op
        inside = {k % n for k in range(mv.start_op + 1, mv.end_op)}
        assert not inside & used[mv.tensor_id]
        if mv.end_op >= n or np.isnan(sim.offload_us[i, 0]):
            continue
        # the simulated transfers run between the end of the last use and the start of the next
        last_use_end = sim.op_start_us[mv.start_op] + problem.duration_us[mv.start_op]
        assert sim.offload_us[i, 0] >= last_use_end - 1e-6
        if not np.isnan(sim.prefetch_us[i, 1]) and not mv.urgent_prefetch and result.settled:
            assert sim.prefetch_us[i, 1] <= sim.op_start_us[mv.end_op] + 1e-6


@SETTINGS
@given(cases())
def test_reserved_bandwidth_never_exceeds_the_channel(case: tuple) -> None:
    _, problem, hw = case
    try:
        planner = _Planner(problem, hw)
    except InfeasibleBudgetError:
        return
    planner.greedy_stage("ssd")
    if hw.host_mem_bytes:
        planner.greedy_stage("host")
    for channel in planner.channels.values():
        assert min(channel.free) >= -1e-3
    result = plan_rank(problem, hw)
    for name, bw in hw.channel_bw().items():  # and the simulator moves no more than bw * time
        assert result.sim.bytes_moved[name] <= bw * result.sim.iteration_us * 1e-6 * (1 + 1e-9) + 1


@SETTINGS
@given(cases())
def test_host_memory_never_exceeds_its_limit(case: tuple) -> None:
    _, problem, hw = case
    result = plan_rank(problem, hw)
    assert result.sim.host_peak_bytes <= hw.host_mem_bytes
    if hw.host_mem_bytes == 0:
        assert all(mv.target == "ssd" for mv in result.moves)
