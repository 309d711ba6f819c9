"""One conformance suite for every storage backend this machine can run."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.backends import Backend, BackendFull, HostBackend, KvikioBackend, PosixBackend, _after_deletes

SIZES = [1, 4095, 4096, 4097, (8 << 20) + 13, (24 << 20) + 4097]  # the last: 4 staging buffers' worth


def _kvikio_reason() -> str | None:
    if not torch.cuda.is_available():
        return "kvikio backend skipped: no CUDA device on this machine"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return "kvikio backend skipped: kvikio is not installed (pip install teraio[gds])"
    return None


@pytest.fixture(params=["posix-direct", "posix-buffered", "host", "kvikio"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    name = request.param
    if name == "kvikio":
        reason = _kvikio_reason()
        if reason:
            print(reason)
            pytest.skip(reason)
        b: Backend = KvikioBackend(tmp_path)
    elif name == "host":
        b = HostBackend(64 << 20)
    else:
        b = PosixBackend(tmp_path, direct=name == "posix-direct")
        if name == "posix-direct" and not b.direct:  # type: ignore[attr-defined]
            reason = f"O_DIRECT is not supported on the filesystem of {tmp_path}"
            print(reason)
            b.close()
            pytest.skip(reason)
    yield b
    b.close()


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device())


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_is_exact(backend: Backend, n: int) -> None:
    src = random_bytes(n, n)
    backend.write(7, src)
    dst = torch.zeros(n, dtype=torch.uint8, device=device())
    backend.read(7, dst)
    assert torch.equal(src, dst)


def test_keys_are_independent_and_overwrite(backend: Backend) -> None:
    a, b = random_bytes(10_000, 1), random_bytes(10_000, 2)
    backend.write(1, a)
    backend.write(2, b)
    backend.write(1, b)
    out = torch.empty(10_000, dtype=torch.uint8, device=device())
    backend.read(1, out)
    assert torch.equal(out, b)
    backend.read(2, out)
    assert torch.equal(out, b)


def test_deleted_key_cannot_be_read(backend: Backend) -> None:
    backend.write(3, random_bytes(100, 3))
    backend.delete(3)
    backend.delete(3)  # deleting twice is fine
    with pytest.raises((OSError, KeyError)):
        backend.read(3, torch.empty(100, dtype=torch.uint8, device=device()))


def test_posix_files_are_private_and_removed(tmp_path: Path) -> None:
    b = PosixBackend(tmp_path)
    b.write(5, random_bytes(5000, 5))
    assert stat.S_IMODE(os.stat(b.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(b.where(5)).st_mode) == 0o600
    b.close()
    assert not b.dir.exists()


def test_posix_truncated_file_is_an_error(tmp_path: Path) -> None:
    b = PosixBackend(tmp_path)
    b.write(5, random_bytes(10_000, 5))
    os.truncate(b.where(5), 4096)
    with pytest.raises(OSError, match="truncated"):
        b.read(5, torch.empty(10_000, dtype=torch.uint8))
    b.close()


_FULL_MIDWAY = """
import resource, signal, sys, torch
from runtime.backends import BackendFull, PosixBackend
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 20, 12 << 20))  # full in the second of 4 pieces
b = PosixBackend(sys.argv[1], direct=sys.argv[2] == "direct")
try:
    b.write(1, torch.ones((24 << 20) + 4097, dtype=torch.uint8))
    raise SystemExit("the write went past the file-size limit")
except BackendFull:
    pass
