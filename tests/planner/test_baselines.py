"""Baselines in the simulator: ideal, activation offload, ZeRO-Offload/Infinity."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner import Hardware, plan_rank, problem_from_profile
from planner.baselines import (
    _one_layer_ahead,
    activation_offload,
    checkpointed,
    ideal,
    layer_of_ops,
    run_baselines,
    zero_offload,
    zero_problem,
)
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
    param_bytes = prof.tensors.loc[prof.tensors["kind"] == "param", "size_bytes"].sum()
    # The CPU step, then the updated parameters back to the device (ZeRO-Offload keeps them there).
    assert zp.duration_us[opt].sum() == pytest.approx(
        param_bytes / 4 / hw.cpu_adam_params_per_s * 1e6 + param_bytes / hw.host_bw_bytes_per_s * 1e6)
    assert zp.memory_bytes.max() < problem.memory_bytes.max()
    assert zero_problem(prof, hw_for(problem, 0.9, host=0))[1] == "zero_infinity"


def test_on_a_cpu_profile_no_baseline_steps_faster_than_the_cpu_did(prof) -> None:
    """A CPU profile's step already ran on the CPU that ZeRO would run it on: its measured time,
    not a server's CPU-Adam bound (which made every ZeRO baseline faster than keeping everything)."""
    kernels = prof.kernels.copy()
    opt = kernels["phase"] == "optimizer"
    kernels.loc[opt, "duration_us"] *= 1000  # a CPU's step: far from a server's CPU-Adam bound
    cpu = replace(prof, meta={**prof.meta, "device_type": "cpu"}, kernels=kernels)
    problem = problem_from_profile(cpu)
    hw = hw_for(problem, 0.9, host=64 << 30)
    zp, _ = zero_problem(cpu, hw)
    assert zp.duration_us[zp.phase == "optimizer"].sum() >= problem.duration_us[problem.phase == "optimizer"].sum()
    for name, rp in run_baselines(cpu, problem, hw).items():
        assert rp.sim.iteration_us >= problem.ideal_iteration_us * (1 - 1e-9), name


def test_baselines_and_planner_side_by_side(prof) -> None:
    problem = problem_from_profile(prof)
    hw = hw_for(problem, 0.7)
    rows = {"planner": plan_rank(problem, hw), **run_baselines(prof, problem, hw)}
    # No host memory: no ZeRO-Offload; ZeRO-Infinity (with checkpointing if it needs it).
    assert {"planner", "ideal", "activation_offload"} <= set(rows)
    assert len(rows) == 4 and any(k in rows for k in ("zero_infinity", "zero_infinity+ckpt"))
    for rp in rows.values():  # every ratio is against the same ideal
        assert rp.sim.ideal_iteration_us == pytest.approx(problem.ideal_iteration_us)
    assert rows["planner"].sim.fits


def without_backward_modules(prof):
    """``prof`` as a real profile records it: backward ops run in the autograd engine, with no module."""
    k = prof.kernels.copy()
    k.loc[k["phase"] != "forward", "module"] = None
    return replace(prof, kernels=k)


def test_backward_layers_come_from_the_tensors_they_read(prof) -> None:
    problem = problem_from_profile(without_backward_modules(prof))
    seg, start = layer_of_ops(problem)
    # Forward: 4 layers; backward: the same 4 in reverse, each its own segment; then the optimizer.
    bwd = [int(x) for x in start if problem.phase[x] == "backward"]
    assert len(bwd) == 4
    with_modules = problem_from_profile(prof)
    assert [int(x) for x in layer_of_ops(with_modules)[1] if with_modules.phase[x] == "backward"] == bwd


def test_activation_offload_prefetches_during_backward_one_layer_ahead(prof) -> None:
    # Without backward layers every prefetch started when the forward's last layer did, before the
    # peak at the end of forward, and the peak stayed where it was (NOTE [ Layers in backward ]).
    problem = problem_from_profile(without_backward_modules(prof))
    rp = activation_offload(problem, hw_for(problem, 0.8, bw=256e9))
    n = problem.num_ops
    assert rp.moves and all(problem.phase[m.prefetch_trigger % n] == "backward" for m in rp.moves)
    seg, _ = layer_of_ops(problem)
    first_backward = int(np.flatnonzero(problem.phase == "backward")[0])
    for m in rp.moves:  # fetched when the backward layer before the one that reads it starts
        ahead = int(_one_layer_ahead(problem, np.array([m.end_op]))[0])
        assert m.prefetch_trigger == max(ahead, first_backward)
        assert seg[m.prefetch_trigger % n] + 1 == seg[m.end_op % n] or m.prefetch_trigger == first_backward
    assert rp.sim.peak_bytes < problem.memory_bytes.max()


