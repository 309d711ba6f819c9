"""The executor on real training steps with hand-made plans: bit-exact, and faults handled.

These plans offload every idle stretch of every tensor of 4 KiB or more, with
the tightest deadlines: far more traffic than a real plan, to stress the
state machine. Plans from the planner are tested end to end in test_run_cli.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from profiles import inactive_periods
from runtime.api import RunPlan, first_iteration_warning, offload
from runtime.errors import PlanMismatchError, StorageIOError
from runtime.executor import Move
from torch_patch import ProfileComplete, Tracer


def mlp_and_data(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.Generator().manual_seed(seed)


def train(steps: int, hook=None) -> tuple[list[float], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    model, opt, gen = mlp_and_data()
    losses = []
    for step in range(steps):
        x = torch.randn(64, 32, generator=gen)
        loss = model(x).square().mean()
        if hook is not None:
            hook(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def hand_plan(min_bytes: int = 4096) -> RunPlan:
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        train(5)
    prof = tracer.profile({})
    periods = inactive_periods(prof)
    periods = periods[~periods["wraps"] & (periods["num_ops"] >= 3)
                      & (periods["size_bytes"] >= min_bytes)]
    moves = []
    for r in periods.itertuples():
        tid, n = int(r.tensor_id), int(r.size_bytes)
        moves.append(Move(tid, "offload", "ssd", int(r.start_op) + 1, int(r.start_op) + 2, n))
        moves.append(Move(tid, "prefetch", "ssd", int(r.end_op) - 1, int(r.end_op), n))
    assert len(moves) > 20
    return RunPlan("hand", moves, prof.kernels_of()["op_name"].tolist(), None, {})


@pytest.fixture(scope="module")
def plan() -> RunPlan:
    return hand_plan()


@pytest.mark.parametrize("backend", ["posix", "host"])
def test_bit_identical_with_offloading(plan: RunPlan, backend: str, tmp_path: Path) -> None:
    expected_losses, expected_params = train(6)
    with offload(plan, backend=backend, swap_dir=tmp_path) as ex:
        losses, params = train(6)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert sum(ex.stats.bytes_written.values()) > 0
    assert ex.stats.bytes_read == ex.stats.bytes_written
    assert not ex.divergence_reported and ex.matched_iterations >= 4
    assert not list(tmp_path.iterdir())  # swap directory removed


def test_offloading_lowers_tracked_peak(plan: RunPlan) -> None:
    with offload(RunPlan("none", [], plan.op_names, None, {})) as plain:
        train(4)
    with offload(plan) as ex:
        train(4)
    # every followed iteration (iteration 0 is not), not just the last one
    followed = ex.stats.iteration_peak_bytes[1:]
    assert len(followed) == 3
    assert max(followed) < min(plain.stats.iteration_peak_bytes[1:])


def test_deleted_swap_file_is_a_named_error(plan: RunPlan, tmp_path: Path) -> None:
    def delete_swap_files(step: int) -> None:
        if step == 3:
            ex._drain()
            files = list(tmp_path.glob("teraio-swap-*/*.bin"))
            assert files, "nothing was offloaded before backward"
            for f in files:
                f.unlink()

    with pytest.raises(StorageIOError, match=r"tensor \d+: cannot read it back from .*\.bin"):
        with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
            train(6, hook=delete_swap_files)
    assert not list(tmp_path.iterdir())


def test_truncated_swap_file_is_a_named_error(plan: RunPlan, tmp_path: Path) -> None:
    def truncate_swap_files(step: int) -> None:
        if step == 3:
            ex._drain()
            for f in tmp_path.glob("teraio-swap-*/*.bin"):
                os.truncate(f, 0)

    with pytest.raises(StorageIOError, match="truncated"):
        with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
            train(6, hook=truncate_swap_files)


def test_plan_for_another_model_is_refused(plan: RunPlan) -> None:
    def other() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()

    with pytest.raises(PlanMismatchError, match="made for another profile"), offload(plan):
        other()


def test_divergence_mid_run_falls_back_and_stays_exact(plan: RunPlan) -> None:
    def extra_op(step: int) -> None:
        if step == 4:
            torch.ones(3).add_(1)  # an op the profile never saw

    expected_losses, expected_params = train(7, hook=extra_op)
    with pytest.warns(RuntimeWarning, match="left the plan at iteration 4"):
        with offload(plan) as ex:
            losses, params = train(7, hook=extra_op)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert ex.divergence_reported and not ex.moved


def test_first_iteration_warning_when_the_profiled_peak_exceeds_the_device() -> None:
    run_plan = RunPlan("s", [], None, None, {"peak_before_bytes": 3 << 30})
    assert first_iteration_warning(run_plan, 4 << 30) is None
    why = first_iteration_warning(run_plan, 2 << 30)
    assert why is not None and "3.00 GiB" in why and "2.00 GiB" in why
