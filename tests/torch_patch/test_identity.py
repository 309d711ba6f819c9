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


def test_a_release_on_another_thread_is_applied_by_the_dispatching_thread() -> None:
    freed: list[int] = []
    ids = StorageIds(on_free=freed.append)
    kept, other = torch.ones(4).untyped_storage(), torch.ones(8).untyped_storage()
    ids.assign(kept, 1)
    ids.assign(other, 2)
    got: list[int | None] = []

    def off_thread() -> None:  # a checkpoint writer's torch.save looks ids up, and applies nothing
        got.append(ids.release(other))
        got.append(ids.get(kept))

    worker = threading.Thread(target=off_thread)
    worker.start()
    worker.join()
    assert got == [2, 1] and freed == []  # queued: nothing changes off the dispatching thread
    assert ids.get(kept) == 1  # the next lookup here applies it
    assert freed == [2] and ids.get(other) is None and ids.storage(2) is None
    assert ids.release(kept) == 1 and freed == [2, 1]  # on the dispatching thread: at once


def _reused_key_lookup(ids: StorageIds, dispatching: bool) -> int | None:
    """On a new thread: a storage with id 3 is freed, and a new storage takes its key; the id
    a lookup finds for the new one."""
    got: list[int | None] = []

    def body() -> None:
        if dispatching:
            ids.dispatching()  # as the op stream does before each op
        storage = torch.ones(8).untyped_storage()
        ids.assign(storage, 3)
        key = id(storage)
        del storage
        for _ in range(1000):
            new = torch.ones(8).untyped_storage()
            if id(new) == key:
                got.append(ids.get(new))
                return

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert len(got) == 1, "no new storage took the freed one's key"
    return got[0]


def test_a_storage_that_takes_a_freed_ones_key_is_new() -> None:
    """CUDA's autograd runs backward on a device thread: its frees apply at once there (it
    dispatches the ops), and a storage that takes a freed one's key (``id()``) is a new storage,
    on any thread, even while the free is still queued."""
    freed: list[int] = []
    ids = StorageIds(on_free=freed.append)
    assert _reused_key_lookup(ids, dispatching=True) is None and freed == [3]
    freed.clear()
    ids = StorageIds(on_free=freed.append)
    assert _reused_key_lookup(ids, dispatching=False) is None and freed == []  # queued
    ids.dispatching()
    assert freed == [3]


def test_frees_are_recorded_at_the_same_op_on_any_dispatching_thread() -> None:
    """The op a free is recorded at does not depend on the thread the ops run on (CUDA's
    backward runs on autograd's device thread, not on the thread that made the op stream)."""
    from torch_patch.opstream import OpStream

    class Frees(OpStream):
        def __init__(self) -> None:
            super().__init__()
            self.freed_at: dict[int, int] = {}

        def on_free(self, tensor_id: int) -> None:
            self.freed_at[tensor_id] = self.op_index

    def run(on_thread: bool) -> dict[int, int]:
        stream = Frees()

        def body() -> None:
            with stream:
                x = torch.ones(1000)
                a = x + 1
                b = a * 2
                del a
                c = b + 1
                del x, b, c

        if on_thread:
            worker = threading.Thread(target=body)
            worker.start()
            worker.join()
        else:
            body()
        return stream.freed_at

    here = run(False)
    assert here and run(True) == here


@pytest.mark.parametrize("name", ["SIGINT", "SIGHUP"])
def test_a_signal_that_lands_in_a_free_callback_is_not_lost(name: str) -> None:
    """A signal's handler can run inside the weak-reference callback of a free, where its
    exception would be dropped; it acts once the callback returns (NOTE [ Signals in free
    callbacks ]), and the free's bookkeeping is whole. Ctrl-C, and SIGHUP as ``runtime.api``
    handles it (SystemExit(129): it was dropped so, and the run trained on, a review found)."""
    sig = getattr(signal, name)
    freed: list[int] = []

    def on_free(tid: int) -> None:
        signal.raise_signal(sig)  # the handler runs at the next boundary: in here
        freed.append(tid)

    ids = StorageIds(on_free=on_free)
    storage = torch.ones(4).untyped_storage()
    ids.assign(storage, 7)
    old = signal.signal(sig, lambda signum, _: sys.exit(128 + signum)) if name == "SIGHUP" else None
    t0 = time.monotonic()
    try:
        with signals_outside_callbacks(), pytest.raises(KeyboardInterrupt if name == "SIGINT" else SystemExit) as err:
            del storage  # the callback runs here; the signal acts right after it
            while time.monotonic() - t0 < 10:
                time.sleep(0.001)
    finally:
        if old is not None:
            signal.signal(sig, old)
    assert freed == [7] and ids.storage(7) is None
    assert time.monotonic() - t0 < 5
    assert name == "SIGINT" or err.value.code == 129