def test_checkpointing_frees_block_activations_and_recomputes_the_block(prof) -> None:
    problem = problem_from_profile(prof)
    ck = checkpointed(problem, prof)
    assert ck.memory_bytes.max() < problem.memory_bytes.max()
    assert (ck.memory_bytes <= problem.memory_bytes).all()
    # Every recomputed activation is a forward op's output of one layer: the whole forward again.
    fwd = problem.phase == "forward"
    assert ck.duration_us.sum() == pytest.approx(problem.duration_us.sum() + problem.duration_us[fwd].sum())
    assert "activation" not in set(ck.kind[(ck.end_op - ck.start_op >= 2)
                                           & (ck.phase[ck.start_op % ck.num_ops] == "forward")
                                           & (ck.phase[ck.end_op % ck.num_ops] == "backward")])


def test_zero_infinity_drops_parameters_free_and_never_reads_gradients_back(prof) -> None:
    problem = problem_from_profile(prof)
    name, rp = zero_offload(prof, hw_for(problem, 0.5, host=0))
    assert name.startswith("zero_infinity")
    kinds = {m.target: set() for m in rp.moves}
    for m in rp.moves:
        kinds[m.target].add(rp.problem.kind[m.period])
    assert kinds == {"host": {"param"}, "ssd": {"grad"}}
    assert not any(m.reads_back for m in rp.moves if m.target == "ssd")
    assert rp.sim.busy_us["host_write"] < 1e-6  # the release of a parameter moves nothing
    assert rp.sim.bytes_moved["host_read"] > 0


def test_zero_offload_keeps_parameters_on_the_device(prof) -> None:
    problem = problem_from_profile(prof)
    hw = hw_for(problem, 0.95, host=64 << 30)
    name, rp = zero_offload(prof, hw)
    assert name.startswith("zero_offload")
    assert all(rp.problem.kind[m.period] == "grad" for m in rp.moves)


def test_a_baseline_that_does_not_fit_runs_as_its_users_make_it_fit(prof) -> None:
    problem = problem_from_profile(without_backward_modules(prof))
    need = int(zero_problem(prof, hw_for(problem, 1.0, host=0))[0].memory_bytes.max())
    hw = Hardware(gpu_mem_bytes=int(need * 0.45), ssd_read_bw_bytes_per_s=64e9, ssd_write_bw_bytes_per_s=64e9,
                  host_mem_bytes=0)
    rows = run_baselines(without_backward_modules(prof), problem, hw)
    assert "zero_infinity+ckpt" in rows
    assert any(k.startswith("activation_offload+") for k in rows)


def test_zero_times_the_ops_as_the_planner_does() -> None:
    """Both take each op's median over the recorded iterations (planner.problem), not the first's."""
    import pandas as pd

    prof = synthetic_profile(4, 6, 3, seed=1)
    k, a = prof.kernels, prof.accesses
    faster = [k.assign(iteration=k["iteration"] + i, duration_us=k["duration_us"] * 0.8) for i in (1, 2)]
    again = [a.assign(iteration=a["iteration"] + i) for i in (1, 2)]
    prof = replace(prof, kernels=pd.concat([k, *faster], ignore_index=True),
                   accesses=pd.concat([a, *again], ignore_index=True))
    problem = problem_from_profile(prof)
    hw = Hardware(gpu_mem_bytes=int(problem.memory_bytes.max() * 0.6), ssd_read_bw_bytes_per_s=2e9,
                  ssd_write_bw_bytes_per_s=2e9, host_mem_bytes=1 << 40)
    zp, _ = zero_problem(prof, hw)
    forward_backward = problem.phase != "optimizer"  # ZeRO times the optimizer step on the CPU
    assert zp.duration_us[forward_backward] == pytest.approx(problem.duration_us[forward_backward])
    assert problem.duration_us.sum() == pytest.approx(0.8 * k["duration_us"].sum())


def test_releases_share_no_device_and_cost_no_copies() -> None:
    """NOTE [ Duplex ] in planner.simulate: the baselines' releases of parameters whose master copy
    is elsewhere go on a channel of infinite rate; a device's duplex neither slows them nor makes
    them copies the compute pays for (it did: ZeRO-Infinity's copy charge grew with a duplex < 1)."""
    prof = synthetic_profile(4, 6, 3, num_extra=2, seed=3, activation_bytes=16 << 20, param_bytes=16 << 20,
                             op_us=500.0)
    prob = problem_from_profile(prof)
    hw = Hardware(gpu_mem_bytes=int(prob.memory_bytes.max() * 0.5), ssd_read_bw_bytes_per_s=2e9,
                  ssd_write_bw_bytes_per_s=1e9, host_bw_bytes_per_s=4e9, host_mem_bytes=1 << 32,
                  copy_cost_s_per_byte=0.4e-9, transfer_latency_s=3e-4)
    independent = run_baselines(prof, prob, hw)["zero_infinity"].sim
    shared = run_baselines(prof, prob, replace(hw, host_duplex=0.5))["zero_infinity"].sim
    assert shared.copy_charge_us == independent.copy_charge_us > 0
