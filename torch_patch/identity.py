"""Storage identity (DESIGN.md section 4): ids from the op stream, never from ``data_ptr``.

The id scheme itself is in ``profiles.ids``; this module names the persistent
storages of a model and optimizer, and keeps the map of live storages to ids.

The Python ``UntypedStorage`` object of a storage lives exactly as long as the
storage itself (PyTorch preserves it), so ``id()`` of it is a stable key while
the storage lives, and a weak reference tells us when it is freed.
"""

from __future__ import annotations

import functools
import queue
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from profiles.ids import CARRIED_FLAG, INPUT_BASE, LONG_BASE, PRODUCED_BASE, input_id, long_id, produced_id

__all__ = [
    "CARRIED_FLAG",
    "INPUT_BASE",
    "LONG_BASE",
    "PRODUCED_BASE",
    "STOP_SIGNALS",
    "PersistentName",
    "StorageIds",
    "input_id",
    "long_id",
    "persistent_names",
    "produced_id",
    "signals_outside_callbacks",
]


@dataclass(frozen=True)
class PersistentName:
    name: str
    kind: str  # param | buffer | optimizer_state | grad
    storage: torch.UntypedStorage


_POLL_S = 2e-4  # ``StorageIds.await_free``'s


def has_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one inside it has a parameter."""
    return next(module.parameters(), None) is not None


def wrapped(t: torch.Tensor, suffix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors that hold ``t``'s bytes, each with a suffix for its name: ``t`` itself, a
    DTensor's local shard, the tensor inside a wrapper subclass of one (a functional collective's
    result), or each tensor inside a wrapper subclass of several, suffixed ``.<attribute>``
    (NOTE [ DTensors ] and NOTE [ Wrapper subclasses ] in torch_patch.opstream)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [(suffix, t)]
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return wrapped(local, suffix)
    if not is_traceable_wrapper_subclass(t):
        return [(suffix, t)]
    names, _ = t.__tensor_flatten__()
    inner = [(name, i) for name in names if isinstance(i := getattr(t, name, None), torch.Tensor)]
    if len(inner) == 1:
        return wrapped(inner[0][1], suffix)
    return [w for name, i in inner for w in wrapped(i, f"{suffix}.{name}")]


def persistent_names(
    roots: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> tuple[list[PersistentName], dict[int, str]]:
    """The named persistent storages in a stable order, and a map id(param) -> param name.

    Order: each root module's parameters then buffers; then, per optimizer and
    parameter in group order, its state tensors by sorted key (a list's, as L-BFGS's history, by
    their place in it) and its gradient.
    A storage shared by several names (tied weights) keeps the first. A root with no parameter
    (a loss module, a weighted one's weights a buffer) is not counted (NOTE [ Late roots ] in
    opstream): its buffers are long-lived storages, named by no one.
    """
    roots = [r for r in roots if has_parameters(r)]
    out: list[PersistentName] = []
    seen: set[int] = set()
    param_names: dict[int, str] = {}

    def add(name: str, kind: str, t: torch.Tensor) -> None:
        for suffix, part in wrapped(t):
            try:
                s = part.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if id(s) not in seen:
                seen.add(id(s))
                out.append(PersistentName(name + suffix, kind, s))

    for i, root in enumerate(roots):
        prefix = f"root{i}." if len(roots) > 1 else ""
        for name, p in root.named_parameters():
            param_names.setdefault(id(p), prefix + name)
            add(prefix + name, "param", p)
        for name, b in root.named_buffers():
            add(prefix + name, "buffer", b)
    for j, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            for k, p in enumerate(group["params"]):
                pname = param_names.get(id(p), f"opt{j}.group{g}.param{k}")
                param_names.setdefault(id(p), pname)
                add(pname, "param", p)
                state = opt.state.get(p, {})
                for key in sorted(state, key=str):
                    value = state[key]
                    if isinstance(value, torch.Tensor):
                        add(f"{pname}.{key}", "optimizer_state", value)
                    elif isinstance(value, (list, tuple)):  # a rolling history: by its place
                        for i, item in enumerate(value):
                            if isinstance(item, torch.Tensor):
                                add(f"{pname}.{key}.{i}", "optimizer_state", item)
                if p.grad is not None:
                    add(f"{pname}.grad", "grad", p.grad)
    return out, param_names


class _Slot:
    """One tracked storage: its weak reference, its id, and whether its free was applied."""

    __slots__ = ("ref", "tid", "done")

    def __init__(self, ref: weakref.ref[torch.UntypedStorage], tid: int) -> None:
        self.ref = ref
        self.tid = tid
        self.done = False


class StorageIds:
    """Live storages -> tensor ids, with a callback when a tracked storage is freed.

    NOTE [ Frees on other threads ]: ids change, and ``on_free`` runs, only on the
    thread that dispatches ops, in op order. That is the training thread, or on
    CUDA autograd's device thread, which runs backward while the training thread
    waits in ``backward()``; the op stream calls ``dispatching`` before each op, so
    the dispatching thread is always the last one that ran an op. A storage freed on
    that thread is applied at once, as on the CPU. One freed elsewhere is only
    queued: a collective's buffer that gloo's worker drops, a copy an asynchronous
    checkpoint writer lets go. The queue is applied when the dispatching thread next
    runs an op or looks an id up. Lookups from other threads (``torch.save`` on a
    checkpoint writer's thread, a resize) apply nothing.

    Every lookup checks the storage against its slot's weak reference. A key
    (``id()`` of the storage object) can be taken by a new storage once the old
    object is gone, while the old one's free is still queued; the new storage is
    then unknown, not the old one. (Before, draining only on the training thread
    broke this on CUDA: backward's lookups found the ids of storages freed on the
    device thread, whose keys new storages had taken. Draining on any thread that
    looked up ran ``on_free`` on a checkpoint writer's thread, beside the training
    thread's ops, and recorded backward's frees one op late.)
    """

    def __init__(self, on_free: Callable[[int], None] | None = None) -> None:
        self._slots: dict[int, _Slot] = {}  # id(UntypedStorage) -> its slot
        self._keys: dict[int, int] = {}  # tensor id -> id(UntypedStorage), the latest one
        self._thread = threading.get_ident()  # the thread dispatching ops
        self._pending: deque[tuple[int, _Slot]] = deque()
        self.on_free = on_free
        self.freed_elsewhere: set[int] | None = None  # where a set: the ids freed on other threads add to it

    def __len__(self) -> int:
        return len(self._slots)

    def dispatching(self) -> None:
        """The calling thread dispatches the next op: frees on it apply at once from now on,
        and those queued elsewhere apply now (NOTE [ Frees on other threads ])."""
        self._thread = threading.get_ident()
        if self._pending:
            self.drain()

    def _live_slot(self, storage: torch.UntypedStorage) -> _Slot | None:
        if self._pending and threading.get_ident() == self._thread:
            self.drain()
        slot = self._slots.get(id(storage))
        return slot if slot is not None and slot.ref() is storage else None

    def get(self, storage: torch.UntypedStorage) -> int | None:
        slot = self._live_slot(storage)
        return slot.tid if slot is not None else None

    def assign(self, storage: torch.UntypedStorage, tensor_id: int) -> None:
        slot = self._live_slot(storage)
        key = id(storage)
        if slot is None:
            slot = self._slots[key] = _Slot(weakref.ref(storage, functools.partial(self._freed, key)), tensor_id)
        slot.tid = tensor_id
        self._keys[tensor_id] = key

    def storage(self, tensor_id: int) -> torch.UntypedStorage | None:
        """The live storage that has ``tensor_id`` (the latest one given it), if any."""
        key = self._keys.get(tensor_id)
        slot = self._slots.get(key) if key is not None else None
        s = slot.ref() if slot is not None else None
        return s if s is not None and slot.tid == tensor_id else None  # type: ignore[union-attr]

    def _freed(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        """The weak-reference callback (NOTE [ Signals in free callbacks ])."""
        slot = self._slots.get(key)
        if slot is None or slot.ref is not ref:
            return  # released or moved before it died
        if threading.get_ident() != self._thread:
            self._pending.append((key, slot))  # NOTE [ Frees on other threads ]
        else:
            self._free(key, slot)

    def _free(self, key: int, slot: _Slot) -> None:
        if slot.done:
            return  # already applied
        slot.done = True
        if self._slots.get(key) is slot:
            del self._slots[key]
        tid = slot.tid
        now = self._slots.get(key)
        if self._keys.get(tid) == key and (now is None or now.tid != tid):
            del self._keys[tid]
        if self.on_free is not None:
            self.on_free(tid)

    def release(self, storage: torch.UntypedStorage) -> int | None:
        """Forget ``storage`` as if it had been freed (``on_free`` runs), though the object lives
        on: someone freed its memory in place. Used again, it is named anew. Its id, if any.
        On another thread than the one dispatching ops (FSDP2 frees its unsharded parameters
        where a collective finishes) the release is queued like a free (NOTE [ Frees on other
        threads ])."""
        slot = self._live_slot(storage)
        if slot is None:
            return None
        if threading.get_ident() != self._thread:
            self._pending.append((id(storage), slot))
        else:
            self._free(id(storage), slot)
        return slot.tid

    def move(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """Give ``old``'s id to ``new`` and forget ``old`` without a free (``on_free`` does not
        run, now or when ``old`` dies): one storage of the op stream that is two objects here
        (fake mode's copy of a constant, NOTE [ Fake constants ] in torch_patch.fake)."""
        slot = self._live_slot(old)
        if slot is None:
            return
        slot.done = True
        del self._slots[id(old)]
        self.assign(new, slot.tid)

    def drain(self) -> None:
        """Apply the frees queued on other threads; the dispatching thread's to call
        (NOTE [ Frees on other threads ])."""
        while self._pending:
            key, slot = self._pending.popleft()
            if self.freed_elsewhere is not None and not slot.done:
                self.freed_elsewhere.add(slot.tid)
            self._free(key, slot)

    def drain_here(self) -> bool:
        """Apply the frees queued on other threads if the calling thread dispatches ops; whether
        it does (elsewhere nothing is applied: NOTE [ Frees on other threads ])."""
        if threading.get_ident() != self._thread:
            return False
        self.drain()
        return True

    def await_free(self, timeout: float) -> bool:
        """On the dispatching thread: wait up to ``timeout`` seconds, without the GIL, for a
        free queued on another thread, and apply what came; whether anything did. (It polls:
        a lock or an event set in the free callback could be taken again there, by a free the
        collector runs inside it, and hang the thread.)"""
        if threading.get_ident() != self._thread:
            return False
        deadline = time.perf_counter() + timeout
        while not self._pending and time.perf_counter() < deadline:
            time.sleep(_POLL_S)
        came = bool(self._pending)
        self.drain()
        return came

    def live(self) -> dict[int, torch.UntypedStorage]:
        """Tensor id -> storage of every tracked storage still alive."""
        out = {}
        for slot in list(self._slots.values()):
            s = slot.ref()
            if s is not None:
                out[slot.tid] = s
        return out

    def clear(self) -> None:
        self.on_free = None
        self._pending.clear()
        self._slots.clear()
        self._keys.clear()


# The signals that stop a run, as Ctrl-C does or as they would end it outright (a scheduler's
# SIGTERM, a closed terminal's SIGHUP, Ctrl-\\'s SIGQUIT), those this platform has: torchrun passes
# each on to every rank of its job. ``runtime.api`` turns the last three into ``SystemExit``.
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))

