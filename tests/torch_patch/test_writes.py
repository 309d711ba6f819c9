"""Which arguments an op writes (torch_patch.opstream): what the profile records as writes and what
drops a kept copy at run time (NOTE [ Copies kept ] in planner.clean), where schemas do not say."""

from __future__ import annotations

import torch
import torch.distributed  # noqa: F401 - registers the c10d ops

from torch_patch.opstream import _op_info


def written(func: object) -> set[str]:
    return set(_op_info(func).mutable_kwargs)


def test_batch_norm_writes_its_running_statistics() -> None:
    # native_batch_norm's schema has `Tensor? running_mean`, unmarked, yet training updates it in place
    assert {"running_mean", "running_var"} <= written(torch.ops.aten.native_batch_norm.default)
    assert "input" not in written(torch.ops.aten.native_batch_norm.default)


def test_collectives_write_every_argument_but_their_inputs() -> None:
    assert "output_tensors" in written(torch.ops.c10d.allgather_.default)  # Tensor[][]
    assert "outputs" in written(torch.ops.c10d.allgather_into_tensor_coalesced_.default)
    assert "tensors" in written(torch.ops.c10d.allreduce_.default)
    assert "input_tensors" not in written(torch.ops.c10d.allgather_.default)
    assert not written(torch.ops.c10d.send.default)