small = torch.arange(5000).to(torch.uint8)
b.write(2, small)  # the staging buffers came back, nothing hangs
out = torch.empty_like(small)
b.read(2, out)
assert torch.equal(out, small)
b.close()
print("ok")
"""


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_posix_full_in_the_middle_of_a_large_write(tmp_path: Path, mode: str) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _FULL_MIDWAY, str(tmp_path), mode], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_host_pool_limit_and_reuse() -> None:
    b = HostBackend(3 * 4096)
    b.write(1, random_bytes(4096, 1))
    b.write(2, random_bytes(8192, 2))
    with pytest.raises(BackendFull):
        b.write(3, random_bytes(1, 3))
    b.delete(1)
    b.delete(2)
    b.write(4, random_bytes(3 * 4096, 4))  # freed blocks merge back into one
    assert b.used_bytes == 3 * 4096


def test_posix_pipelined_copies_stay_on_the_calling_thread(tmp_path: Path) -> None:
    """Only syscalls go to the backend's threads: a CUDA copy must run on the worker's stream,
    and a current stream is per thread (NOTE [ Pipelined staging ])."""
    b = PosixBackend(tmp_path)
    seen: dict[str, list[tuple[int, int]]] = {"copy": [], "io": []}
    for io_first in (False, True):
        b._staged((3 << 23) + 5, copy=lambda buf, off, n: seen["copy"].append((threading.get_ident(), off)),
                  io=lambda buf, off, n: seen["io"].append((threading.get_ident(), off)), io_first=io_first)
    b.close()
    assert {t for t, _ in seen["copy"]} == {threading.get_ident()}
    assert threading.get_ident() not in {t for t, _ in seen["io"]}
    pieces = sorted(2 * [0, 1 << 23, 2 << 23, 3 << 23])  # each piece once each way
    assert sorted(off for _, off in seen["io"]) == sorted(off for _, off in seen["copy"]) == pieces


_WORKER_COPIES = """
import os, sys, threading, torch
from runtime.backends import HostBackend, PosixBackend
assert torch.get_num_threads() == 2
mode = sys.argv[2]
b = HostBackend(64 << 20, pin=False) if mode == "host" else PosixBackend(sys.argv[1], direct=mode == "direct")
n = 8 << 20  # one staging buffer, far above a parallel copy's grain
src, dst = torch.arange(n, dtype=torch.int64).to(torch.uint8), torch.zeros(n, dtype=torch.uint8)
torch.ones(n).add_(1)  # the main thread's own team, as a training step makes it
threads = []
def worker():
    threads.append(len(os.listdir("/proc/self/task")))
    b.write(1, src)
    b.read(1, dst)
    threads.append(len(os.listdir("/proc/self/task")))
t = threading.Thread(target=worker)
t.start()
t.join()
b.close()
assert torch.equal(src, dst)
print(threads[1] - threads[0])
"""


@pytest.mark.parametrize("mode", ["direct", "host"])  # buffered I/O copies nothing
def test_copies_on_a_worker_start_no_openmp_threads(tmp_path: Path, mode: str) -> None:
    """A worker's host copies make no OpenMP team of their own: the extra threads made every
    team of the process, the training thread's too, stop spinning between parallel ops
    (NOTE [ Copies off OpenMP ] in runtime.backends). In a process of 2 threads, whatever the
    suite's own setting."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _WORKER_COPIES, str(tmp_path), mode], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", f"{done.stdout.strip()} threads started by a worker's copies"


def test_a_full_disk_waits_for_pending_deletes_once(tmp_path: Path) -> None:
    """Deleted files keep their blocks until the unlinking thread gets to them: a write that
    finds the disk full waits for those deletes and tries once more."""
    b = PosixBackend(tmp_path)
    b.write(1, random_bytes(5000, 1))
    b.delete(1)
    tries = []

    def full_once() -> None:
        tries.append(len(list(b.dir.glob("*.bin*"))))
        if len(tries) == 1:
            raise BackendFull(28, "no space left on device")

    _after_deletes(b._unlinker, full_once)
    assert tries[1] == 0  # the second try came after the deleted file was gone
    with pytest.raises(BackendFull):  # nothing pending: no second try
        _after_deletes(b._unlinker, lambda: (_ for _ in ()).throw(BackendFull(28, "full")))
    b.close()
