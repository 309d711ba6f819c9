"""What an op's name says about its tensors, and the smallest storage worth moving: plain names
and numbers, no pandas, so that the runtime (which reads no profile) starts without it."""

from __future__ import annotations

__all__ = ["UNTOUCHED_MIN_BYTES", "VIEW_OPS", "functional_collective", "is_view_op", "leaves_in_flight"]

UNTOUCHED_MIN_BYTES = 1 << 16  # NOTE [ Untouched storages ] and NOTE [ Random states ] in profiles.views


_FUNCTIONAL = ("_c10d_functional.", "_c10d_functional_autograd.", "c10d_functional.")


# The aten ops whose first argument's schema has a read-only alias annotation and whose results
# all alias (listed from PyTorch 2.13's schemas, tests/profiles/test_views.py checks them against
# the installed one): what a functional collective's result runs without waiting.
VIEW_OPS = frozenset({
    "_nested_view_from_buffer", "_reshape_alias", "alias", "as_strided", "conj", "detach", "diagonal", "expand",
    "imag", "lift_fresh", "narrow", "permute", "pin_memory", "positive", "real", "reshape", "select", "slice",
    "split", "split_with_sizes", "squeeze", "t", "tensor_split", "to", "transpose", "unbind", "unfold",
    "unsqueeze", "view", "view_as_complex", "view_as_real"})


def is_view_op(op_name: str) -> bool:
    """Whether op ``op_name`` (``aten.view.default``) returns views of its first argument (``VIEW_OPS``):
    a functional collective's result (``AsyncCollectiveTensor``) runs such an op without waiting
    for the collective, and hands the view on still in flight."""
    parts = op_name.split(".")
    return len(parts) == 3 and parts[0] == "aten" and parts[1] in VIEW_OPS


def leaves_in_flight(op_name: str) -> bool:
    """Whether op ``op_name`` returns while a communication backend still reads or writes its
    tensors (NOTE [ Busy in a collective ] in planner.problem): c10d's ops, and the functional
    collectives (``_c10d_functional.all_reduce`` and the rest, up to their ``wait_tensor``)."""
    return op_name.startswith("c10d.") or (op_name.startswith(_FUNCTIONAL) and ".wait_tensor." not in op_name)


def functional_collective(op_name: str) -> bool:
    """Whether op ``op_name`` is a functional collective that every rank of its group takes part in
    (``_c10d_functional.all_reduce`` and the rest): not its wrapping or its wait, nor a send or a
    receive (``isend``, ``irecv``, ``batch_p2p_ops``)."""
    parts = op_name.split(".")
    return (op_name.startswith(_FUNCTIONAL) and len(parts) > 1
            and parts[1] not in ("wait_tensor", "_wrap_tensor_autograd", "isend", "irecv", "batch_p2p_ops"))
