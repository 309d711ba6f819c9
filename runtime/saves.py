"""``torch.save`` of tensors teraio has out, record by record (NOTE [ Streamed saves ]).

NOTE [ Streamed saves ]: torch.save's zip writer (``torch.serialization._save``)
first pickles the object, naming each storage by a key and its size, then
writes each storage's bytes as the record ``data/<key>``. A storage teraio has
out is freed in place: its size reads 0 and it has no bytes. Every such storage
used to be brought back for the save, all at once, so a checkpoint of a model
teraio kept within its budget took the memory to the whole state's size (the
Adam moments and the parameters together). Now the save is given a pickle
module whose pickler names an out storage at its recorded size, and a writer
that, for the record of a storage out when its bytes are written, writes its
copy, read from the SSD or host memory into an untracked host buffer of that
one storage: nothing comes back into the memory the plan budgets, and the file
holds the plain run's bytes. A storage whose read is in flight is waited for,
and its bytes taken once it is whole.

While such a save pickles, ``Tensor.__reduce_ex__`` brings nothing back (NOTE [
DLPack exports ] in torch_patch.opstream), nor does the ``detach`` of
``Parameter.__reduce_ex__`` (a model saved whole). A parameter subclass is
brought back first (its ``__getstate__`` may read its data: one that did read a
freed storage and crashed), and so is what any other op reads. Once the pickle
is written, the ops of torch's copies of a device's storages to host memory
(``storage.cpu()``, which copies nothing of a freed one) run with nothing
brought back, nor drained, where the iteration runs on demand: a write finished
then freed its storage under the copy. torch checks that no storage is saved as
two types only where it has memory; an out storage is checked here (the file
was written, the view read back as the other type).

On a thread of the script's own (a checkpoint written in the background while
training goes on), a CPU storage in memory when its record is written is copied
into a host buffer of its own, and held in memory for the copy alone (NOTE [
Reads on other threads ] in runtime.executor), its transfer in flight done
first: the training thread does not free it under the copy, and an offload the
plan starts meanwhile goes once the copy is done. One out then is written from
its copy, read with the records locked (the training thread waits for that one
read). Each was once held from its pickling to the save's end, which kept in
memory what the plan sent out while the save ran: under load (CI, 2 cores) the
iteration a save overlapped went to 1.13-1.59x its budget with
``--hold-on-demand``, in 2 of 5 runs; held for its record's write, in 2 of 10
(1.34x), in tracked bytes. The copy is host memory outside the budget, one
storage's at a time, as a copy read for a storage that is out is. A device's
storage is brought back when pickled and held to the save's end (torch copies it
to host memory with no lock and no op teraio sees), which takes memory as
before. With
``--hold-on-demand``, such saves keep the iterations they overlap within the
budget on the CPU, where bringing what was out back for them took those to
1.30x. The legacy writer
(``_use_new_zipfile_serialization=False``) and a torch whose writer takes other
arguments bring the storages back as before (``PlanExecutor.resident_for``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.executor import PlanExecutor

__all__ = ["streamed_save"]


def streamed_save(executor: PlanExecutor, save: Callable[..., Any]) -> Callable[..., Any] | None:
    """``save`` (torch's zip writer) with the storages ``executor`` has out written from their
    copies; None where ``save`` does not take a zip file and a pickle module by those names."""
    try:
        signature = inspect.signature(save)
    except (TypeError, ValueError):
        return None
    if "zip_file" not in signature.parameters or "pickle_module" not in signature.parameters:
        return None

    def streamed(obj: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(obj, *args, **kwargs)
        sizes: dict[str, tuple[torch.UntypedStorage, int]] = {}  # key -> (storage, its bytes)
        bound.arguments["pickle_module"] = _Pickling(bound.arguments["pickle_module"], executor, sizes)
        bound.arguments["zip_file"] = _Records(bound.arguments["zip_file"], executor, sizes)
        try:
            with executor.streaming():
                return save(*bound.args, **bound.kwargs)
        finally:  # torch's pickler classes are cycles that hold it until a collection: the
            sizes.clear()  # storages saved would live on (a save each step: 1.97x the budget)

    return streamed


class _Pickling:
    """A pickle module whose ``Pickler`` subclasses (torch's, which names storages in its
    ``persistent_id``) name an out storage at its recorded size, and note every storage's key."""

    def __init__(self, module: Any, executor: PlanExecutor, sizes: dict[str, tuple[torch.UntypedStorage, int]]
                 ) -> None:
        self._module = module
        types: dict[str, torch.dtype] = {}  # key -> the dtype an out storage was pickled as

        class Pickler(module.Pickler):  # type: ignore[misc, name-defined]
            def __init_subclass__(cls, **kwargs: Any) -> None:
                super().__init_subclass__(**kwargs)
                named = cls.__dict__.get("persistent_id")
                if named is None:
                    return

                def persistent_id(self: Any, obj: Any) -> Any:
                    return _sized(obj, named(self, obj), executor, sizes, types)

                cls.persistent_id = persistent_id  # type: ignore[method-assign]

        self.Pickler = Pickler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _sized(obj: Any, pid: Any, executor: PlanExecutor, sizes: dict[str, tuple[torch.UntypedStorage, int]],
           types: dict[str, torch.dtype]) -> Any:
    """torch's name of a storage, ``("storage", type, key, location, numel)``, with the numel of
    an out storage's recorded size."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        return pid
    typed = isinstance(obj, torch.TypedStorage)
    storage = obj._untyped_storage if typed else obj
    nbytes = executor.pickled_bytes(storage)
    sizes[pid[2]] = (storage, nbytes)
    # torch refuses one storage saved as two types where it has memory (``data_ptr()``): out too
    dtype = obj.dtype if typed else torch.uint8
    if nbytes and storage.data_ptr() == 0 and types.setdefault(pid[2], dtype) != dtype:
        raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
    return (*pid[:4], nbytes // obj._element_size() if typed else nbytes)


class _Records:
    """torch's zip writer, with each storage's record written from its copy where it is out."""

    def __init__(self, writer: Any, executor: PlanExecutor, sizes: dict[str, tuple[torch.UntypedStorage, int]]
                 ) -> None:
        self._writer = writer
        self._executor = executor
        self._sizes = sizes
        self._pickled = False

    def write_record(self, name: str, data: Any, nbytes: int) -> Any:
        if not self._pickled:  # the pickle, written first: from here on the storages' records
            self._pickled = True
            self._executor.writing_records()
        named = self._sizes.get(name[5:]) if name.startswith("data/") else None
        if named is not None:
            data, nbytes = self._executor.saved_bytes(*named, data, nbytes)
        return self._writer.write_record(name, data, nbytes)

    def write_record_metadata(self, name: str, nbytes: int) -> Any:  # ``torch.serialization.skip_data``
        named = self._sizes.get(name[5:]) if name.startswith("data/") else None
        return self._writer.write_record_metadata(name, nbytes if named is None else named[1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)
