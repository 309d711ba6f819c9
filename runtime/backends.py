"""Storage backends: where offloaded bytes live (DESIGN.md section 7).

One small synchronous interface, called from the migration engine's worker
threads: ``write(key, src)`` stores a uint8 tensor's bytes under ``key``,
``read(key, dst)`` fills a uint8 tensor of the same length, ``delete(key)``
drops them. ``src``/``dst`` alias the storage being moved. ``close(keep)``
drops everything but the keys in ``keep``, whose bytes it leaves in files of a
``teraio-kept-*`` directory that it returns (NOTE [ Swap directories ] in
``runtime.swapdir``).

* ``PosixBackend``: one file per key in a private swap directory (0700, files
  0600), O_DIRECT through 4 KiB-aligned staging buffers where the filesystem
  allows it (copies and syscalls overlapped, NOTE [ Pipelined staging ]),
  buffered I/O otherwise. The syscalls release the GIL.
* ``HostBackend``: a host buffer (pinned on CUDA) with a byte limit, allocated
  at its first write, carved first-fit into 4 KiB-aligned blocks.
* ``KvikioBackend``: GPUDirect Storage through kvikio's ``CuFile`` on device
  buffers; only with CUDA and the ``teraio[gds]`` extra.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from runtime.engine import Done
from runtime.swapdir import keep_swap_dir, make_swap_dir, remove_swap_dir

__all__ = ["Backend", "BackendFull", "HostBackend", "KvikioBackend", "PosixBackend", "backend_names"]

ALIGN = 4096
STAGING_BYTES = 8 << 20


class BackendFull(OSError):  # noqa: N818
    """The backend has no room for the bytes (disk full, file-size limit, pool limit)."""


class Backend(Protocol):
    name: str

    def write(self, key: int, src: torch.Tensor) -> None: ...

    def read(self, key: int, dst: torch.Tensor) -> None: ...

    def delete(self, key: int) -> None: ...

    def where(self, key: int) -> str: ...

    def close(self, keep: Mapping[int, dict[str, Any]] = ...) -> Path | None: ...


def backend_names() -> list[str]:
    return ["posix", "host", "kvikio"]


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview on a CPU uint8 tensor's memory.

    Not through ``Tensor.numpy()``: that marks the storage as not resizable,
    for good, and offloading frees storages by resizing them. The view does
    not keep ``t`` alive: the caller must.
    """
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst[:] = src`` for two contiguous uint8 tensors of one size, off the training thread
    (``non_blocking``: a device's copy only launched, on the current stream).

    NOTE [ Copies off OpenMP ]: between host tensors by ``ctypes.memmove`` (which releases the
    GIL, as ``Tensor.copy_`` does), never by ``Tensor.copy_``: a large CPU ``copy_`` runs an
    OpenMP parallel region, and the first one a worker thread runs gives that thread a team of
    its own (4 workers: 4 threads more). libgomp then manages more threads than there are cores,
    and every team, the training thread's too, stops spinning between parallel regions
    (libgomp's GOMP_SPINCOUNT: "if there are more OpenMP threads than available CPUs", 100
    spins), so each parallel op of the training step waits for its threads to wake. On this
    2-core VM the small example's optimizer ops each took about 20 us longer for the rest of the
    run once a plan moved anything; with ``memmove`` its ops took 40-45 ms an iteration less at
    75% and at 50% of its peak (429 against 471 ms, 456 against 502: medians of 16). The other
    side: the training thread's team spins again, taking CPU that the workers' Python and
    syscalls need, so on these 2 cores a plan that moves a lot (the smallest budget) runs its
    transfers slower than before. A device tensor's copy is the device's (no OpenMP)."""
    if (dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.numel() != src.numel()
            or not (dst.is_contiguous() and src.is_contiguous())):
        raise ValueError(f"copy of {src.numel()} {src.dtype} into {dst.numel()} {dst.dtype}: both "
                         "contiguous uint8, of one size")
    if dst.device.type != "cpu" or src.device.type != "cpu":  # a device's copy; a meta tensor's raises
        dst.copy_(src, non_blocking=non_blocking)
    elif dst.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())


class _Staging:
    """A page-aligned buffer for O_DIRECT (an anonymous map) and a uint8 tensor on it; bytes go in
    and out of it by ``copy_bytes``."""

    def __init__(self) -> None:
        self.map = mmap.mmap(-1, STAGING_BYTES)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)


class _Unlinker:
    """Deletes swap files off the training thread.

    Unlinking a file written with O_DIRECT frees its blocks: 574 us for a 2 MiB
    file on this machine's ext4, against 16 us for a rename, and the executor
    deletes a file per transfer on the main thread (0.86 s over 6 steps of the
    example). So ``delete`` renames the file out of its key's name at once (a
    deleted key can no longer be read) and a thread unlinks it. Until then the
    file holds its blocks: a write that finds the disk full waits for the
    pending deletes (``flush``) and tries once more.

    The main thread deletes, so the hand-off is a ``queue.SimpleQueue``, safe to
    interrupt (NOTE [ Ctrl-C and the engine ] in ``runtime.engine``); a thread
    pool's ``submit`` is not.
    """

    def __init__(self) -> None:
        self._paths: queue.SimpleQueue[str | Done | None] = queue.SimpleQueue()
        self.unlinked = 0  # files unlinked so far; the unlinking thread's own
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="teraio-unlink")
        self._thread.start()

    def delete(self, path: str) -> None:
        gone = f"{path}.deleted"
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        self._paths.put(gone)

    def flush(self) -> None:
        """Wait for the deletes asked for so far (at most a minute: a worker's flush that races
        ``close`` may find the thread gone)."""
        if not self._closed:
            done = Done()
            self._paths.put(done)
            done.wait(60)

    def close(self) -> None:
        self.flush()
        self._closed = True
        self._paths.put(None)
        self._thread.join(timeout=30)  # gone when the backend is closed (a loaded machine kept it a while)

    def _serve(self) -> None:
        while (item := self._paths.get()) is not None:
            if isinstance(item, Done):
                item.set()
                continue
            try:
                os.unlink(item)
            except OSError:
                continue  # what is left goes with the directory at close
            self.unlinked += 1


def _after_deletes(unlinker: _Unlinker, write: Callable[[], None]) -> None:
    """``write()``; if the disk is full, once more after the pending deletes (see ``_Unlinker``),
    if they freed anything since the write began (two workers can find it full at once)."""
    before = unlinker.unlinked
    try:
        write()
    except BackendFull:
        unlinker.flush()
        if unlinker.unlinked == before:
            raise
        write()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PosixBackend:
    """Files under a private swap directory; see the module docstring."""

    name = "posix"

    def __init__(self, swap_dir: str | os.PathLike[str] | None = None, direct: bool = True,
                 num_staging: int = 4) -> None:
        self.dir = make_swap_dir(swap_dir)
        self.direct = direct and hasattr(os, "O_DIRECT") and self._probe_direct()
        self._staging: list[_Staging] = [_Staging() for _ in range(num_staging)]
        self._lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None  # syscalls of pipelined transfers, made on first use
        self._unlinker = _Unlinker()

    def _probe_direct(self) -> bool:
        probe = self.dir / ".probe"
        try:
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            buf = mmap.mmap(-1, ALIGN)
            os.pwrite(fd, buf, 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def where(self, key: int) -> str:
        return str(self.dir / f"{key}.bin")

    def _take_staging(self) -> _Staging:
        with self._lock:
            return self._staging.pop() if self._staging else _Staging()

    def _give_staging(self, buf: _Staging) -> None:
        with self._lock:
            self._staging.append(buf)

    # With O_DIRECT, bytes pass through a staging buffer by ``copy_bytes`` (a device
    # tensor's too: one copy, no pinned buffer made per transfer); buffered I/O goes
    # straight from and to the tensor's memory (through one host copy for a device tensor).
    def write(self, key: int, src: torch.Tensor) -> None:
        _after_deletes(self._unlinker, lambda: self._write_once(key, src))

    def _write_once(self, key: int, src: torch.Tensor) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC
        try:
            fd = os.open(self.where(key), flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as exc:
            raise _full_or(exc) from None
        try:
            if not self.direct:
                host = src.to("cpu") if src.is_cuda else src  # a local: the view below needs it alive
                self._pwrite_all(fd, _host_bytes(host), 0)
                return
            def fill(buf: _Staging, off: int, n: int) -> None:
                copy_bytes(buf.tensor[:n], src[off:off + n])

            def put(buf: _Staging, off: int, n: int) -> None:
                self._pwrite_all(fd, memoryview(buf.map)[:_round_up(n)], off)

            self._staged(src.numel(), copy=fill, io=put, io_first=False)
        except OSError as exc:
            raise _full_or(exc) from None
        finally:
            os.close(fd)

    @staticmethod
    def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            n = os.pwrite(fd, data[done:], offset + done)
            if n <= 0:
                raise BackendFull(28, "short write")
            done += n

    def read(self, key: int, dst: torch.Tensor) -> None:
        path = self.where(key)
        total = dst.numel()
        size = os.stat(path).st_size
        if size < total:
            raise OSError(f"file holds {size} bytes, expected {total} (truncated?)")
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            if not self.direct:
                target = torch.empty(total, dtype=torch.uint8) if dst.is_cuda else dst
                self._pread_all(fd, _host_bytes(target), 0)
                if dst.is_cuda:
                    dst.copy_(target)
                return
            def get(buf: _Staging, off: int, n: int) -> None:
                self._pread_all(fd, memoryview(buf.map)[:_round_up(n)], off, need=n)

            def empty(buf: _Staging, off: int, n: int) -> None:
                copy_bytes(dst[off:off + n], buf.tensor[:n])

            self._staged(total, copy=empty, io=get, io_first=True)
        finally:
            os.close(fd)

    # NOTE [ Pipelined staging ]: a transfer of more than one staging buffer alternates
    # two buffers: the syscall of one piece (pwrite, pread) runs on a backend thread while
    # the calling worker copies another piece into or out of the other buffer, so a large
    # transfer goes at the slower of the two speeds, not at 1 / (1/copy + 1/disk). The
    # copies stay on the calling worker, on its CUDA stream (NOTE [ Copy streams ] in
    # runtime.executor; a stream is per thread). A buffer is reused only after its
    # syscall is done, and every syscall is done before the call returns (and its file
    # is closed), also when one fails.
    def _staged(self, total: int, copy: Callable[[_Staging, int, int], None],
                io: Callable[[_Staging, int, int], None], io_first: bool) -> None:
        """Move ``total`` bytes in pieces ``(buffer, offset, bytes)``: ``copy`` then ``io`` on each
        (a write), or ``io`` then ``copy`` (a read, ``io_first``)."""
        pieces = [(off, min(STAGING_BYTES, total - off)) for off in range(0, total, STAGING_BYTES)]
        if len(pieces) <= 1:
            buf = self._take_staging()
            try:
                for off, n in pieces:
                    for step in (io, copy) if io_first else (copy, io):
                        step(buf, off, n)
            finally:
                self._give_staging(buf)
            return
        bufs = [self._take_staging(), self._take_staging()]
        pending: list[Future[None] | None] = [None, None]
        try:
            if io_first:
                for i in range(2):
                    pending[i] = self._pool().submit(io, bufs[i], *pieces[i])
            for i, (off, n) in enumerate(pieces):
                slot, f = i % 2, pending[i % 2]
                if f is not None:
                    pending[slot] = None
                    f.result()  # the buffer is free again (a write), or filled (a read); or its error
                copy(bufs[slot], off, n)
                if not io_first:
                    pending[slot] = self._pool().submit(io, bufs[slot], off, n)
                elif i + 2 < len(pieces):
                    pending[slot] = self._pool().submit(io, bufs[slot], *pieces[i + 2])
            for f in pending:
                if f is not None:
                    f.result()
        finally:
            wait([f for f in pending if f is not None])
            for buf in bufs:
                self._give_staging(buf)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="teraio-posix")
            return self._io

    @staticmethod
    def _pread_all(fd: int, data: memoryview, offset: int, need: int | None = None) -> None:
        need = len(data) if need is None else need
        done = 0
        while done < need:
            n = os.preadv(fd, [data[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read: got {done} of {need} bytes at offset {offset}")
            done += n

    def delete(self, key: int) -> None:
        self._unlinker.delete(self.where(key))

    def close(self, keep: Mapping[int, dict[str, Any]] = {}) -> Path | None:  # noqa: B006 (read only)
        with self._lock:
            pool, self._io = self._io, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._unlinker.close()
        self._staging = []  # the maps go with their last reference
        return _close_dir(self.dir, self.where, keep)


def _close_dir(directory: Path, where: Callable[[int], str], keep: Mapping[int, dict[str, Any]]) -> Path | None:
    """Remove a swap directory, or keep the files of ``keep`` in it (``runtime.swapdir``)."""
    files = [{**info, "file": Path(where(key)).name} for key, info in keep.items()
             if os.path.exists(where(key))]
    if not files:
        remove_swap_dir(directory)
        return None
    return keep_swap_dir(directory, files)


def _full_or(exc: OSError) -> OSError:
    import errno

    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return BackendFull(exc.errno, f"{exc.strerror}")
    return exc


class HostBackend:
    """A host buffer with a byte limit (pinned when CUDA is present), allocated at the first
    write: a limit of 0, or a run that never writes, allocates nothing. ``spill_dir`` is
    where ``close`` leaves the bytes it is asked to keep."""

    name = "host"

    def __init__(self, limit_bytes: int, pin: bool | None = None,
                 spill_dir: str | os.PathLike[str] | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.limit_bytes = limit_bytes
        self.spill_dir = spill_dir
        self._pool: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, limit_bytes)]  # (offset, size), sorted
        self._blocks: dict[int, tuple[int, int]] = {}
        # NOTE [ Copies ordered on streams ] in runtime.engine: per key, a CUDA event after the last
        # copy launched on a stream and not waited for; the blocks of keys deleted meanwhile, with
        # it, are reused only once it has passed (a host copy would not wait for it)
        self._last_copy: dict[int, Any] = {}
        self._pending: list[tuple[Any, int, int]] = []
        self._lock = threading.Lock()
        self.used_bytes = 0

    def on_stream(self, t: torch.Tensor) -> bool:
        """Whether a copy of ``t`` to or from the pool can be launched on a stream and left to run
        (NOTE [ Copies ordered on streams ] in runtime.engine): a CUDA tensor, a pinned pool."""
        return self.pin and t.is_cuda

    @property
    def pool(self) -> torch.Tensor:
        with self._lock:
            if self._pool is None:
                self._pool = torch.empty(self.limit_bytes, dtype=torch.uint8, pin_memory=self.pin,
                                         device="cpu")  # not the default device a script may set
            return self._pool

    def where(self, key: int) -> str:
        off = self._blocks.get(key, (-1, 0))[0]
        return f"host memory (offset {off})"

    def _alloc(self, size: int) -> int:
        size = _round_up(max(size, 1))
        for waiting in (False, True):  # blocks whose last copy is still running: once it has ended
            for _, off, n in self._released(waiting):
                self._release(off, n)
            with self._lock:
                for i, (off, n) in enumerate(self._free):
                    if n >= size:
                        self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                        self.used_bytes += size
                        return off
                if not self._pending:
                    break
        raise BackendFull(12, f"host pool full ({self.used_bytes} of {self.limit_bytes} bytes used)"
                          if self.limit_bytes else "no host memory pool (teraio run --host-mem gives one)")

    def _released(self, wait: bool) -> list[tuple[Any, int, int]]:
        """The pending blocks whose last copy has ended (all, once waited for, with ``wait``),
        taken off the pending list."""
        with self._lock:
            pending, self._pending = self._pending, []
        done: list[tuple[Any, int, int]] = []
        left: list[tuple[Any, int, int]] = []
        for item in pending:
            if wait:
                item[0].synchronize()
            (done if wait or item[0].query() else left).append(item)
        with self._lock:
            self._pending.extend(left)
        return done

    def _release(self, off: int, size: int) -> None:
        size = _round_up(max(size, 1))
        with self._lock:
            self.used_bytes -= size
            blocks = sorted([*self._free, (off, size)])
            merged: list[tuple[int, int]] = []
            for o, n in blocks:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged

    def write(self, key: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """``non_blocking`` (a CUDA ``src``): the copy launched on the current stream; a read into
        host memory waits for it."""
        n = src.numel()
        if key in self._blocks:
            self.delete(key)
        off = self._alloc(n)
        copy_bytes(self.pool[off:off + n], src, non_blocking)
        self._blocks[key] = (off, n)
        if non_blocking and src.is_cuda:
            self._copy_launched(key, src.device)

    def _copy_launched(self, key: int, device: torch.device) -> None:
        self._last_copy[key] = event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))

    def read(self, key: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """``non_blocking`` (a CUDA ``dst``): the copy launched on the current stream, which has
        waited for the key's write where it was launched so (the current stream is its own)."""
        off, n = self._blocks[key]
        if n != dst.numel():
            raise OSError(f"holds {n} bytes, expected {dst.numel()}")
        self._host_ready(key, dst)
        copy_bytes(dst, self.pool[off:off + n], non_blocking)
        if non_blocking and dst.is_cuda:
            self._copy_launched(key, dst.device)

    def _host_ready(self, key: int, dst: torch.Tensor | None) -> None:
        """Wait for ``key``'s write on a stream before the host reads it (``dst`` on the CPU, or
        None), or order ``dst``'s device copy after it."""
        event = self._last_copy.get(key)
        if event is None:
            return
        if dst is None or not dst.is_cuda:
            event.synchronize()
        else:
            torch.cuda.current_stream(dst.device).wait_event(event)

    def delete(self, key: int) -> None:
        event = self._last_copy.pop(key, None)
        block = self._blocks.pop(key, None)
        if block is None:
            return
        if event is not None and not event.query():
            with self._lock:
                self._pending.append((event, *block))
        else:
            self._release(*block)

    def close(self, keep: Mapping[int, dict[str, Any]] = {}) -> Path | None:  # noqa: B006 (read only)
        """Drop every block; those of ``keep`` are written to files first (a kept directory)."""
        kept = None
        keys = [k for k in keep if k in self._blocks]
        if keys:
            directory = make_swap_dir(self.spill_dir)
            for key in keys:
                off, n = self._blocks[key]
                self._host_ready(key, None)
                with open(directory / f"{key}.bin", "wb") as f:
                    f.write(_host_bytes(self.pool[off:off + n]))
            kept = keep_swap_dir(directory, [{**keep[k], "file": f"{k}.bin", "from": "host memory"}
                                             for k in keys])
        self._released(wait=True)  # every copy ended before the pool goes
        for event in self._last_copy.values():
            event.synchronize()
        self._blocks.clear()
        self._last_copy.clear()
        self._pending = []
        self._free = [(0, self.limit_bytes)]
        self.used_bytes = 0
        self._pool = None
        return kept


