"""Views of a profile that read op names against PyTorch's own schemas."""

from __future__ import annotations

import torch

from profiles.ops import VIEW_OPS, is_view_op, leaves_in_flight


def _views_by_schema(name: str) -> bool:
    """Whether some overload of aten op ``name`` takes its first argument with a read-only alias
    annotation and returns only aliases of it (what ``AsyncCollectiveTensor`` runs unwaited)."""
    packet = getattr(torch.ops.aten, name)
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        if first is not None and not first.is_write and all(r.alias_info is not None for r in schema.returns):
            return True
    return False


def test_the_view_ops_are_views_by_the_installed_pytorchs_schemas() -> None:
    present = [name for name in sorted(VIEW_OPS) if hasattr(torch.ops.aten, name)]
    assert {"view", "t", "transpose", "slice", "select", "permute", "expand", "detach", "alias"} <= set(present)
    assert [name for name in present if not _views_by_schema(name)] == []
    assert is_view_op("aten.view.default") and is_view_op("aten.view.dtype") and is_view_op("aten.t.default")
    assert not is_view_op("aten.add.Tensor") and not is_view_op("aten.view") and not is_view_op("c10d.view.default")


def test_functional_collectives_leave_their_tensors_in_flight_until_their_wait() -> None:
    assert leaves_in_flight("c10d.allreduce_.default") and leaves_in_flight("_c10d_functional.all_reduce.default")
    assert leaves_in_flight("_c10d_functional._wrap_tensor_autograd.default")
    assert leaves_in_flight("_c10d_functional_autograd.all_to_all_single.default")
    assert not leaves_in_flight("_c10d_functional.wait_tensor.default") and not leaves_in_flight("aten.mm.default")
