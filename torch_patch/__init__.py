"""Everything that hooks PyTorch: the op stream, tensor identity, the tracer, the launcher."""

from torch_patch.identity import StorageIds, input_id, persistent_names, produced_id
from torch_patch.launcher import ScriptFailed, run_script
from torch_patch.opstream import OpStream, active_stream, mark_iteration
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
