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

from profiles.ids import CARRIED_FLAG, INPUT_BASE, LONG_BASE, PRODUCED_BASE, input_id, long_id, produced_id

__all__ = [
    "CARRIED_FLAG",
    "INPUT_BASE",
    "LONG_BASE",
    "PRODUCED_BASE",
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


def persistent_names(
    roots: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]
) -> tuple[list[PersistentName], dict[int, str]]:
    """The named persistent storages in a stable order, and a map id(param) -> param name.

    Order: each root module's parameters then buffers; then, per optimizer and
    parameter in group order, its state tensors by sorted key and its gradient.
    A storage shared by several names (tied weights) keeps the first.
    """
    roots = list(roots)
    out: list[PersistentName] = []
    seen: set[int] = set()
    param_names: dict[int, str] = {}

    def add(name: str, kind: str, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # a DTensor: NOTE [ DTensors ] in opstream
        if isinstance(local, torch.Tensor):
            t = local
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(s) not in seen:
            seen.add(id(s))
            out.append(PersistentName(name, kind, s))

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
                    if isinstance(state[key], torch.Tensor):
                        add(f"{pname}.{key}", "optimizer_state", state[key])
                if p.grad is not None:
                    add(f"{pname}.grad", "grad", p.grad)
    return out, param_names


class StorageIds:
    """Live storages -> tensor ids, with a callback when a tracked storage is freed.

    NOTE [ Frees on other threads ]: a storage handed to a collective may be freed
    on the backend's thread (gloo's worker drops the last reference when its Work
    is released), while the training thread dispatches ops. The free is then only
    queued, and applied by the next lookup (``get``, ``assign``, ``move``) or
    ``drain``. Lookups come only from the thread dispatching ops: the training
    thread, or on CUDA autograd's device thread, which runs backward while the
    training thread waits in ``backward()`` (the two never dispatch at once), so
    every id and every ``on_free`` changes on the dispatching thread. A key
    (``id()`` of the storage object) can be reused by a new storage only after the
    old object's weak-reference callback ran, so a lookup that drains first never
    mistakes a new storage for the old one. (Draining on the training thread only
    broke this on CUDA: backward's lookups found the ids of storages freed there,
    their keys reused, and the profiler saw other tensors in every step.)
    """

    def __init__(self, on_free: Callable[[int], None] | None = None) -> None:
        self._ids: dict[int, int] = {}  # id(UntypedStorage) -> tensor id
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._keys: dict[int, int] = {}  # tensor id -> id(UntypedStorage), the latest one
        self._thread = threading.get_ident()
        self._pending: deque[tuple[int, weakref.ref[torch.UntypedStorage]]] = deque()
        self.on_free = on_free

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, storage: torch.UntypedStorage) -> int | None:
        if self._pending:
            self.drain()
        return self._ids.get(id(storage))

    def assign(self, storage: torch.UntypedStorage, tensor_id: int) -> None:
        if self._pending:
            self.drain()
        key = id(storage)
        if key not in self._refs:
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
        self._ids[key] = tensor_id
        self._keys[tensor_id] = key

    def storage(self, tensor_id: int) -> torch.UntypedStorage | None:
        """The live storage that has ``tensor_id`` (the latest one given it), if any."""
        key = self._keys.get(tensor_id)
        ref = self._refs.get(key) if key is not None else None
        s = ref() if ref is not None else None
        return s if s is not None and self._ids.get(key) == tensor_id else None  # type: ignore[arg-type]

    def _freed(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        """The weak-reference callback (NOTE [ Signals in free callbacks ])."""
        if threading.get_ident() != self._thread:
            self._pending.append((key, ref))  # NOTE [ Frees on other threads ]
        else:
            self._free(key, ref)

    def _free(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        if self._refs.get(key) is not ref:
            return  # already applied
        del self._refs[key]
        tid = self._ids.pop(key, None)
        if tid is not None and self._keys.get(tid) == key:
            del self._keys[tid]
        if tid is not None and self.on_free is not None:
            self.on_free(tid)

    def release(self, storage: torch.UntypedStorage) -> int | None:
        """Forget ``storage`` as if it had been freed (``on_free`` runs), though the object lives
        on: someone freed its memory in place. Used again, it is named anew. Its id, if any.
        On another thread (CUDA's autograd runs backward on a device thread, where FSDP2 frees
        its unsharded parameters) the release is queued like a free (NOTE [ Frees on other
        threads ])."""
        key = id(storage)
        ref = self._refs.get(key)
        if ref is None or ref() is not storage:
            return None
        tid = self._ids.get(key)
        if threading.get_ident() != self._thread:
            self._pending.append((key, ref))
        else:
            self._free(key, ref)
        return tid

    def move(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """Give ``old``'s id to ``new`` and forget ``old`` without a free (``on_free`` does not
        run, now or when ``old`` dies): one storage of the op stream that is two objects here
        (fake mode's copy of a constant, NOTE [ Fake constants ] in torch_patch.fake)."""
        if self._pending:
            self.drain()
        key = id(old)
        tid = self._ids.pop(key, None)
        self._refs.pop(key, None)
        if tid is not None:
            self.assign(new, tid)

    def drain(self) -> None:
        """Apply the frees queued on other threads (NOTE [ Frees on other threads ])."""
        while self._pending:
            self._free(*self._pending.popleft())

    def live(self) -> dict[int, torch.UntypedStorage]:
        """Tensor id -> storage of every tracked storage still alive."""
        out = {}
        for key, ref in list(self._refs.items()):
            s = ref()
            if s is not None and key in self._ids:
                out[self._ids[key]] = s
        return out

    def clear(self) -> None:
        self.on_free = None
        self._pending.clear()
        self._ids.clear()
        self._refs.clear()
        self._keys.clear()


# NOTE [ Signals in free callbacks ]: CPython runs a signal's Python handler on the main thread
# at the next bytecode boundary, and that can be inside a weak-reference callback. An
# exception raised there is reported as unraisable and dropped. So a Ctrl-C
# (KeyboardInterrupt), or the SIGTERM torchrun sends (SystemExit from teraio's handler), that
# lands in ``StorageIds._freed`` was lost, and the run trained on; it also stopped the free's
# bookkeeping half way. Measured here (the fault test's script, Ctrl-C at a random moment): 1 of
# 25 lost without what follows, 0 of 25 with it, alternated in one run.
#
# While an op stream is active, the SIGINT and SIGTERM handlers are wrapped: a signal that
# lands inside a free callback (as the handler's own caller shows, not the frame it is given,
# which ``runtime.executor.signals_held`` replays later) is sent again to the main thread 10 ms
# later (``signal.pthread_kill`` from a timer thread; sent from the handler itself it would
# run the handler again at once, still inside the callback), and again while the callback
# lasts. A real signal, not ``_thread.interrupt_main``: it interrupts a blocking wait, and the
# handler in force by then acts, the default action included. The handler only puts the signal
# on a ``SimpleQueue`` (C code, whole or not at all) for one daemon thread started beforehand:
# starting a thread (or a ``threading.Timer``) in the handler takes Python-level locks that a
# second signal could leave held (NOTE [ Ctrl-C and the engine ] in runtime.engine).
_CALLBACK_CODES = frozenset({StorageIds._freed.__code__, StorageIds._free.__code__})
_REDELIVER_S = 0.01
_redeliveries: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()  # (thread ident, signal)
_redeliverer: threading.Thread | None = None


def _redeliver() -> None:
    while True:
        thread, signum = _redeliveries.get()
        time.sleep(_REDELIVER_S)
        signal.pthread_kill(thread, signum)


def _in_callback(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _CALLBACK_CODES:
            return True
        frame = frame.f_back
    return False


@contextmanager
def signals_outside_callbacks() -> Iterator[None]:
    """Python-level SIGINT and SIGTERM handlers act outside free callbacks (NOTE [ Signals in
    free callbacks ]). Main thread only; elsewhere, and for a handler that is not Python's, a
    no-op. At exit a handler is restored only where the wrapper is still in place (one the body
    installed stays)."""
    global _redeliverer
    wrapped: dict[signal.Signals, tuple[Any, Any]] = {}
    if threading.current_thread() is threading.main_thread() and sys.platform != "win32":
        if _redeliverer is None or not _redeliverer.is_alive():  # none yet, or a forked child
            _redeliverer = threading.Thread(target=_redeliver, daemon=True, name="teraio-redeliver")
            _redeliverer.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if callable(handler):
                wrapper = _deferring(handler)
                wrapped[sig] = (handler, wrapper)
                signal.signal(sig, wrapper)
    try:
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
            _redeliveries.put((main, signum))
            return None
        return handler(signum, frame)

    return deferring
