"""Everything that hooks PyTorch: the op stream, tensor identity, the tracer, the launcher.

The tracer (which writes profiles, so pandas and pyarrow) loads on first use;
the runtime needs only the op stream.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch_patch.identity import StorageIds, input_id, persistent_names, produced_id
from torch_patch.launcher import ScriptFailed, run_script
from torch_patch.opstream import OpStream, active_stream, mark_iteration

if TYPE_CHECKING:
    from torch_patch.tracer import ProfileComplete, Tracer, signature_of

__all__ = [
    "OpStream",
    "ProfileComplete",
    "ScriptFailed",
    "StorageIds",
    "Tracer",
    "active_stream",
    "input_id",
    "mark_iteration",
    "persistent_names",
    "produced_id",
    "run_script",
    "signature_of",
]


def __getattr__(name: str) -> Any:
    if name not in ("ProfileComplete", "Tracer", "signature_of"):
        raise AttributeError(f"module 'torch_patch' has no attribute {name!r}")
    value = getattr(importlib.import_module("torch_patch.tracer"), name)
    globals()[name] = value
    return value
