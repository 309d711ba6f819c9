"""The teraio profile: Parquet schemas, reading and writing, validation, derived views."""

from profiles.errors import ProfileFormatError, TeraioError
from profiles.model import Profile, find_newest_profile, read_profile, write_profile
from profiles.schema import FORMAT
from profiles.views import (
    active_bytes,
    inactive_periods,
    iteration_time_us,
    live_intervals,
    memory_curve,
)

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
    "memory_curve",
    "read_profile",
    "write_profile",
]
