"""Storage identity across threads: frees and in-place releases on another thread are queued
and applied on the owning thread (NOTE [ Frees on other threads ])."""

from __future__ import annotations

import threading

import torch

from torch_patch.identity import StorageIds


def test_a_release_on_another_thread_is_applied_on_the_owning_thread() -> None:
    freed: list[int] = []
    ids = StorageIds(on_free=freed.append)
    kept, other = torch.ones(4).untyped_storage(), torch.ones(8).untyped_storage()
    ids.assign(kept, 1)
    ids.assign(other, 2)
    got: list[int | None] = []
    def off_thread() -> None:
        got.append(ids.release(other))
        got.append(ids.get(other))  # a lookup there applies nothing either

    worker = threading.Thread(target=off_thread)
    worker.start()
    worker.join()
    assert got == [2, 2] and freed == []  # queued: nothing changes off the owning thread
    assert ids.get(kept) == 1  # the next lookup applies it
    assert freed == [2] and ids.get(other) is None and ids.storage(2) is None
    assert ids.release(kept) == 1 and freed == [2, 1]  # on the owning thread: at once
