"""Small hand-built profiles for planner tests."""

from __future__ import annotations

import pandas as pd

from planner import Hardware
from planner.make import RankPlan
from planner.simulate import simulate
from profiles import Profile


def make_profile(durations: list[float], tensors: list[dict], accesses: list[tuple[int, int]],
                 phases: list[str] | None = None, modules: list[str | None] | None = None,
                 access: str = "write") -> Profile:
    """A one-rank, one-iteration profile.

    ``tensors``: dicts with tensor_id, size_bytes and optionally kind, persistent,
    alloc_op, free_op (default: persistent, alive all iteration). ``accesses``:
    (op_index, tensor_id) pairs, all of kind ``access``: by default writes, so that no period is
    unchanged (NOTE [ Unchanged periods ] in ``planner.problem``) unless a test asks for reads.
    """
    n = len(durations)
    starts = [sum(durations[:i]) for i in range(n)]
    kernels = pd.DataFrame({
        "rank": 0, "iteration": 1, "op_index": range(n), "op_name": [f"op{i}" for i in range(n)],
        "phase": phases or ["forward"] * n, "module": modules or [None] * n,
        "start_us": starts, "duration_us": durations,
    })
    rows = [{"rank": 0, "kind": "activation", "dtype": "float32", "name": None, "persistent": True,
             "alloc_op": -1, "free_op": -1, **t} for t in tensors]
    accs = pd.DataFrame({"rank": 0, "iteration": 1, "op_index": [a[0] for a in accesses],
                         "tensor_id": [a[1] for a in accesses], "access": access})
    return Profile(meta={"signature": "test"}, kernels=kernels, tensors=pd.DataFrame(rows), accesses=accs)


def assert_simulates_its_moves(result: RankPlan, hw: Hardware) -> None:
    """The prediction a plan reports is the simulation of the moves it returns."""
    again = simulate(result.problem, result.moves, hw.channel_bw(), hw.gpu_mem_bytes, **hw.compute_costs())
    assert again.iteration_us == result.sim.iteration_us and again.peak_bytes == result.sim.peak_bytes
    assert again.waited_prefetches == result.sim.waited_prefetches
    assert again.waited_offloads == result.sim.waited_offloads
