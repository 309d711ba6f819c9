"""teraio: lifetime-aware tensor offloading to SSD and host memory for PyTorch training.

The command line (`teraio profile | plan | run`) is the main interface. From
Python, ``with teraio.offload("plan.json"): train()`` runs training code under
a plan, and a loop that does not step a ``torch.optim`` optimizer marks its
iterations with ``teraio.mark_iteration()``.
"""

from __future__ import annotations

from typing import Any

from profiles.errors import ProfileFormatError, TeraioError

__all__ = ["ProfileFormatError", "TeraioError", "mark_iteration", "offload"]
__version__ = "0.1.0"


def mark_iteration() -> None:
    """End the current training iteration (needed only without ``torch.optim``)."""
    from torch_patch.opstream import mark_iteration as mark

    mark()


def offload(plan: Any, **options: Any) -> Any:
    """Context manager: run the body under ``plan`` (a plan.json path); see
    ``runtime.api.offload`` for the options (swap_dir, backend, host_mem_bytes, report)."""
    from runtime.api import offload as _offload

    return _offload(plan, **options)
