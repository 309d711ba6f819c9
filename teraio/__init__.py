"""teraio: lifetime-aware tensor offloading to SSD and host memory for PyTorch training.

The command line (`teraio profile | plan | run`) is the main interface; from
Python, a training loop that does not step a ``torch.optim`` optimizer marks
its iterations with ``teraio.mark_iteration()``.
"""

from __future__ import annotations

from profiles.errors import ProfileFormatError, TeraioError

__all__ = ["ProfileFormatError", "TeraioError", "mark_iteration"]
__version__ = "0.1.0"


def mark_iteration() -> None:
    """End the current training iteration (needed only without ``torch.optim``)."""
    from torch_patch.opstream import mark_iteration as mark

    mark()