# NOTE [ Signals in free callbacks ]: CPython runs a signal's Python handler on the main thread
# at the next bytecode boundary, and that can be inside a weak-reference callback. An
# exception raised there is reported as unraisable and dropped. So a Ctrl-C
# (KeyboardInterrupt), or the SIGTERM or SIGHUP torchrun passes on (SystemExit from teraio's handler), that
# lands in ``StorageIds._freed`` was lost, and the run trained on; it also stopped the free's
# bookkeeping half way. Measured here (the fault test's script, Ctrl-C at a random moment): 1 of
# 25 lost without what follows, 0 of 25 with it, alternated in one run.
#
# While an op stream is active, the SIGINT and SIGTERM handlers are wrapped: a signal that
# lands inside a free callback (as the handler's own caller shows, not the frame it is given,
# which ``runtime.executor.signals_held`` replays later) is owed to the main thread, and sent
# to it again (``signal.raise_signal``; the handler in force by then acts, the default action
# included) by whichever comes first: the op stream's next op on the main thread
# (``deliver_owed_signal``), or a daemon thread 10 ms later (``signal.pthread_kill``; it
# interrupts a blocking wait, where no op comes). Sent from the handler itself it would run the
# handler again at once, still inside the callback; landing in a callback again, it is owed
# again. The thread alone was not enough: while training holds the main thread in Python (the
# dispatch mode's ops on CPU), it waited for the GIL, and a review measured the signal acting
# 0.2-4.9 s late; at the next op it acts before the op runs (the test of the next op).
# The handler only appends to a list and puts on a ``SimpleQueue`` (C code, whole or not at
# all) for the thread started beforehand: starting a thread (or a ``threading.Timer``) in the
# handler takes Python-level locks that a second signal could leave held (NOTE [ Ctrl-C and
# the engine ] in runtime.engine).
_CALLBACK_CODES = frozenset({StorageIds._freed.__code__, StorageIds._free.__code__})
_REDELIVER_S = 0.01
owed_signals: list[int] = []  # put off in a callback, not yet sent again to the main thread
_redeliveries: queue.SimpleQueue[int] = queue.SimpleQueue()  # the main thread's ident, once per owed signal
_redeliverer: threading.Thread | None = None


