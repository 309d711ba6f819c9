"""Storage-level primitives: free a storage in place, give it its bytes back, view it as bytes.

NOTE [ Freeing in place ]: offloading frees a storage with
``untyped_storage().resize_(0)`` and restoring is ``resize_(nbytes)`` plus a
read into a uint8 alias of the same storage. Every Python reference, view,
autograd-saved tensor and optimizer-state entry keeps pointing at the same
storage object, and no version counter moves. Touching a storage while it is
freed crashes the process, so the executor makes every input of an op
resident before the op runs (DESIGN.md section 6). Refilling with
``tensor.copy_`` would trip autograd's version check, so it is never used.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["byte_view", "free_storage", "realloc_storage"]

# The method itself, before any teraio stream patches it (NOTE [ Storages others resize ]
# in torch_patch.opstream): teraio's own frees are not someone else's.
_resize = torch.UntypedStorage.resize_


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor aliasing all of ``storage`` (no op is recorded by teraio's modes). Not
    an inference tensor, though made inside the script's ``torch.inference_mode()`` (an
    evaluation): a worker thread, outside it, could not write into one."""
    with _disable_current_modes(), torch.inference_mode(False):
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def free_storage(storage: torch.UntypedStorage) -> None:
    _resize(storage, 0)


def realloc_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    _resize(storage, nbytes)
