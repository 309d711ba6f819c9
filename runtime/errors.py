"""Runtime errors; all are ``TeraioError``s."""

from __future__ import annotations

from pathlib import Path

from profiles.errors import TeraioError

__all__ = ["PlanMismatchError", "StorageIOError", "SwapKeptError"]


class StorageIOError(TeraioError):
    """A tensor's bytes could not be read back: names the tensor and the file."""

    def __init__(self, tensor_id: int, where: str, problem: str) -> None:
        super().__init__(f"tensor {tensor_id}: cannot read it back from {where}: {problem}")
        self.tensor_id = tensor_id
        self.where = where
        self.problem = problem


class SwapKeptError(TeraioError):
    """At exit, some offloaded tensors could not be restored: their bytes are kept in files."""

    def __init__(self, kept: list[Path], tensors: list[str]) -> None:
        super().__init__(
            f"{len(tensors)} offloaded tensors could not be restored at exit; their bytes are "
                  f"kept in {', '.join(map(str, kept))} (kept.json there says which file is which "
                  f"tensor): {'; '.join(tensors)}")
        self.kept = kept
        self.tensors = tensors


class PlanMismatchError(TeraioError):
    """The plan was made for another profile than the script being run."""
