"""Runtime errors; all are ``TeraioError``s."""

from __future__ import annotations

from profiles.errors import TeraioError

__all__ = ["PlanMismatchError", "StorageIOError"]


class StorageIOError(TeraioError):
    """A tensor's bytes could not be read back: names the tensor and the file."""

    def __init__(self, tensor_id: int, where: str, problem: str) -> None:
        super().__init__(f"tensor {tensor_id}: cannot read it back from {where}: {problem}")
        self.tensor_id = tensor_id
        self.where = where


class PlanMismatchError(TeraioError):
    """The plan was made for another profile than the script being run."""
