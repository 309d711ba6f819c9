"""The op stream every teraio dispatch mode shares: op counting, storage ids, phases,
module paths and iteration boundaries.

``OpStream`` is a ``TorchDispatchMode``. For every aten op it names the input
storages (``torch_patch.identity``), lets a subclass run the op
(``run_op``: the tracer times it, the runtime first makes its inputs
resident), then names the new output storages. Iteration boundaries come from
a global optimizer step post-hook (the iteration ends when every live
optimizer has stepped since the last boundary, so several optimizers and
gradient accumulation both work) or from ``teraio.mark_iteration()``, which
once called replaces the optimizer rule.

NOTE [ Data loading is not counted ]: a ``DataLoader`` makes its batches with
ops whose number changes from step to step (with worker processes, the main
thread rebuilds each batch from shared memory when it arrives, and batches
arrive early or late; a new epoch seeds its sampler). Those ops run uncounted
(``uncounted``), on the training thread only, so a batch is a storage born
outside the traced ops: it gets an input id where an op first uses it, the
same every step. What those ops read, though, no plan may move: an in-memory
data set (a ``TensorDataset``) is read by every step's loading, which the
profile does not count, so its storages are others' to manage
(``_theirs``): the plan of iteration 0 had a data set out after its
making, the first batch brought it back, and the iteration went 27% over its
budget. With worker processes, the workers read the data set, in processes
forked when an epoch's iterator is made: a data set the plan had out there
stopped the job (NOTE [ Forked children ] in ``runtime.executor``). So before
a loader with workers makes its iterator, the tensors its data set holds
(``_held_by``: through attributes, sequences and mappings, as a
``TensorDataset``, a ``Subset`` or a data set class keeps them) are others' to
manage too, on whatever thread makes the iterator (a prefetching thread). A
tensor the data set reaches any other way (a global its ``__getitem__`` reads,
one in a set or in ``__slots__``, one past the walk's bounds) is not found: a
worker that reads it while it is out stops with that error.

NOTE [ Compiled code ]: a ``TorchDispatchMode`` does not see inside compiled
(inductor) graphs; while one is active, ``torch.compile``d code runs eagerly.
Under teraio it therefore computes what the eager model computes (bit for bit),
not what the compiled model does. The stream notes every ``torch.compile``
call and compiled module it sees (``compiled``) and says so once
(``on_compiled``).

The tensor loop is written out by hand: a ``tree_flatten`` recorder measured
25-45 us per op on these machines against 7-13 us for a lean one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import itertools
import os
import sys
import threading
import types
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers its reducers on ForkingPickler (NOTE [ Shared memory ])
import torch.utils.data.dataloader as _dataloader
import torch.utils.dlpack
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.storage import TypedStorage
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

from torch_patch.identity import (
    CARRIED_FLAG,
    LONG_BASE,
    PRODUCED_BASE,
    StorageIds,
    deliver_owed_signal,
    has_parameters,
    input_id,
    long_id,
    owed_signals,
    persistent_names,
    produced_id,
    signals_outside_callbacks,
    wrapped,
)

__all__ = ["OpInfo", "OpStream", "active_stream", "holders", "mark_iteration", "parts"]

_ACTIVE: list[OpStream] = []
_Tensor = torch.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"  # NOTE [ Pointer checks ]


def _local(t: _Tensor) -> _Tensor:
    """NOTE [ DTensors ]: a DTensor (FSDP2's parameters, gradients, optimizer state) has no
    real storage: its ``untyped_storage()`` reports the global size and cannot be resized.
    Its bytes are in its local shard, whose storage is the one teraio names and moves; an
    op on DTensors counts as an access of their local storages.

    So for any other wrapper subclass of one tensor (``__tensor_flatten__`` naming one): a
    functional collective's result (``AsyncCollectiveTensor``, which DTensor's redistributions
    and ``torch.distributed._functional_collectives`` return) wraps the tensor the collective
    fills, and an op on it, which waits for the collective first, uses that tensor. Its own
    storage is no memory at all: reading it, as the profile's fingerprints of live storages
    do, crashed the process (NOTE [ Busy in a collective ] in planner.problem). A wrapper of
    several is ``t`` itself here (NOTE [ Wrapper subclasses ])."""
    if type(t) in _PLAIN:
        return t
    inner = wrapped(t)
    return inner[0][1] if len(inner) == 1 else t


# NOTE [ Sparse tensors ]: a sparse tensor has no storage of its own: its bytes are in
# dense tensors it holds (COO: indices and values; compressed layouts: the compressed and
# plain indices and the values), which an op on it reads or writes as any other argument
# (``sparse.mul_(0.9)`` writes its values; ``dense.add_(sparse)`` reads them). Skipped, as
# they were, an op on a sparse tensor looked to teraio as if it touched none of them, and
# `teraio run` could free or be still filling its values under that op: wrong results with
# no error (or a crash inside PyTorch). So an op's sparse argument or result counts as an
# access of each of its parts, each a tensor with a storage teraio names and may move.
# Positions: each part takes one (so parts made outside any op get ids of their own), then
# the sparse tensor one more.
def parts(t: _Tensor) -> tuple[_Tensor, ...]:
    """The dense tensors holding a sparse tensor's bytes; () for any other storage-less
    tensor (NOTE [ Sparse tensors ])."""
    layout = t.layout
    try:
        if layout is torch.sparse_coo:
            return (t._indices(), t._values())
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return (t.crow_indices(), t.col_indices(), t.values())
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return (t.ccol_indices(), t.row_indices(), t.values())
    except (RuntimeError, NotImplementedError):
        pass
    return ()


def holders(t: _Tensor) -> tuple[_Tensor, ...]:
    """The tensors whose storages hold ``t``'s bytes: its own (a DTensor's local shard, a one-tensor
    wrapper's inner tensor: ``_local``), a sparse tensor's parts, and each tensor inside a wrapper
    subclass of several (NOTE [ Wrapper subclasses ])."""
    inner = (t,) if type(t) in _PLAIN else tuple(i for _, i in wrapped(t))
    return tuple(h for i in inner for h in ((i,) if i.layout is torch.strided else parts(i)))


def tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[_Tensor]:
    """The tensors among an op's arguments, in lists and in lists of lists (Tensor[][]: c10d's
    ``allgather_``), as ``OpStream.__torch_dispatch__`` finds them."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Tensor):
                    yield b
                elif isinstance(b, (list, tuple)):
                    yield from (c for c in b if isinstance(c, _Tensor))


_HELD_BY_LIMIT = 100_000  # objects a walk of a data set visits at most (a list of samples)
_NOT_HOLDING = (str, bytes, int, float, complex, type, types.ModuleType, types.FunctionType, type(None))


