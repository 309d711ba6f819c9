"""The root of teraio's error hierarchy.

It lives in ``profiles`` because that is the package every other one may
import; ``teraio`` re-exports all errors.
"""

from __future__ import annotations

__all__ = ["TeraioError", "ProfileFormatError"]


class TeraioError(Exception):
    """Base class of every error teraio raises for a user's mistake or an I/O fault."""


class ProfileFormatError(TeraioError):
    """A profile directory or one of its files is missing, damaged or of another version."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
