"""Storage identity across threads: frees and in-place releases on another thread are queued
and applied by the next lookup, on whichever thread dispatches ops (NOTE [ Frees on other
threads ])."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

import pytest
import torch

from torch_patch.identity import StorageIds, signals_outside_callbacks


def test_a_release_on_another_thread_is_applied_by_the_next_lookup() -> None:
    freed: list[int] = []
    ids = StorageIds(on_free=freed.append)
    kept, other = torch.ones(4).untyped_storage(), torch.ones(8).untyped_storage()
    ids.assign(kept, 1)
    ids.assign(other, 2)
    got: list[int | None] = []
    worker = threading.Thread(target=lambda: got.append(ids.release(other)))
    worker.start()
    worker.join()
    assert got == [2] and freed == []  # queued: nothing changes off the owning thread by itself
    assert ids.get(kept) == 1  # the next lookup applies it
    assert freed == [2] and ids.get(other) is None and ids.storage(2) is None
    assert ids.release(kept) == 1 and freed == [2, 1]  # on the owning thread: at once


def test_a_lookup_on_the_dispatching_thread_applies_its_queued_frees() -> None:
    """CUDA's autograd runs backward on a device thread: its lookups must see the frees queued
    there, or a new storage whose key (``id()``) was the freed one's would get the old id."""
    freed: list[int] = []
    ids = StorageIds(on_free=freed.append)
    got: list[int | None] = []

    def backward_thread() -> None:
        storage = torch.ones(8).untyped_storage()
        ids.assign(storage, 3)
        key = id(storage)
        del storage  # freed on this thread: queued
        for _ in range(1000):  # find a new storage object at the freed one's address
            new = torch.ones(8).untyped_storage()
            if id(new) == key:
                got.append(ids.get(new))
                return

    worker = threading.Thread(target=backward_thread)
    worker.start()
    worker.join()
    assert got == [None] and freed == [3]  # a new storage, and the old one's free applied
def test_a_ctrl_c_that_lands_in_a_free_callback_is_not_lost() -> None:
    """A signal's handler can run inside the weak-reference callback of a free, where its
    exception would be dropped; it acts once the callback returns (NOTE [ Signals in free
    callbacks ]), and the free's bookkeeping is whole."""
    freed: list[int] = []

    def on_free(tid: int) -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs at the next boundary: in here
        freed.append(tid)

    ids = StorageIds(on_free=on_free)
    storage = torch.ones(4).untyped_storage()
    ids.assign(storage, 7)
    t0 = time.monotonic()
    with signals_outside_callbacks(), pytest.raises(KeyboardInterrupt):
        del storage  # the callback runs here; the interrupt comes right after it
        while time.monotonic() - t0 < 10:
            time.sleep(0.001)
    assert freed == [7] and ids.storage(7) is None
    assert time.monotonic() - t0 < 5


def test_a_signal_replayed_with_a_frame_from_a_callback_acts_at_once() -> None:
    """``runtime.executor.signals_held`` replays a held signal later with the frame it was
    given; if that frame was in a free callback, the handler must act now all the same."""
    frames: list[Any] = []
    ids = StorageIds(on_free=lambda tid: frames.append(sys._getframe()))
    storage = torch.ones(4).untyped_storage()
    ids.assign(storage, 7)
    del storage
    (in_callback,) = frames
    with signals_outside_callbacks():
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler)
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, in_callback)


def test_a_handler_the_body_installs_stays() -> None:
    def mine(signum: int, frame: Any) -> None:
        pass

    before = signal.getsignal(signal.SIGINT)
    try:
        with signals_outside_callbacks():
            signal.signal(signal.SIGINT, mine)
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)
