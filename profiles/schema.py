"""The profile format, version 5: one explicit pyarrow schema per table.

The whole format (every table, column, ``meta.json`` key, unit and meaning) is
written down in ``docs/formats.md``; this module is its code. Times are
microseconds and sizes bytes everywhere. The format string is stored in each
schema's metadata and in ``meta.json``; readers refuse anything but version 5
and the older versions in ``OLDER_FORMATS``, which they upgrade: the columns a
later version added are filled with the values in ``ADDED`` (``missing_columns``).
"""

from __future__ import annotations

import pyarrow as pa

__all__ = [
    "ACCESS_KINDS",
    "ACCESSES_SCHEMA",
    "ADDED",
    "DEFAULTS",
    "FORMAT",
    "KERNELS_SCHEMA",
    "PHASES",
    "TABLE_SCHEMAS",
    "TENSOR_KINDS",
    "OLDER_FORMATS",
    "TENSORS_SCHEMA",
    "missing_columns",
]

FORMAT = "teraio-profile/5"
# 5 changed no table: its meta.json's ``kept_for_good`` maps each iteration from 2 to the first
# kept one, where version 4's ``carried_into_first_kept`` mapped the first kept one alone (read as
# such); 4 changed no table either: it added that key (NOTE [ Kept for good ] in
# torch_patch.tracer), where a version 3 profile had a second row of each such storage
OLDER_FORMATS = ("teraio-profile/4", "teraio-profile/3", "teraio-profile/2", "teraio-profile/1")
_META = {b"format": FORMAT.encode()}

PHASES = ("forward", "backward", "optimizer", "other")
TENSOR_KINDS = (
    "param", "grad", "optimizer_state", "activation", "input", "buffer", "temporary", "other",
)
ACCESS_KINDS = ("read", "write")

# One row per op (kernel) of each recorded iteration.
KERNELS_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("op_index", pa.int32(), nullable=False),
        pa.field("op_name", pa.string(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("module", pa.string(), nullable=True),
        pa.field("start_us", pa.float64(), nullable=False),  # from iteration start
        pa.field("duration_us", pa.float64(), nullable=False),
        # The other rank of a point-to-point op (c10d send: its destination; recv: its
        # source), -1 for every other op. New in version 2.
        pa.field("peer", pa.int32(), nullable=False),
        # Bytes the op allocated and freed inside itself beyond its inputs and outputs (a
        # kernel's workspace: NOTE [ Scratch ] in torch_patch.tracer), 0 where not measured
        # (CPU, fake). New in version 3.
        pa.field("scratch_bytes", pa.int64(), nullable=False),
    ],
    metadata=_META,
)

# One row per tensor storage of one iteration (ids are the same every iteration).
# alloc_op: first op at which the storage is alive (-1: alive when the iteration starts).
# free_op: first op at which it is no longer alive (-1: alive when the iteration ends).
# NOTE [ Wrapping lifetimes ]: a storage re-made every iteration that survives
# the boundary (gradients with zero_grad(set_to_none=True)) has
# 0 <= free_op <= alloc_op: it is alive at op i iff i >= alloc_op or i < free_op.
TENSORS_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("tensor_id", pa.int64(), nullable=False),
        pa.field("size_bytes", pa.int64(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("name", pa.string(), nullable=True),
        pa.field("persistent", pa.bool_(), nullable=False),
        pa.field("alloc_op", pa.int32(), nullable=False),
        pa.field("free_op", pa.int32(), nullable=False),
        # False: the storage cannot be freed in place (numpy- or shared-memory-backed, from
        # DLPack...): ``untyped_storage().resize_`` raises, so it is never planned.
        pa.field("resizable", pa.bool_(), nullable=False),
    ],
    metadata=_META,
)

# An access marks the tensor active during that op.
ACCESSES_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("op_index", pa.int32(), nullable=False),
        pa.field("tensor_id", pa.int64(), nullable=False),
        pa.field("access", pa.string(), nullable=False),
    ],
    metadata=_META,
)

# Per version, per table, the columns it added, with the value an older file (or a table
# made without them) stands for.
ADDED: dict[int, dict[str, dict[str, int | bool]]] = {
    2: {"kernels": {"peer": -1}, "tensors": {"resizable": True}},
    3: {"kernels": {"scratch_bytes": 0}},
}
# Every added column of each table, with its value where it is missing.
DEFAULTS: dict[str, dict[str, int | bool]] = {
    name: {k: v for added in ADDED.values() for k, v in added.get(name, {}).items()}
    for name in ("kernels", "tensors", "accesses")
}


def missing_columns(version: str, name: str) -> dict[str, int | bool]:
    """The columns of table ``name`` that a file of format ``version`` lacks, with their values."""
    number = int(version.rsplit("/", 1)[1])
    return {k: v for added_in, added in ADDED.items() if added_in > number for k, v in added.get(name, {}).items()}

TABLE_SCHEMAS = {
    "kernels": KERNELS_SCHEMA,
    "tensors": TENSORS_SCHEMA,
    "accesses": ACCESSES_SCHEMA,
}
