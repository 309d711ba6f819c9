"""Tensor ids: how a storage is named in profiles and plans (docs/formats.md, "Tensor ids").

* persistent storages (parameters, buffers, optimizer state, gradients that
  stay allocated) are numbered ``0, 1, ...`` in a stable order of their names;
* a storage an op produces is ``produced_id(op_index, output_position)``;
* a storage first seen as an op input that nothing in the iteration produced
  (a data batch, a tensor made outside the traced ops) is
  ``input_id(op_index, tensor_argument_position)``;
* a transient storage alive at an iteration boundary gets ``CARRIED_FLAG``
  added to its id;
* one that is still alive at the next boundary (a buffer a library keeps and
  no model or optimizer names: pipeline receive buffers, DDP's buckets) is
  long-lived: ``long_id(k)`` for the k-th such storage of the run, which it
  keeps. (Flagging it again would collide with the next storage made at its
  op and position.)

Plain integers, no torch: the planner and the runtime's boundary logic use them too.
"""

from __future__ import annotations

__all__ = ["CARRIED_FLAG", "INPUT_BASE", "LONG_BASE", "PRODUCED_BASE", "input_id", "long_id", "produced_id",
           "produced_op"]

PRODUCED_BASE = 1 << 40
INPUT_BASE = 2 << 40
LONG_BASE = 3 << 40  # above every produced and input id (ops per iteration < 2^24)
# Set on the id of a transient storage that outlives an iteration boundary, so
# that it never collides with the ids the next iteration gives (see NOTE
# [ Carried storages ] in torch_patch.tracer).
CARRIED_FLAG = 1 << 47
_POS_BITS = 16  # up to 65536 tensors per op (foreach ops over every parameter)


def produced_id(op_index: int, position: int) -> int:
    return PRODUCED_BASE + (op_index << _POS_BITS) + position


def produced_op(tid: int) -> int:
    """The op of the iteration that made the produced storage ``tid`` (carried or not)."""
    return ((tid & ~CARRIED_FLAG) - PRODUCED_BASE) >> _POS_BITS


def input_id(op_index: int, position: int) -> int:
    return INPUT_BASE + (op_index << _POS_BITS) + position


def long_id(number: int) -> int:
    return LONG_BASE + number