def deliver_owed_signal() -> None:
    """Send the main thread a signal put off in a free callback, if one is owed; call it on the
    main thread outside callbacks (the op stream does, before each op), where the handler acts
    at once. Cheap to call when none is owed: test ``owed_signals`` first on a hot path."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        signum = owed_signals.pop(0)
    except IndexError:
        return
    signal.raise_signal(signum)


def _redeliver() -> None:
    while True:
        thread = _redeliveries.get()
        time.sleep(_REDELIVER_S)
        try:
            signum = owed_signals.pop(0)
        except IndexError:
            continue  # delivered at an op already
        signal.pthread_kill(thread, signum)


def _in_callback(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _CALLBACK_CODES:
            return True
        frame = frame.f_back
    return False


@contextmanager
def signals_outside_callbacks() -> Iterator[None]:
    """Python-level handlers of ``STOP_SIGNALS`` act outside free callbacks (NOTE [ Signals in
    free callbacks ]). Main thread only; elsewhere, and for a handler that is not Python's, a no-op. At exit a
    handler is restored only where the wrapper is still in place (one the body installed stays)."""
    global _redeliverer
    wrapped: dict[signal.Signals, tuple[Any, Any]] = {}
    try:  # a signal between the two swaps still restores the first
        if threading.current_thread() is threading.main_thread() and sys.platform != "win32":
            if _redeliverer is None or not _redeliverer.is_alive():  # none yet, or a forked child
                _redeliverer = threading.Thread(target=_redeliver, daemon=True, name="teraio-redeliver")
                _redeliverer.start()
            for sig in STOP_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):
                    wrapper = _deferring(handler)
                    wrapped[sig] = (handler, wrapper)
                    signal.signal(sig, wrapper)
        yield
    finally:
        for sig, (original, wrapper) in wrapped.items():
            if signal.getsignal(sig) is wrapper:
                signal.signal(sig, original)


def _deferring(handler: Callable[[int, FrameType | None], Any]) -> Callable[[int, FrameType | None], Any]:
    main = threading.main_thread().ident
    assert main is not None

    def deferring(signum: int, frame: FrameType | None) -> Any:
        if _in_callback(sys._getframe(1)):
            owed_signals.append(signum)
            _redeliveries.put(main)
            return None
        return handler(signum, frame)

    return deferring