def _held_by(obj: object) -> Iterator[_Tensor]:
    """The tensors ``obj`` holds through attributes, sequences and mappings, breadth first, eight
    levels deep, at most ``_HELD_BY_LIMIT`` objects visited and ten times as many items looked at
    in all (a data set of token id lists: NOTE [ Data loading is not counted ])."""
    seen: set[int] = set()
    todo: deque[tuple[object, int]] = deque([(obj, 0)])
    budget = 10 * _HELD_BY_LIMIT
    while todo and len(seen) < _HELD_BY_LIMIT:  # with the budget spent, what is queued still counts
        o, depth = todo.popleft()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, _Tensor):
            yield o
            continue
        if depth >= 8:
            continue
        if isinstance(o, dict):
            children: Iterable[object] = o.values()
        elif isinstance(o, (list, tuple)):
            children = o
        else:
            try:  # not through a class's __getattr__; a lazy handle's __dict__ may raise
                children = object.__getattribute__(o, "__dict__").values()
            except Exception:  # noqa: BLE001 - whatever it raises, it holds nothing we can see
                continue
        for c in itertools.islice(children, budget):
            budget -= 1
            if not isinstance(c, _NOT_HOLDING):
                todo.append((c, depth + 1))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic collector off for the body, back as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _own_storage(t: _Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage (a DTensor's local one); None for a tensor with no storage of its own (a
    wrapper subclass of several: NOTE [ Wrapper subclasses ])."""
    t = _local(t)
    if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _forget(names: dict[int, str], ids: list[int]) -> None:
    """A root module died: its modules' names go with it (NOTE [ Roots ])."""
    for i in ids:
        names.pop(i, None)


def _compiled_module_name(module: torch.nn.Module) -> str | None:
    """The compiled model's class name if ``module`` is a ``torch.compile``d module. (Dynamo
    is imported by whoever compiled it; importing it here would cost 1.6 s of start-up.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    return type(module._orig_mod).__name__


def active_stream() -> OpStream | None:
    return _ACTIVE[-1] if _ACTIVE else None


def mark_iteration() -> None:
    """Mark the end of a training iteration, for loops that do not step a ``torch.optim``
    optimizer. Without an active teraio session this does nothing."""
    stream = active_stream()
    if stream is not None:
        stream.explicit_boundary()


@dataclass(frozen=True)
class OpInfo:
    name: str
    skip: bool  # profiler bookkeeping and metadata queries: not counted, touch no data
    mutable_args: frozenset[int]  # positions of arguments the op writes
    mutable_kwargs: frozenset[str]
    peer_arg: int | None = None  # a point-to-point op's argument holding the other rank
    view: bool = False  # an alias of an argument, made without reading it or checking its size
    read_unseen: int | None = None  # a result read later through its pointer (NOTE [ Read through pointers ])


# NOTE [ Collectives ]: no c10d schema marks what it writes (docs/distributed-notes.md):
# every tensor argument of a c10d op (all but send) whose name does not start with "input" is
# counted as written (``tensors``, ``output_tensors``, ``outputs``, ``output_lists``...), and
# these of FSDP2's copy-in op. A write missed here would let a kept copy be reused over it
# (NOTE [ Copies kept ] in planner.clean).
_OTHER_WRITES = {"fsdp.all_gather_copy_in.default": frozenset({"all_gather_output"})}
# Batch norm's ops update the running statistics in place though their schemas do not say so
# (aten::native_batch_norm, cudnn_batch_norm, batch_norm_update_stats... in torch 2.13): an argument
# of these names counts as written, in any op but a backward one (which only reads them).
_RUNNING_STATS = frozenset({"running_mean", "running_var", "running_min", "running_max"})
# NOTE [ Read through pointers ]: a packed sequence's ``batch_sizes`` (result 1 of
# ``_pack_padded_sequence``) is read by the packed LSTM and GRU, ``_pad_packed_sequence`` and the
# packing's backward, all composite ops whose C++ reads it through its pointer, below any dispatch
# mode. The profile saw it idle after its one ``.item()``, and a plan at 35% of the peak sent the
# 192-byte tensor out: the LSTM read freed memory ("data is not allocated yet", or a slice of
# length 7484025741087915788). So such a result is others' to manage, never planned nor freed.
_READ_THROUGH_POINTERS = {"aten._pack_padded_sequence.default": 1}


def _op_info(func: Any) -> OpInfo:
    args = func._schema.arguments
    writes = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if func.namespace == "c10d" and func._schema.name != "c10d::send":
        named = frozenset(a.name for a in args if not a.name.startswith("input"))
    else:
        named = _OTHER_WRITES.get(str(func), frozenset())
    if "backward" not in func._schema.name:
        named |= _RUNNING_STATS
    writes += [i for i, a in enumerate(args) if a.name in named and i not in writes]
    # prim::device and friends are metadata queries that only tensor subclasses (fake
    # tensors) send through dispatch modes: no op, no data, not counted.
    skip = func.namespace in ("profiler", "prim")
    # c10d::send(tensors, process_group, int dst, int tag); c10d::recv_(..., int src, ...): ranks of
    # the op's group (torch 2.13's names; dstRank and srcRank before), which the tracer turns
    # into the job's ranks (a sub-group's through its global ranks).
    point_to_point = func._schema.name in ("c10d::send", "c10d::recv_")
    peer = next((i for i, a in enumerate(args) if a.name in ("dst", "src", "dstRank", "srcRank")),
                None) if point_to_point else None
    # only aliases made without a check of the storage's size (one out has 0 bytes): slice,
    # select, transpose, expand... check it ("setStorage: ... out of bounds")
    view = str(func) in UNCHECKED_ALIASES
    return OpInfo(str(func), skip, frozenset(writes), frozenset(args[i].name for i in writes), peer, view,
                  _READ_THROUGH_POINTERS.get(str(func)))


UNCHECKED_ALIASES = frozenset({"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default",
                                "aten.view.default", "aten.view.dtype", "aten._reshape_alias.default"})


_loads = threading.local()  # ``owning``: inside a torch.load whose storages teraio owns


def _owned(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """``storage``, or, if it is CPU memory PyTorch cannot resize (a checkpoint reader's), a copy
    in PyTorch's own, made by ops the stream sees (NOTE [ Loaded storages ])."""
    if storage.device.type != "cpu" or storage.resizable() or not storage.nbytes() or storage.is_shared():
        return storage
    with torch.no_grad():
        own = torch.empty(storage.nbytes(), dtype=torch.uint8)
        own.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    return own.untyped_storage()


class OpStream(TorchDispatchMode):
    """Base dispatch mode; see the module docstring. Subclasses override the hooks."""

    guards_threads = False  # NOTE [ Ops on other threads ]: see the ops of threads started later

    def __init__(self) -> None:
        super().__init__()
        self.ids = StorageIds(on_free=self.on_free)
        self.iteration = 0
        self.op_index = 0  # ops started in this iteration; also the index of the next op
        self.module_stack: list[str] = []
        self.persistent: dict[int, tuple[str, str]] = {}  # tensor id -> (name, kind)
        self.labels: dict[int, tuple[str, str]] = {}  # made this iteration -> (name, kind)
        self._infos: dict[Any, OpInfo] = {}
        self._roots: list[weakref.ref[torch.nn.Module]] = []  # NOTE [ Roots ]
        self._late_roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # NOTE [ Late roots ]
        self._called_roots: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # in this iteration
        self._module_names: dict[int, str] = {}
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._stepped: set[int] = set()
        # each optimizer registered: its number, and what it is (``never_stepped``)
        self._serial: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._built: list[str] = []
        self._ever_stepped: set[int] = set()  # their numbers
        self._in_optimizer = 0
        self._steps_seen = 0  # optimizer steps ended so far (NOTE [ Skipped steps ])
        self._explicit = False
        self._num_long = 0  # long-lived unnamed storages numbered so far (profiles.ids)
        self.uncounted = 0  # above 0: ops pass through uncounted (torch_patch.fake, data loading)
        # above 0: what uncounted ops read or write is others' to manage (a DataLoader's own code: NOTE
        # [ Data loading is not counted ]; a communication hook's callback: NOTE [ Communication hooks ])
        self.theirs = 0
        self.compiled: list[str] = []  # NOTE [ Compiled code ]
        # storages others manage, and why: never planned nor freed (NOTE [ Storages others
        # resize ], NOTE [ DLPack exports ], NOTE [ Communication hooks ])
        self.foreign: weakref.WeakKeyDictionary[torch.UntypedStorage, str] = weakref.WeakKeyDictionary()
        self.in_comm_hook = 0  # above 0: inside a DDP communication hook
        self._handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
        self._patched_items: list[tuple[dict[Any, Any], Any, Any]] = []  # (table, key, original)
        self._warning_filters: warnings.catch_warnings[None] | None = None
        self._signals: AbstractContextManager[None] | None = None  # NOTE [ Signals in free callbacks ]
        self._thread = threading.get_ident()
        self._pid = os.getpid()
        self._fsdp_patched = False  # NOTE [ Pointer checks ]

    # ---- hooks for subclasses -------------------------------------------------
    def run_op(self, index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               inputs: list[tuple[int, _Tensor, bool]]) -> Any:
        """Run op ``index``; ``inputs`` holds (tensor id, tensor, written) per tensor argument."""
        return func(*args, **kwargs)

    def after_op(self, index: int, info: OpInfo, inputs: list[tuple[int, _Tensor, bool]],
                 outputs: list[tuple[int, _Tensor, bool]]) -> None:
        """``outputs`` holds (tensor id, tensor, is a new storage) per output tensor."""

    def on_free(self, tensor_id: int) -> None:
        """A tracked storage was freed; ``self.op_index`` is the first op it is not alive at."""

    def end_iteration(self) -> None:
        """Called at a boundary, before persistent storages are renamed."""

    def renamed(self, new_ids: dict[int, int]) -> None:
        """Called at a boundary after the renaming: old tensor id -> new, for every
        live storage whose id changed."""

    def begin_iteration(self) -> None:
        """Called after a boundary, with ``self.iteration`` already advanced."""

    def run_uncounted(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an op that is not counted (NOTE [ Data loading is not counted ])."""
        return func(*args, **kwargs)

    def on_foreign(self, storage: torch.UntypedStorage) -> None:
        """``storage`` became someone else's to manage (``foreign``)."""

    def bring_back(self, storage: torch.UntypedStorage) -> None:
        """``storage``'s memory is about to be read or handed out outside any op (NOTE [ DLPack
        exports ]): if it is out, bring it back."""

    def kept_in(self, storages: list[torch.UntypedStorage | None]) -> AbstractContextManager[None]:
        """The same, for a thread other than the training thread: ``storages`` back in memory,
        and kept there for the body (NOTE [ Reads on other threads ] in runtime.executor)."""
        return contextlib.nullcontext()

    def run_elsewhere(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], info: OpInfo) -> Any:
        """Run an op of a thread of the script's own (NOTE [ Ops on other threads ])."""
        return func(*args, **kwargs)

    def visited(self, storages: Sequence[torch.UntypedStorage]) -> AbstractContextManager[None]:
        """``storages`` in memory for a read outside any op that changes nothing, and where they
        were after it (NOTE [ Pointer checks ])."""
        return self._in_memory(storages)

    def on_compiled(self, what: str) -> None:
        """``torch.compile`` was called on ``what``, or a compiled module ran (NOTE [ Compiled
        code ]); the first time, say what happens to it."""
        if len(self.compiled) == 1:
            warnings.warn(
                f"teraio: torch.compile ({what}): compiled code runs eagerly under teraio (its "
                "dispatch mode does not see inside compiled graphs), so results match the eager "
                "model's, not the compiled one's; see docs/compile.md", RuntimeWarning, stacklevel=3)

    # ---- the dispatch mode ----------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.ids.dispatching()  # NOTE [ Frees on other threads ] in torch_patch.identity
        if owed_signals:  # NOTE [ Signals in free callbacks ] in torch_patch.identity
            deliver_owed_signal()
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _op_info(func)
        if info.skip:
            return func(*args, **kwargs)
        if self.uncounted:
            if self.theirs:
                self._theirs(args, kwargs)
            return self._read_unseen(info, self.run_uncounted(func, args, kwargs))  # a collate_fn's
        index = self.op_index
        self.op_index = index + 1
        ids = self.ids
        inputs: list[tuple[int, _Tensor, bool]] = []
        pos = 0
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                pos = self._input(index, pos, a, i in info.mutable_args, inputs, ids)
            elif isinstance(a, torch.UntypedStorage):  # ``set_(storage)``: NOTE [ Storage arguments ]
                view = torch.empty(0, dtype=torch.uint8, device=a.device).set_(a)
                pos = self._input(index, pos, view, False, inputs, ids)
            elif isinstance(a, (list, tuple)):
                w = i in info.mutable_args
                for b in a:
                    if isinstance(b, _Tensor):
                        pos = self._input(index, pos, b, w, inputs, ids)
                    elif isinstance(b, (list, tuple)):  # Tensor[][] (c10d allgather_, gather_)
                        for c in b:
                            if isinstance(c, _Tensor):
                                pos = self._input(index, pos, c, w, inputs, ids)
        for key, a in kwargs.items():
            if isinstance(a, _Tensor):
                pos = self._input(index, pos, a, key in info.mutable_kwargs, inputs, ids)
            elif isinstance(a, (list, tuple)):
                w = key in info.mutable_kwargs
                for b in a:
                    if isinstance(b, _Tensor):
                        pos = self._input(index, pos, b, w, inputs, ids)
                    elif isinstance(b, (list, tuple)):
                        for c in b:
                            if isinstance(c, _Tensor):
                                pos = self._input(index, pos, c, w, inputs, ids)

        if self.in_comm_hook:
            self._hook_touched(inputs)
        out = self.run_op(index, func, args, kwargs, inputs)

        outputs: list[tuple[int, _Tensor, bool]] = []
        if isinstance(out, _Tensor):
            self._output(index, 0, out, outputs, ids)
        elif isinstance(out, (list, tuple)):
            n = 0
            for o in out:
                if isinstance(o, _Tensor):
                    n = self._output(index, n, o, outputs, ids)
                elif isinstance(o, (list, tuple)):
                    for p in o:
                        if isinstance(p, _Tensor):
                            n = self._output(index, n, p, outputs, ids)
        if self.in_comm_hook:
            self._hook_touched(outputs)
        self.after_op(index, info, inputs, outputs)
        return self._read_unseen(info, out)

    def _read_unseen(self, info: OpInfo, out: Any) -> Any:
        """``out``, its result read through its pointer later others' to manage (NOTE [ Read through
        pointers ]), where op ``info`` ran: counted, uncounted, or on a thread of the script's own."""
        if info.read_unseen is not None:
            self._others_manage(out[info.read_unseen].untyped_storage(), "code reads it through its data pointer")
        return out

    # NOTE [ Storage arguments ]: ``t.set_(storage, ...)`` (how ``copy.deepcopy`` and
    # ``torch.load`` rebuild a tensor, after cloning or reading its storage) takes a storage, not
    # a tensor; skipped, the op looked to teraio as if it did not use that storage, and `teraio
    # run` could have it out at the op (a deep copy of a state dict then failed in ``set_``). It
    # counts as an input, through a byte view of it.
    # NOTE [ Wrapper subclasses ]: a wrapper subclass of several tensors (``__tensor_flatten__``
    # naming them; torchao's float8 and NF4 tensors are so: data and scale) has a storage of its
    # own that holds no memory, and its op runs on the tensors inside, below the mode. Taken as it
    # was, its storage was named and read at the profile's fingerprints (a crash), and the tensors
    # inside were never seen used, so a plan could free them under the ops on it. So, as a sparse
    # tensor's parts, each tensor inside counts as an argument or result of the op (``holders``).
    @staticmethod
    def _input(index: int, pos: int, t: _Tensor, write: bool,
               inputs: list[tuple[int, _Tensor, bool]], ids: StorageIds) -> int:
        if type(t) not in _PLAIN:
            t = _local(t)
            if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):  # NOTE [ Wrapper subclasses ]
                for part in holders(t):
                    pos = OpStream._input(index, pos, part, write, inputs, ids)
                return pos + 1
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse: NOTE [ Sparse tensors ]
            for part in parts(t):
                pos = OpStream._input(index, pos, part, write, inputs, ids)
            return pos + 1
        tid = ids.get(s)
        if tid is None:
            tid = input_id(index, pos)
            ids.assign(s, tid)
        inputs.append((tid, t, write))
        return pos + 1

    @staticmethod
    def _output(index: int, pos: int, t: _Tensor,
                outputs: list[tuple[int, _Tensor, bool]], ids: StorageIds) -> int:
        """Records output ``t`` at position ``pos``; returns the next output's position."""
        if type(t) not in _PLAIN:
            t = _local(t)
            if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):  # NOTE [ Wrapper subclasses ]
                for part in holders(t):
                    pos = OpStream._output(index, pos, part, outputs, ids)
                return pos + 1
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse: NOTE [ Sparse tensors ]
            for part in parts(t):
                pos = OpStream._output(index, pos, part, outputs, ids)
            return pos + 1
        tid = ids.get(s)
        if tid is None:
            tid = produced_id(index, pos)
            ids.assign(s, tid)
            outputs.append((tid, t, True))
        else:
            outputs.append((tid, t, False))
        return pos + 1

    def movable(self, storage: torch.UntypedStorage) -> bool:
        """Whether teraio may free ``storage`` in place: ``resize_`` can (its memory is not
        numpy's, shared memory's or DLPack's; ``share_memory_()`` leaves a storage looking
        resizable, and resizing it then crashes the process) and no one else manages it (NOTE
        [ Storages others resize ], NOTE [ DLPack exports ])."""
        return (storage.resizable() and storage not in self.foreign
                and not (storage.device.type == "cpu" and storage.is_shared()))

    def input_storage(self, tensor_id: int, t: _Tensor) -> torch.UntypedStorage | None:
        """After its op, the storage of input ``t`` that ``tensor_id`` names: ``t``'s, unless the
        op gave ``t`` another (``set_``, with which ``torch.load`` rebuilds every tensor), then the
        one it had if still alive; its size is not the new one's."""
        s = t.untyped_storage()
        return s if self.ids.get(s) == tensor_id else self.ids.storage(tensor_id)

    def phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self.module_stack or torch.is_grad_enabled():
            return "forward"
        return "other"

    def module(self) -> str | None:
        return self.module_stack[-1] if self.module_stack else None

    # ---- iteration boundaries -------------------------------------------------
    def explicit_boundary(self) -> None:
        self._explicit = True
        self._boundary()

    def forked(self) -> bool:
        """Whether this is a process forked from the one this stream was entered in (NOTE [ Forked
        children ] in runtime.executor)."""
        return os.getpid() != self._pid

    def _boundary(self) -> None:
        if self.forked():  # a forked child's steps (Hogwild workers') are not the script's iterations:
            return  # counted, the profile's stopped a worker at its third step, and the job hung
        self._trained_instead()
        named, _ = persistent_names(self.named_roots(), self.optimizers())
        # Storages made in this iteration that are about to get persistent names
        # (gradients with zero_grad(set_to_none=True)): their kind, for end_iteration.
        self.labels = {}
        for pn in named:
            old = self.ids.get(pn.storage)
            if old is not None and old not in self.persistent:
                self.labels[old] = (pn.name, pn.kind)
        self.end_iteration()
        new_ids: dict[int, int] = {}
        # NOTE [ Names let go ]: a storage named at the last boundary that no name holds now (a
        # model rebuilt to resume from a checkpoint, whose old weights the last loss's graph
        # still holds; a layer replaced) becomes long-lived (profiles.ids) before the numbers
        # are given again. Kept, it would share its number with the storage now given it, and
        # its free would drop that storage's entries (its size, and in `teraio run` the record
        # and the copy of its offloaded bytes).
        keys = {id(pn.storage) for pn in named}
        for tid, storage in self.ids.live().items():
            if tid < PRODUCED_BASE and id(storage) not in keys:
                new_ids[tid] = long_id(self._num_long)
                self._num_long += 1
                self.ids.assign(storage, new_ids[tid])
        for number, pn in enumerate(named):
            old = self.ids.get(pn.storage)
            if old is not None and old != number:
                new_ids[old] = number
            self.ids.assign(pn.storage, number)
            self.persistent[number] = (pn.name, pn.kind)
        for number in [n for n in self.persistent if n >= len(named)]:
            del self.persistent[number]
        for tid, storage in self.ids.live().items():  # transient storages alive (profiles.ids)
            if tid < PRODUCED_BASE or LONG_BASE <= tid < CARRIED_FLAG:
                continue  # persistent, or long-lived already
            if tid & CARRIED_FLAG:  # alive a whole iteration: long-lived
                new = long_id(self._num_long)
                self._num_long += 1
            else:
                new = tid | CARRIED_FLAG
            new_ids[tid] = new
            self.ids.assign(storage, new)
        if new_ids:
            self.renamed(new_ids)
        self.iteration += 1
        self.op_index = 0
        self._stepped.clear()
        self._called_roots = weakref.WeakSet()
        self.begin_iteration()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        alive = [o for o in (r() for r in self._optimizers) if o is not None]
        return alive

    def never_stepped(self) -> tuple[list[str], bool]:
        """What the optimizers built and never stepped are (alive or not, as a script's locals
        are gone when it ends), and whether any optimizer stepped."""
        return [d for i, d in enumerate(self._built) if i not in self._ever_stepped], bool(self._ever_stepped)

    def _register_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if all(r() is not opt for r in self._optimizers):
            self._optimizers.append(weakref.ref(opt))
            n = sum(len(g["params"]) for g in opt.param_groups)
            with contextlib.suppress(TypeError):  # an optimizer class that is not hashable
                self._serial[opt] = len(self._built)
                self._built.append(f"{type(opt).__name__} over {n} parameters")

    def _step_pre(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._register_optimizer(opt)
        self._in_optimizer += 1

    def _step_post(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._in_optimizer -= 1
        self._steps_seen += 1
        with contextlib.suppress(TypeError):
            self._ever_stepped.add(self._serial.get(opt, -1))
        self._stepped_now(opt)

    def _stepped_now(self, opt: torch.optim.Optimizer) -> None:
        if self._explicit:
            return
        self._stepped.add(id(opt))
        if all(id(o) in self._stepped for o in self.optimizers()):
            self._boundary()

    # NOTE [ Skipped steps ]: a loss scaler (torch.amp.GradScaler) does not call the optimizer's
    # step when the gradients overflowed, as they do now and then in fp16 training. No step, no
    # boundary: the skipped step and the next one ran as one iteration, which left the plan where
    # the step should have been and ran the next step's forward and backward on demand, at 2x the
    # budget (an fp16 run on a GPU would have run out of memory there). So a step the scaler skips
    # ends the iteration as the optimizer's step would have: that iteration leaves the plan only at
    # its end, short of the step's ops, and the next one follows it. Skips before the optimizer's
    # first step (a scale that starts too high) still run on into it: iteration 0 is the one that
    # makes the optimizer's state, as iteration 0's plan has it (ended at the skip, the next
    # iteration made the state, unlike every plan, at 2.4x the budget).
    def _scaling(self, step: Any) -> Any:
        stream = self

        @functools.wraps(step)
        def scaler_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            seen = stream._steps_seen
            out = step(scaler, optimizer, *args, **kwargs)
            if stream._steps_seen == seen and threading.get_ident() == stream._thread:
                try:
                    stepped_before = stream._serial.get(optimizer, -1) in stream._ever_stepped
                except TypeError:  # an optimizer class that is not hashable
                    stepped_before = True
                if stepped_before:
                    stream._stepped_now(optimizer)
            return out

        return scaler_step

    # NOTE [ Traced code ]: ``torch.jit.trace`` under any dispatch mode (teraio's, or a five-line
    # one of the script's own) records a Python number in the traced code (``x * 0.5``) as a
    # value the trace then cannot run ("Unable to cast 0.5 to Tensor"). Traced with the modes
    # off, the module's tensors may be out (freed in place), and a function's closure holds
    # tensors teraio cannot find to bring back; so teraio does not trace for the script, and
    # says so where the trace fails. ``torch.jit.script`` runs under teraio.
    def _tracing(self, trace: Any) -> Any:
        @functools.wraps(trace)
        def tracing(*args: Any, **kwargs: Any) -> Any:
            try:
                return trace(*args, **kwargs)
            except RuntimeError as exc:
                if "Unable to cast" not in str(exc):
                    raise
                raise RuntimeError(
                    "teraio: torch.jit.trace cannot trace code that uses Python numbers under teraio (its "
                    "dispatch mode makes the trace record them as values the traced code cannot run; "
                    "so does any dispatch mode): use torch.jit.script, or the module untraced "
                    "(NOTE [ Traced code ] in torch_patch/opstream.py)") from exc

        return tracing

    # ---- module paths ---------------------------------------------------------
    def _module_name(self, module: torch.nn.Module) -> str:
        name = self._module_names.get(id(module))
        if name is not None:
            return name
        if not self.module_stack:  # a new root model
            roots = [m for m in self.roots() if has_parameters(m)]
            if self._steps_seen and any(m not in self._late_roots for m in roots):  # NOTE [ Late roots ]
                self._late_roots.add(module)
            self._roots.append(weakref.ref(module))
            if not has_parameters(module):  # a loss module: by its type, apart from the models' paths
                prefix = f"{type(module).__name__}."
            else:
                prefix = f"root{len(roots)}." if roots else ""
            named = []
            for sub, m in module.named_modules():
                if id(m) not in self._module_names:
                    self._module_names[id(m)] = (prefix + sub).rstrip(".")
                    named.append(id(m))
            weakref.finalize(module, _forget, self._module_names, named)
            return self._module_names[id(module)]
        name = f"{self.module_stack[-1]}.{type(module).__name__}".lstrip(".")
        self._module_names[id(module)] = name
        return name

    # NOTE [ Roots ]: every module called outside any other is a root, whose parameters and
    # buffers get persistent names (``persistent_names``). teraio holds its roots weakly: a
    # model the script drops (rebuilt to resume from a checkpoint, a copy made for an
    # evaluation) is freed as without teraio, where a list of them kept every one alive for the
    # rest of the run. Its modules' names go with it (their ids may be reused), and the roots
    # left are numbered again at the next boundary.
    def roots(self) -> list[torch.nn.Module]:
        """The root modules called so far that are still alive, in the order first called."""
        live = [m for r in self._roots if (m := r()) is not None]
        if len(live) < len(self._roots):
            self._roots = [r for r in self._roots if r() is not None]
        return live

    # NOTE [ Late roots ]: a root first called after an optimizer's first step while a named
    # root lives (an averaged copy of the model evaluated from some step on) names nothing: its
    # storages stay what they were before it was called (long-lived, profiles.ids), in the run
    # as in a profile that saw it. Named, its arrival shifted the numbers of the optimizers'
    # state (numbered after every root's storages) and renamed every parameter ``root0.*``: no
    # iteration after it followed the plan again, each ran on demand at the plain run's peak
    # (2.00x the budget), and its weights, which the plan moved under their long-lived ids,
    # stayed in memory. A model that replaces the one before (rebuilt to resume, a new fold of
    # k-fold training) is called once the old one is gone, so it is named as that one was; where
    # the old one lived on when it was first called, it is named once no named root is left.
    # A root with no parameter (a loss module called as one, a weighted one's weights a buffer)
    # counts for neither, and takes no number in the names (``persistent_names``): with k-fold
    # training's loss module alive, each new fold's model was late, and every iteration after
    # the first fold ran on demand at 1.65x the budget. Where the old model lives on (kept for
    # an ensemble), the late ones take the names once an optimizer holds their parameters while
    # the named ones idle, neither called in the iteration ending nor an optimizer's
    # (``_trained_instead``; a frozen backbone probed, a model stepped through master copies
    # are called), and the old one's names are let go (NOTE [ Left over ] in runtime.executor):
    # bound to its idle weights, the plan's names had left the second model's iterations at
    # 1.65-1.95x the budget. Not handled: the iteration in which a model built before it and idle
    # until then is first called, where that iteration runs the plan's own ops (a second model
    # built up front and trained with plain SGD after the first: 1.63x; leaving the plan at such
    # a model's first call refused linear probing through a new slice of a frozen model each
    # step). Profile past the change there (``teraio profile --warmup``).
    def named_roots(self) -> list[torch.nn.Module]:
        """The live roots whose storages get persistent names (NOTE [ Late roots ])."""
        roots = self.roots()
        named = [m for m in roots if m not in self._late_roots]
        if self._late_roots and not any(has_parameters(m) for m in named):  # the named ones are gone:
            # the late ones take their place
            self._late_roots = weakref.WeakSet()
            return roots
        return named

    def _trained_instead(self) -> None:
        """At a boundary: where the named roots idle (none called in the iteration ending, nor
        its parameters an optimizer's) while an optimizer holds a late root's (the model before
        kept, an ensemble's, while the next one trains), the late roots take their place
        (NOTE [ Late roots ])."""
        if not self._late_roots:
            return
        held = {id(p) for o in self.optimizers() for g in o.param_groups for p in g["params"]}

        def trained(m: torch.nn.Module) -> bool:
            return any(id(p) in held for p in m.parameters())

        named = [m for m in self.roots() if m not in self._late_roots and has_parameters(m)]
        if not any(m in self._called_roots or trained(m) for m in named) and any(map(trained, self._late_roots)):
            self._late_roots = weakref.WeakSet(named)

    def _fwd_pre(self, module: torch.nn.Module, _args: Any) -> None:
        if not self._fsdp_patched and _FSDP_PARAM in sys.modules:  # before FSDP2's own pre-hooks
            self._patch_fsdp()
        compiled = _compiled_module_name(module)
        if compiled is not None:
            self._note_compiled(compiled)
        if not self.module_stack:
            self._called_roots.add(module)
        self.module_stack.append(self._module_name(module))

    def _note_compiled(self, what: str) -> None:
        if what not in self.compiled:
            self.compiled.append(what)
            self.on_compiled(what)

    def _fwd_post(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.module_stack:
            self.module_stack.pop()

    # ---- context ---------------------------------------------------------------
    def __enter__(self):  # type: ignore[no-untyped-def]
        try:  # whatever stops it half way (Ctrl-C included) leaves torch as it was
            self._handles = []  # each one as it is made: all are removed if this stops half way
            self._handles.append(register_module_forward_pre_hook(self._fwd_pre))
            self._handles.append(register_module_forward_hook(self._fwd_post, always_call=True))
            self._handles.append(register_optimizer_step_pre_hook(self._step_pre))
            self._handles.append(register_optimizer_step_post_hook(self._step_post))
            self._patch(torch.optim.Optimizer, "__init__", self._registering)
            self._thread = threading.get_ident()
            self._pid = os.getpid()
            self._patch(_dataloader.DataLoader, "__iter__", self._uncounted)
            self._patch(_dataloader._BaseDataLoaderIter, "__next__", self._uncounted)
            self._patch(torch, "compile", self._compile)
            # NOTE [ DLPack exports ]
            self._patch(torch.Tensor, "__dlpack__", self._exporting)
            for owner in (torch.utils.dlpack, torch):
                if hasattr(owner, "to_dlpack"):
                    self._patch(owner, "to_dlpack", self._exporting)
            for name in ("tolist", "__deepcopy__", "__repr__", "numpy"):  # read outside any op
                self._patch(torch.Tensor, name, self._reading)
            for owner in (torch, torch.random):  # so is a random state restored (a resume's)
                self._patch(owner, "set_rng_state", self._restoring)
            self._patch(torch.Tensor, "__reduce_ex__", self._pickling)
            self._patch(torch.nn.Parameter, "__reduce_ex__", self._pickling_parameter)
            self._patch(torch.UntypedStorage, "resize_", self._watching_resizes)
            for name in ("share_memory_", "_share_fd_cpu_", "_share_filename_cpu_"):  # NOTE [ Shared memory ]
                if hasattr(torch.UntypedStorage, name):
                    self._patch(torch.UntypedStorage, name, self._sharing)
            reducers = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
            for kind in [k for k in reducers if issubclass(k, (torch.Tensor, torch.UntypedStorage, TypedStorage))]:
                self._patched_items.append((reducers, kind, reducers[kind]))
                reducers[kind] = self._sharing(reducers[kind], devices=("cpu", "cuda"))
            for owner in (torch, torch.serialization):  # NOTE [ Loaded storages ]
                self._patch(owner, "load", self._owning_loads)
            if hasattr(torch.serialization, "_get_restore_location"):
                self._patch(torch.serialization, "_get_restore_location", self._owning_restores)
            self._patch(DistributedDataParallel, "register_comm_hook", self._hooking)
            if torch.distributed.is_available():  # NOTE [ Collectives a script waits for ] in runtime.executor
                self._patch(torch._C._distributed_c10d.Work, "wait", self._waiting)
            self._patch(torch._C.Future, "then", self._calling_back)
            self._patch(torch._C.Future, "add_done_callback", self._calling_back)
            self._patch(torch.amp.GradScaler, "step", self._scaling)  # NOTE [ Skipped steps ]
            for name in ("trace", "trace_module"):  # NOTE [ Traced code ]
                self._patch(torch.jit, name, self._tracing)
            if _FSDP_PARAM in sys.modules:  # else at the first forward, once imported (0.8 s here)
                self._patch_fsdp()
            if self.guards_threads:  # NOTE [ Ops on other threads ]
                self._patch(threading.Thread, "_bootstrap_inner", self._guarding)
            safetensors_torch = _optional("safetensors.torch")  # NOTE [ Pointer checks ]
            for name in ("save_file", "save") if safetensors_torch is not None else ():
                original = getattr(safetensors_torch, name)
                self._patch(safetensors_torch, name, self._pointing)
                self._rebind(original, getattr(safetensors_torch, name))
            # torch warns at every call of a compiled module that global module hooks (ours) fire
            # twice for it; teraio's own warning says what happens to compiled code instead.
            self._warning_filters = warnings.catch_warnings()
            self._warning_filters.__enter__()
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self._signals = signals_outside_callbacks()
            self._signals.__enter__()
            _ACTIVE.append(self)
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    def _patch(self, owner: Any, name: str, wrap: Any) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, wrap(original))

    def _rebind(self, original: Any, wrapped: Any) -> None:
        """``wrapped`` also where a module imported before teraio bound ``original`` by a name of
        its own (peft's and transformers' ``from safetensors.torch import save_file as
        safe_save_file``: NOTE [ Pointer checks ]); restored with the other patches."""
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            # not through the module's own getattr: a lazy module would load (and may raise)
            for attr, value in list(object.__getattribute__(module, "__dict__").items()):
                if value is original:
                    try:
                        setattr(module, attr, wrapped)
                    except Exception:  # noqa: BLE001 - a module that refuses: it keeps its own
                        continue
                    self._patches.append((module, attr, original))

    def _uncounted(self, method: Any) -> Any:
        """``method`` with its ops uncounted on the training thread (NOTE [ Data loading is not
        counted ])."""
        stream = self

        def uncounted(*args: Any, **kwargs: Any) -> Any:
            loader = args[0] if args else None
            if isinstance(loader, _dataloader.DataLoader) and loader.num_workers > 0:
                stream._workers_read(loader.dataset)
            if threading.get_ident() != stream._thread:
                return method(*args, **kwargs)
            with stream._their_ops():
                return method(*args, **kwargs)

        return uncounted

    @contextlib.contextmanager
    def _their_ops(self) -> Iterator[None]:
        """Ops uncounted for the body, and what they read or write others' to manage (``_theirs``)."""
        self.uncounted += 1
        self.theirs += 1
        try:
            yield
        finally:
            self.uncounted -= 1
            self.theirs -= 1

    def _workers_read(self, dataset: object) -> None:
        """The storages of the tensors ``dataset`` holds, which a DataLoader's worker processes
        are about to read, brought back (kept in until they are noted, off the training thread)
        and others' to manage from now on (NOTE [ Data loading is not counted ])."""
        storages: list[torch.UntypedStorage] = []
        with _no_gc():  # its tuples would start collections of the whole heap: 1.7 s for 100 ms
            found = list(_held_by(dataset))
        for t in found:
            for part in holders(t):
                storage = _own_storage(part)
                if storage is not None and storage not in self.foreign:
                    storages.append(storage)
        if storages:
            with self._in_memory(storages):
                for storage in storages:
                    self._others_manage(storage, "a DataLoader's worker processes read it")

    def _theirs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The storages an uncounted op of a DataLoader (an in-memory data set it indexes every
        step) or of a communication hook's callback reads or writes are others' to manage (NOTE
        [ Data loading is not counted ], NOTE [ Communication hooks ])."""
        for t in tensor_args(args, kwargs):
            for part in holders(t):
                self._manage_theirs(part, "a DataLoader or a DDP communication hook's callback uses it in ops "
                                          "teraio does not count")

    # NOTE [ Storages others resize ] (and those exported: NOTE [ DLPack exports ]): FSDP2
    # frees and refills each parameter's unsharded storage with ``untyped_storage().resize_``,
    # the very call teraio frees with, between ops (docs/distributed-notes.md). Such a
    # storage is someone else's to manage: every
    # Python-level resize_ of a storage is noted (``foreign``), and a noted storage
    # is never planned (the profile marks it not resizable) nor freed by the runtime, which
    # resizes through ``runtime.storage`` with the unpatched method. Freed in place (resized
    # to 0), it is freed to teraio too (``StorageIds.release``): refilled, the next op that
    # uses it names it anew, as a storage born outside the ops, so that the memory it takes
    # between a refill and a free counts there, in profiles and at run time alike.
    def _watching_resizes(self, resize: Any) -> Any:
        stream = self

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            stream.foreign.setdefault(storage, "another library resizes it, as FSDP2 does its unsharded parameters")
            # said before a free releases its id, so that the row of the storage it was is marked:
            # FSDP2's first unsharded parameter of each, made by an op, stayed movable in iteration
            # 0's tables (freed in place only after the backward, with reshard_after_forward=False),
            # and iteration 0's plan moved it, which the runtime refused with a warning every run
            stream.on_foreign(storage)
            out = resize(storage, nbytes)
            if nbytes == 0:
                stream.ids.release(storage)  # queued when on another thread
            return out

        return resize_

    # NOTE [ DLPack exports ]: ``np.from_dlpack(t)`` and ``torch.from_dlpack(t)`` give another
    # library (or another tensor, with a storage object of its own) the memory of ``t``'s
    # storage, through ``t.__dlpack__`` or ``to_dlpack``; teraio cannot see what reads or writes
    # it there, and freeing the storage in place would leave the alias on freed memory (wrong
    # numbers with no error, seen). So a storage handed out is one others manage, as one they
    # resize: brought back first if it is out (``bring_back``), then never planned nor freed. A
    # copy (``copy=True``) hands out nothing. (``t.numpy()`` runs a ``detach`` op, which brings
    # it back, and PyTorch marks its storage not resizable; on a thread of the script's own that
    # ``detach`` passes as an alias, NOTE [ Ops on other threads ], and numpy read freed memory: a
    # metric 0.0, not 151.1, so ``numpy`` itself brings it back.) ``t.tolist()``, ``copy.deepcopy(t)``
    # (a storage clone), pickling (``t.__reduce_ex__``, which pickles ``t``'s storage; not inside
    # a torch.save that writes it itself: NOTE [ Streamed saves ] in runtime.saves), printing
    # (``repr(t)``, which indexes ``t`` with every dispatch mode turned off) and restoring a random
    # state (``torch.set_rng_state(t)``) read the memory with no op teraio sees: the tensor is
    # brought back alone (a deep copy of an optimizer's state copied an empty storage, then
    # garbage; ``print(weight)`` raised "out of bounds for storage of size 0"; a resumed script's
    # restore, "data is not allocated yet"). On another thread each is brought back and kept in
    # for the read (NOTE [ Reads on other threads ] in runtime.executor). Not caught:
    # ``__cuda_array_interface__`` (CuPy, Numba), pointers (``data_ptr()``, but for those of NOTE [
    # Pointer checks ]), a storage read by itself (``t.untyped_storage()``),
    # ``torch.Generator.set_state(t)`` (a C++ type, which takes no patch).
    def _exporting(self, export: Any) -> Any:
        stream = self

        def exporting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("copy") is True or tensor.layout is not torch.strided:
                return export(tensor, *args, **kwargs)
            with stream._resident(tensor):
                out = export(tensor, *args, **kwargs)
                stream._others_manage(_local(tensor).untyped_storage(), "it was exported through DLPack")
            return out

        return exporting

    # NOTE [ Shared memory ]: ``share_memory_()`` (``Module.share_memory()``, for an evaluation
    # worker or Hogwild-style training) and a torch.multiprocessing queue (its feeder thread
    # pickles what is put on it with the reducers torch registers on ``ForkingPickler``, which
    # share its storage) move a CPU storage's bytes into shared memory, with no op teraio sees.
    # A tensor teraio had out reached the other process as zeros; one shared with
    # ``share_memory_()`` was shared empty, and its next use failed ("The size of tensor a (0)
    # must match the size of tensor b"). So the storage is brought back first (kept in, on
    # another thread), and from then on it is one others manage: other processes read and write
    # it, and shared memory cannot be freed in place. A CUDA tensor on a queue too (the other
    # process maps its memory by handle; ``share_memory_()`` of a CUDA storage does nothing). A
    # failure to bring one back on the queue's feeder thread (a worker forked while it was out)
    # is printed by multiprocessing and the item dropped, where it used to arrive as zeros.
    def _sharing(self, share: Any, devices: tuple[str, ...] = ("cpu",)) -> Any:
        """``share`` (of a storage, or a queue's reducer of a tensor or storage, for ``devices``)
        with the storage brought back first and others' from then on (NOTE [ Shared memory ])."""
        stream = self

        def sharing(obj: torch.Tensor | torch.UntypedStorage | TypedStorage, *args: Any, **kwargs: Any) -> Any:
            if isinstance(obj, torch.Tensor):  # a sparse one's parts are reduced as tensors
                storage = _own_storage(obj)
            else:
                storage = obj._untyped_storage if isinstance(obj, TypedStorage) else obj
            if storage is None or storage.device.type not in devices:
                return share(obj, *args, **kwargs)
            with stream._in_memory([storage]):
                out = share(obj, *args, **kwargs)
                stream._others_manage(storage, "it is in shared memory, which other processes read and write")
            return out

        return sharing

    # NOTE [ Loaded storages ]: ``torch.load`` gives each CPU tensor a storage whose memory the
    # checkpoint's reader owns, and such a storage cannot be resized (freed in place). After the
    # usual resume (``Optimizer.load_state_dict`` keeps the loaded tensors as they are), every
    # Adam moment stayed in memory for the whole run: a resumed script's smallest plan was 4.5
    # MiB against 3.0 MiB for the same script started afresh. So under teraio each such storage is
    # copied into one of PyTorch's own as torch.load reads it, before any tensor is built on it
    # (one copy of the checkpoint's bytes; views and shared storages share the copy), by ops the
    # stream sees. Not so with ``mmap=True``: memory mapped from the file is what the option is
    # for, and stays in memory.
    def _owning_loads(self, load: Any) -> Any:
        stream = self

        def load_(*args: Any, **kwargs: Any) -> Any:
            mmap = kwargs.get("mmap")
            if mmap is None:
                try:
                    from torch.utils.serialization import config
                except ImportError:  # older torch: mmap only when asked
                    mmap = False
                else:
                    mmap = config.load.mmap
            before = getattr(_loads, "owning", False)
            _loads.owning = not mmap and os.getpid() == stream._pid
            try:
                return load(*args, **kwargs)
            finally:
                _loads.owning = before

        return load_

    def _owning_restores(self, get_restore_location: Any) -> Any:
        """torch.load's per-storage hook (``map_location`` made a function), with the storage
        it gives owned (``_owned``) inside an owning load: every tensor and storage of the
        checkpoint is then built on the copy, views and shared storages alike."""

        def restore_location_of(map_location: Any) -> Any:
            restore = get_restore_location(map_location)
            if not getattr(_loads, "owning", False):
                return restore
            return lambda storage, location: _owned(restore(storage, location))

        return restore_location_of

    # NOTE [ Ops on other threads ]: a dispatch mode sees the ops of its own thread only. Ops on a
    # thread of the script's own (a metrics thread reading the weights, an average updated by a
    # worker) read or wrote a tensor the plan had out: freed memory (a segfault, or a write lost).
    # So every Python thread started while teraio runs (but its own, named ``teraio-*``) runs
    # under a mode of its own (``_Elsewhere``) that, before each op, brings back and holds in
    # memory what the op uses until it ends, as for a torch.save there (NOTE [ Reads on other
    # threads ] in runtime.executor), and drops the kept copy of what it writes (NOTE [ Copies
    # kept ] in planner.clean). Such ops are not counted: no plan knows them, and what they
    # bring back stays in until the plan next sends it out. Threads started before teraio (a
    # pool made at import) and threads of C++ code are not seen.
    def _guarding(self, boot: Any) -> Any:
        ref = weakref.ref(self)  # a thread that outlives teraio does not keep it

        def bootstrap_inner(thread: threading.Thread) -> Any:
            stream = ref()
            if stream is None or thread.name.startswith("teraio-") or os.getpid() != stream._pid:
                return boot(thread)
            mode, stream = _Elsewhere(stream), None
            with mode:
                return boot(thread)

        return bootstrap_inner

    # NOTE [ Pointer checks ]: code that compares storages' pointers (``data_ptr()``) outside any
    # op reads 0 for one teraio has out. FSDP2's lazy initialisation (``FSDPParam.
    # reset_sharded_param``, at the first forward, and after ``load_state_dict``) takes a sharded
    # parameter whose pointer is 0 for one replaced, and makes its view anew, an op no profile has:
    # iteration 0 of an FSDP2 job at its smallest budget left its plan there and ran on demand, at
    # 2.1-2.8x its budget. So each such check sees its storage in memory: brought back for it
    # alone and, where the plan has it out, freed again at once against the copy it came from
    # (the check writes nothing), so that no two are in together. safetensors' ``save_file`` and
    # ``save`` hand their writer a pointer to every CPU tensor at once (on a GPU they copy each to
    # the CPU first, an op): where the plan had one out the save failed ("invalid shape, data
    # type, or offset"); those are brought back and held in memory for the call, all together as
    # the writer needs them, which may take that iteration over its budget. A module imported
    # before teraio started that bound those by a name of its own (peft, transformers) gets the
    # wrapper too (``_rebind``): `teraio.offload()` entered after importing peft failed a LoRA
    # adapter's ``save_pretrained`` so. Other pointer reads are not caught (NOTE [ DLPack
    # exports ]).
    def _pointing(self, save: Any) -> Any:
        """safetensors' ``save_file`` and ``save``, which hand their writer a pointer to every
        CPU tensor at once: those are held in memory for the call (NOTE [ Pointer checks ])."""
        stream = self

        def pointing(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            values = tensors.values() if isinstance(tensors, dict) else ()
            storages = [s for s in used_storages(tuple(values), {}) if s.device.type == "cpu"]
            with stream.kept_in(list(storages)):
                return save(tensors, *args, **kwargs)

        return pointing

    def _patch_fsdp(self) -> None:
        self._fsdp_patched = True
        self._patch(sys.modules[_FSDP_PARAM].FSDPParam, "reset_sharded_param", self._checking_pointers)

    def _checking_pointers(self, reset: Any) -> Any:
        stream = self

        def reset_sharded_param(fsdp_param: Any, *args: Any, **kwargs: Any) -> Any:
            data = getattr(fsdp_param, "_sharded_param_data", None)
            storages = [data.untyped_storage()] if type(data) is torch.Tensor else []
            with stream.visited(storages):
                return reset(fsdp_param, *args, **kwargs)

        return reset_sharded_param

    def _others_manage(self, storage: torch.UntypedStorage, why: str) -> None:
        """``storage`` is someone else's to manage from now on, for the reason ``why``: never
        planned nor freed."""
        self.foreign.setdefault(storage, why)
        self.on_foreign(storage)

    # NOTE [ Communication hooks ]: a DDP communication hook (``register_comm_hook``: fp16 or bf16
    # compression, PowerSGD) returns a future whose callbacks write the bucket (and the hook's own
    # state: PowerSGD's P, Q and error tensors) once the collective is done, on the backend's
    # thread, where no dispatch mode sees them. With the bucket out, the fp16 hook's callback
    # raised "data is not allocated yet" (every run at the smallest budget); a copy kept from
    # before such a write would have brought stale gradients back. So the bucket, and every
    # storage an op inside the hook reads or writes, are others' to manage (as those others
    # resize): brought back first, never planned nor freed. The hook's own ops are counted (what
    # they make, PowerSGD's error feedback as large as the gradients, is in the profile's peak),
    # but not its callbacks' (``then``, ``add_done_callback`` on a future, wrapped while a hook
    # runs): a callback runs at once where the hook adds it when the collective is already done,
    # as timing falls, and counted there it shifted the ops (under load, 1 run in 3 of the fp16
    # hook on gloo: a followed iteration met the callback's ``copy_`` where its plan had the next
    # op, and the job stopped). What such a callback reads or writes is others' to manage too
    # (``_theirs``). The hook and its callbacks are seen so on any thread where this mode is
    # active (CUDA's autograd device threads run the backward, and its hooks, under it; not run
    # on a GPU yet). Not caught: DDP's built-in C++ hooks (``_register_builtin_comm_hook``), which
    # teraio cannot wrap.
    def _hooking(self, register: Any) -> Any:
        stream = self

        def register_comm_hook(ddp: Any, state: object, hook: Any) -> None:
            @functools.wraps(hook)  # DDP checks the hook's signature and name
            def hook_seen(state: object, bucket: Any) -> Any:
                buffer = bucket.buffer()
                with stream._resident(buffer):
                    stream._others_manage(buffer.untyped_storage(), "a DDP communication hook writes it")
                if not stream._active_here():
                    return hook(state, bucket)
                stream.in_comm_hook += 1
                try:
                    return hook(state, bucket)
                finally:
                    stream.in_comm_hook -= 1

            return register(ddp, state, hook_seen)

        return register_comm_hook

    def _waiting(self, wait: Any) -> Any:
        """c10d's ``Work.wait``, which no dispatch mode sees: then ``waited``."""
        stream = self

        def waiting(work: Any, *args: Any, **kwargs: Any) -> Any:
            out = wait(work, *args, **kwargs)
            stream.waited(work)
            return out

        return waiting

    def waited(self, work: Any) -> None:
        """The script waited for c10d ``work``: its tensors are the script's again."""

    def _calling_back(self, add: Any) -> Any:
        """A future's ``then`` or ``add_done_callback``: a callback added inside a communication
        hook runs uncounted (NOTE [ Communication hooks ])."""
        stream = self

        def adding(future: Any, callback: Any) -> Any:
            if not stream.in_comm_hook or not callable(callback) or not stream._active_here():
                return add(future, callback)

            @functools.wraps(callback)
            def callback_seen(fut: Any) -> Any:
                if not stream._active_here():
                    return callback(fut)
                with stream._their_ops():
                    return callback(fut)

            return add(future, callback_seen)

        return adding

    def _active_here(self) -> bool:
        """Whether this mode sees the ops of the thread it is asked on."""
        return self in _get_current_dispatch_mode_stack()

    def _hook_touched(self, touched: list[tuple[int, _Tensor, bool]]) -> None:
        """The storages of an op inside a communication hook, which its callbacks may write."""
        for _, t, _ in touched:
            self._manage_theirs(t, "an op in a DDP communication hook uses it, and its callbacks may write it")

    def _manage_theirs(self, t: _Tensor, why: str) -> None:
        """``t``'s storage brought back, then others' to manage (``foreign``) for the reason ``why``."""
        storage = _own_storage(t)
        if storage is not None and storage not in self.foreign:
            self.bring_back(storage)
            self._others_manage(storage, why)

    def _reading(self, read: Any) -> Any:
        stream = self

        def reading(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.layout is not torch.strided:
                return read(tensor, *args, **kwargs)
            with stream._resident(tensor):
                return read(tensor, *args, **kwargs)

        return reading

    def _restoring(self, set_rng_state: Any) -> Any:
        stream = self

        def restoring(*args: Any, **kwargs: Any) -> Any:
            state = args[0] if args else kwargs.get("new_state")
            with stream._resident(state) if isinstance(state, torch.Tensor) else contextlib.nullcontext():
                return set_rng_state(*args, **kwargs)

        return restoring

    def _pickling(self, reduce: Any) -> Any:
        """``Tensor.__reduce_ex__``, a read outside any op, but inside a save that writes the
        bytes of storages that are out itself (NOTE [ Streamed saves ] in runtime.saves)."""
        stream = self
        reading = self._reading(reduce)

        def pickling(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return (reduce if stream.saving_streamed() else reading)(tensor, *args, **kwargs)

        return pickling

    def _pickling_parameter(self, reduce: Any) -> Any:
        """``Parameter.__reduce_ex__``, whose ``self.data`` is a ``detach`` op: inside such a save
        it only aliases the storage, which the save writes (NOTE [ Streamed saves ]). A subclass's
        is brought back first: its ``__getstate__`` may read it."""
        stream = self

        def pickling(param: torch.nn.Parameter, *args: Any, **kwargs: Any) -> Any:
            if not stream.saving_streamed():
                return reduce(param, *args, **kwargs)
            if type(param) is not torch.nn.Parameter:  # a subclass's __getstate__ may read it
                with stream._resident(param):
                    return reduce(param, *args, **kwargs)
            with stream.only_aliased():
                return reduce(param, *args, **kwargs)

        return pickling

    def saving_streamed(self) -> bool:
        """Whether a save that writes the bytes of storages that are out itself is pickling on
        this thread (NOTE [ Streamed saves ] in runtime.saves)."""
        return False

    def only_aliased(self) -> AbstractContextManager[None]:
        """The body's ops alias their inputs and read none of their bytes: nothing is brought
        back for them (NOTE [ Streamed saves ] in runtime.saves)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _resident(self, tensor: torch.Tensor) -> Iterator[None]:
        """``tensor``'s storage in memory for the body: brought back on the training thread,
        brought back and kept in on another (NOTE [ Reads on other threads ] in runtime.executor)."""
        t = _local(tensor)
        while is_functorch_wrapped_tensor(t):  # inside torch.func.grad, vmap, jacrev
            t = get_unwrapped(t)
        storages = [s for s in map(_own_storage, holders(t)) if s is not None]
        if not storages:
            yield
        else:
            with self._in_memory(storages):
                yield

    @contextlib.contextmanager
    def _in_memory(self, storages: Sequence[torch.UntypedStorage]) -> Iterator[None]:
        """``storages`` in memory for the body: brought back on the training thread (in a forked
        child that changes no record, and raises for one that is out: NOTE [ Forked children ] in
        runtime.executor), brought back and kept in on another (NOTE [ Reads on other threads ])."""
        if threading.get_ident() == self._thread or os.getpid() != self._pid:
            for storage in storages:
                self.bring_back(storage)
            yield
        else:
            with self.kept_in(list(storages)):
                yield

    def _registering(self, init: Any) -> Any:
        stream = self

        def registering(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            init(opt, *args, **kwargs)
            stream._register_optimizer(opt)

        return registering

    def _compile(self, compile_: Any) -> Any:
        stream = self

        def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
            if model is not None:
                owner = getattr(model, "__self__", None)  # ``model.compile()`` compiles its _call_impl
                name = (type(owner).__name__ if isinstance(owner, torch.nn.Module) else
                        getattr(model, "__qualname__", None) or type(model).__name__)
                stream._note_compiled(str(name))
            return compile_(model, *args, **kwargs)

        return compile

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._unpatch()

    def _unpatch(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches = []
        self._fsdp_patched = False
        for table, key, original in reversed(self._patched_items):
            table[key] = original
        self._patched_items = []
        if self._warning_filters is not None:
            self._warning_filters.__exit__(None, None, None)
            self._warning_filters = None
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None


class _Elsewhere(TorchDispatchMode):
    """The mode of a thread of the script's own (NOTE [ Ops on other threads ])."""

    def __init__(self, stream: OpStream) -> None:
        super().__init__()
        self.stream = weakref.ref(stream)  # a thread may outlive it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        stream = self.stream()
        if stream is None or stream not in _ACTIVE:
            return func(*args, **kwargs)
        info = stream._infos.get(func)
        if info is None:
            info = stream._infos[func] = _op_info(func)
        if info.skip or info.view:  # an alias reads nothing (a background save's detach: NOTE [
            return func(*args, **kwargs)  # Streamed saves ] in runtime.saves writes it from its copy)
        return stream._read_unseen(info, stream.run_elsewhere(func, args, kwargs, info))


def _optional(module: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _storages(tensors: Iterable[_Tensor]) -> list[torch.UntypedStorage]:
    """The storages of ``tensors`` (a sparse tensor's parts' too)."""
    out = []
    for t in tensors:
        for part in holders(t):
            try:
                out.append(part.untyped_storage())
            except (RuntimeError, NotImplementedError):  # a tensor with no storage (mkldnn)
                pass
    return out


def written_storages(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.UntypedStorage]:
    """The storages an op writes, by its schema (``OpInfo``)."""
    chosen = [a for i, a in enumerate(args) if i in info.mutable_args]
    chosen += [a for k, a in kwargs.items() if k in info.mutable_kwargs]
    return _storages(tensor_args(tuple(chosen), {}))


def used_storages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.UntypedStorage]:
    """The storages of an op's tensor arguments."""
    return _storages(tensor_args(args, kwargs))
