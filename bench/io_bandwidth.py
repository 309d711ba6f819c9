"""The migration engine's write and read bandwidth over the raw bandwidth of the same disk.

Raw: one thread, O_DIRECT, 8 MiB aligned buffers, to a file in the swap
directory. Engine: the same bytes as tensors of ``--tensor-mib`` (default 8)
through ``MigrationEngine`` and ``PosixBackend``, the way offloads and
prefetches move them (a tensor larger than the backend's 8 MiB staging buffer
goes through it in pieces, NOTE [ Pipelined staging ]). Measured side by side,
alternating, in one run; the median of ``--rounds``.

    python bench/io_bandwidth.py [--total-mib 512] [--tensor-mib 8] [--rounds 3] [--swap-dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from runtime.backends import PosixBackend
from runtime.engine import Job, MigrationEngine

CHUNK = 8 << 20


def raw_o_direct(directory: Path, total: int) -> tuple[float, float]:
    """(write, read) bytes/s of plain O_DIRECT I/O on the filesystem of ``directory``."""
    path = directory / "raw.bin"
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
    t0 = time.perf_counter()
    for off in range(0, total, CHUNK):
        os.pwrite(fd, buf, off)
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t0 = time.perf_counter()
    for off in range(0, total, CHUNK):
        os.preadv(fd, [buf], off)
    read_s = time.perf_counter() - t0
    os.close(fd)
    path.unlink()
    return total / write_s, total / read_s


def engine_io(directory: Path, total: int, workers: int, tensor_bytes: int = CHUNK) -> tuple[float, float]:
    backend = PosixBackend(directory)
    engine = MigrationEngine(workers)
    tensors = [torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8) for _ in range(total // tensor_bytes)]
    total = len(tensors) * tensor_bytes
    try:
        def run(direction: str) -> float:
            t0 = time.perf_counter()
            jobs = []
            for key, t in enumerate(tensors):
                work = ((lambda k=key, x=t: backend.write(k, x)) if direction == "write"
                        else (lambda k=key, x=t: backend.read(k, x)))
                jobs.append(engine.submit(Job(key, direction, tensor_bytes, work)))
            for job in jobs:
                job.done.wait()
                if job.error is not None:
                    raise job.error
            return total / (time.perf_counter() - t0)

        return run("write"), run("read")
    finally:
        engine.close()
        backend.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tensor-mib", type=int, default=8, help="size of each tensor the engine moves")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--swap-dir", default=None)
    args = p.parse_args()
    total = args.total_mib << 20
    with tempfile.TemporaryDirectory(dir=args.swap_dir) as d:
        directory = Path(d)
        raw_w, raw_r, eng_w, eng_r = [], [], [], []
        for _ in range(args.rounds):
            w, r = raw_o_direct(directory, total)
            raw_w.append(w)
            raw_r.append(r)
            w, r = engine_io(directory, total, args.workers, args.tensor_mib << 20)
            eng_w.append(w)
            eng_r.append(r)
    med = statistics.median
    print(f"{'':8}{'raw O_DIRECT':>16}{'engine':>16}{'engine/raw':>12}")
    print(f"{'write':8}{med(raw_w) / 1e9:13.2f} GB/s{med(eng_w) / 1e9:11.2f} GB/s"
          f"{med(eng_w) / med(raw_w):11.2f}x")
    print(f"{'read':8}{med(raw_r) / 1e9:13.2f} GB/s{med(eng_r) / 1e9:11.2f} GB/s"
          f"{med(eng_r) / med(raw_r):11.2f}x")


if __name__ == "__main__":
    main()