class KvikioBackend:
    """GPUDirect Storage through kvikio (CUDA only, optional extra ``teraio[gds]``)."""

    name = "kvikio"

    def __init__(self, swap_dir: str | os.PathLike[str] | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the kvikio backend needs CUDA, and none is available")
        try:
            import kvikio
            import kvikio.defaults
        except ImportError as exc:
            raise RuntimeError("the kvikio backend needs `pip install teraio[gds]`") from exc
        self._kvikio = kvikio
        self.dir = make_swap_dir(swap_dir)
        self._unlinker = _Unlinker()
        d = kvikio.defaults
        mode = d.get("compat_mode") if hasattr(d, "get") else d.compat_mode()
        # In compatibility mode kvikio does POSIX I/O through a bounce buffer, not GDS.
        self.compat_mode = str(mode).upper() not in ("OFF", "FALSE", "0", "COMPATMODE.OFF")

    def where(self, key: int) -> str:
        return str(self.dir / f"{key}.bin")

    # kvikio takes device buffers (``__cuda_array_interface__``) or host buffers (the buffer
    # protocol, which CPU tensors lack), and raises RuntimeError where the OS said errno.
    def write(self, key: int, src: torch.Tensor) -> None:
        _after_deletes(self._unlinker, lambda: self._write_once(key, src))

    def _write_once(self, key: int, src: torch.Tensor) -> None:
        buf = src if src.is_cuda else _host_bytes(src)
        try:
            with self._kvikio.CuFile(self.where(key), "w") as f:
                n = f.pwrite(buf).get()
            os.chmod(self.where(key), 0o600)
        except RuntimeError as exc:
            raise OSError(f"kvikio write of {self.where(key)}: {exc}") from None
        if n != src.numel():
            raise BackendFull(28, f"short write: {n} of {src.numel()} bytes")

    def read(self, key: int, dst: torch.Tensor) -> None:
        path = self.where(key)
        if not os.path.exists(path):
            raise FileNotFoundError(2, "no such swap file", path)
        size = os.stat(path).st_size
        if size < dst.numel():
            raise OSError(f"file holds {size} bytes, expected {dst.numel()} (truncated?)")
        buf = dst if dst.is_cuda else _host_bytes(dst)
        try:
            with self._kvikio.CuFile(path, "r") as f:
                n = f.pread(buf).get()
        except RuntimeError as exc:
            raise OSError(f"kvikio read of {path}: {exc}") from None
        if n != dst.numel():
            raise OSError(f"short read: {n} of {dst.numel()} bytes")

    def delete(self, key: int) -> None:
        self._unlinker.delete(self.where(key))

    def close(self, keep: Mapping[int, dict[str, Any]] = {}) -> Path | None:  # noqa: B006 (read only)
        self._unlinker.close()
        return _close_dir(self.dir, self.where, keep)
