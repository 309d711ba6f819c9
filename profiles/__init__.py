"""The teraio profile: Parquet schemas, reading and writing, validation, derived views.

Only the errors are imported eagerly: the rest (pandas, pyarrow) loads on first
use, so that `teraio run` and the runtime, which need no profile, stay light
(pandas alone is about 66 MiB of resident memory).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from profiles.errors import ProfileFormatError, TeraioError

if TYPE_CHECKING:
    from profiles.model import Profile, find_newest_profile, merge_ranks, read_profile, write_profile
    from profiles.schema import FORMAT
    from profiles.views import (
        active_bytes,
        inactive_periods,
        iteration_time_us,
        live_intervals,
        made_bytes,
        memory_curve,
    )

_LAZY = {
    "FORMAT": "profiles.schema",
    "Profile": "profiles.model",
    "find_newest_profile": "profiles.model",
    "merge_ranks": "profiles.model",
    "read_profile": "profiles.model",
    "write_profile": "profiles.model",
    "active_bytes": "profiles.views",
    "inactive_periods": "profiles.views",
    "iteration_time_us": "profiles.views",
    "live_intervals": "profiles.views",
    "made_bytes": "profiles.views",
    "memory_curve": "profiles.views",
}

__all__ = [
    "FORMAT",
    "Profile",
    "ProfileFormatError",
    "TeraioError",
    "active_bytes",
    "find_newest_profile",
    "inactive_periods",
    "iteration_time_us",
    "live_intervals",
    "made_bytes",
    "memory_curve",
    "merge_ranks",
    "read_profile",
    "write_profile",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'profiles' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
