"""Profile -> planning arrays (planner.problem)."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from planner import problem_from_profile
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