def test_a_ctrl_c_from_a_free_callback_acts_at_the_next_op() -> None:
    """While training keeps the main thread busy with ops (the redelivering thread may wait
    seconds for the GIL), a signal put off in a free callback acts at the op stream's next op."""
    from torch_patch.opstream import OpStream

    class Interrupting(OpStream):
        def __init__(self) -> None:
            super().__init__()
            self.freed_at: list[int] = []

        def on_free(self, tensor_id: int) -> None:
            if not self.freed_at:
                signal.raise_signal(signal.SIGINT)  # lands in here: put off
            self.freed_at.append(self.op_index)

    stream = Interrupting()
    ops_after = -1
    with pytest.raises(KeyboardInterrupt), stream:
        x = torch.ones(1000)
        a = x + 1
        del a  # the free: the interrupt is owed from here
        for ops_after in range(1000):  # noqa: B007  # busy; no sleeps to release the GIL
            x = x + 1
    assert stream.freed_at[0] == 2 and ops_after == 0


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


def test_a_ctrl_c_between_the_two_handler_swaps_restores_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    def on_term(signum: int, frame: Any) -> None:
        pass

    swap = signal.signal
    monkeypatch.setattr(signal, "signal", swap)  # undone last
    default_term = swap(signal.SIGTERM, on_term)  # a Python handler, so that it is wrapped too
    before = (signal.getsignal(signal.SIGINT), on_term)

    def interrupted_at_sigterm(sig: int, handler: Any) -> Any:
        if sig == signal.SIGTERM:
            raise KeyboardInterrupt
        return swap(sig, handler)

    monkeypatch.setattr(signal, "signal", interrupted_at_sigterm)
    with pytest.raises(KeyboardInterrupt), signals_outside_callbacks():
        pass
    monkeypatch.undo()
    try:
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        signal.signal(signal.SIGTERM, default_term)


@pytest.mark.parametrize("case", ["ensemble", "probe", "master-copies"])
def test_a_model_trained_after_another_takes_the_names_only_where_the_other_idles(case: str) -> None:
    """NOTE [ Late roots ] in torch_patch.opstream: a second model first called after the first
    model's training takes the persistent names once an optimizer holds its parameters and the
    first idles, kept (an ensemble's) but neither called nor an optimizer's. A review found a
    first version moving the names off a frozen backbone probed every step, and off a model
    stepped through fp32 master copies beside a discriminator that joins later."""
    from torch_patch.opstream import OpStream

    torch.manual_seed(0)
    stream = OpStream()
    with stream:
        first = torch.nn.Linear(8, 8)
        if case == "master-copies":
            master = [torch.nn.Parameter(p.detach().clone()) for p in first.parameters()]
            opts = [torch.optim.SGD(master, lr=0.1)]
        else:
            opts = [torch.optim.SGD(first.parameters(), lr=0.1)]
        second = torch.nn.Linear(8, 8)
        for step in range(6):
            if case == "master-copies":
                out = first(torch.randn(4, 8))
                loss = out.sum() + (second(out).sum() if step >= 2 else 0)
                loss.backward()
                for m, p in zip(master, first.parameters(), strict=True):
                    m.grad = p.grad
                if step == 2:
                    opts.append(torch.optim.SGD(second.parameters(), lr=0.1))
            elif step < 2:
                first(torch.randn(4, 8)).sum().backward()
            else:
                if step == 2:
                    opts = [torch.optim.SGD(second.parameters(), lr=0.1)]  # the first's dropped
                x = torch.randn(4, 8)
                if case == "probe":
                    with torch.no_grad():
                        x = first(x)
                second(x).sum().backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            if case == "master-copies":
                with torch.no_grad():
                    for m, p in zip(master, first.parameters(), strict=True):
                        p.copy_(m)
        named = stream.named_roots()
    assert named == ([second] if case == "ensemble" else [first])
