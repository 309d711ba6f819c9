"""Baselines in the simulator: ideal, activation offload, ZeRO-Offload/Infinity."""

from __future__ import annotations

import pytest

from planner import Hardware, plan_rank, problem_from_profile
from planner.baselines import activation_offload, ideal, layer_of_ops, run_baselines, zero_problem
from profiles.synthetic import synthetic_profile


@pytest.fixture(scope="module")
def prof():
    return synthetic_profile(4, 6, 3, seed=1)


def hw_for(problem, frac: float, bw: float = 32e9, host: int = 0) -> Hardware:
    return Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * frac), ssd_read_bw_bytes_per_s=bw,
                    ssd_write_bw_bytes_per_s=bw, host_mem_bytes=host)


def test_ideal_is_the_ops_back_to_back(prof) -> None:
    problem = problem_from_profile(prof)
    rp = ideal(problem)
    assert rp.sim.iteration_us == pytest.approx(problem.duration_us.sum())
    assert rp.sim.peak_bytes == problem.memory_bytes.max() and rp.sim.stall_us == 0


def test_layers_come_from_module_paths(prof) -> None:
    problem = problem_from_profile(prof)
    seg, start = layer_of_ops(problem)
    assert seg[0] == 0 and len(start) >= 2 * 4  # forward and backward of each of 4 layers


def test_activation_offload_moves_only_saved_activations_to_ssd(prof) -> None:
    problem = problem_from_profile(prof)
    rp = activation_offload(problem, hw_for(problem, 0.8))
    assert rp.moves
    assert all(problem.kind[m.period] == "activation" and m.target == "ssd" for m in rp.moves)
    assert rp.sim.peak_bytes < problem.memory_bytes.max()


def test_zero_runs_the_optimizer_on_the_cpu(prof) -> None:
    problem = problem_from_profile(prof)
    hw = hw_for(problem, 0.9, host=64 << 30)
    zp, name = zero_problem(prof, hw)
    assert name == "zero_offload"
    assert "optimizer_state" not in set(zp.kind)
    opt = zp.phase == "optimizer"
    num_params = prof.tensors.loc[prof.tensors["kind"] == "param", "size_bytes"].sum() / 4
    assert zp.duration_us[opt].sum() == pytest.approx(num_params / hw.cpu_adam_params_per_s * 1e6)
    assert zp.memory_bytes.max() < problem.memory_bytes.max()
    assert zero_problem(prof, hw_for(problem, 0.9, host=0))[1] == "zero_infinity"


def test_baselines_and_planner_side_by_side(prof) -> None:
    problem = problem_from_profile(prof)
    hw = hw_for(problem, 0.7)
    rows = {"planner": plan_rank(problem, hw), **run_baselines(prof, problem, hw)}
    assert set(rows) == {"planner", "ideal", "activation_offload", "zero_infinity"}
    for rp in rows.values():  # every ratio is against the same ideal
        assert rp.sim.ideal_iteration_us == pytest.approx(problem.ideal_iteration_us)
    assert rows["planner"].sim.fits
