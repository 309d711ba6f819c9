"""Private swap directories: made with an owner record, removed at exit, cleaned after a crash.

NOTE [ Swap directories ]: a backend that writes files makes its own directory
``teraio-swap-*`` (mode 0700) under the swap dir, with ``owner.json``: the host
name, the pid and the process's start time, and the owner holds an exclusive
``flock`` on that file for as long as the directory is its own. A run killed
outright (SIGKILL: the OOM killer, a preempted node) cannot remove it, but the
kernel drops its lock; the next run on the same parent removes every
``teraio-swap-*`` directory of this host whose lock it can take, and says how
much it freed; ``teraio clean`` does it on request. The lock, not the pid, is
what tells: a run in another container on this host (another pid namespace,
the same host name, a shared swap mount) holds its lock where its pid means
nothing here. A record without the lock (teraio before it) is judged by its
pid and start time (so that a reused pid is not taken for the owner). A directory without an
owner record (made by teraio 0.1) is listed, never removed automatically.
Bytes teraio could not restore at exit stay in a ``teraio-kept-*`` directory
with a ``kept.json`` manifest, which nothing removes but the user.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["KEPT_PREFIX", "SWAP_PREFIX", "Sweep", "keep_swap_dir", "make_swap_dir", "remove_swap_dir", "sweep"]

SWAP_PREFIX = "teraio-swap-"
KEPT_PREFIX = "teraio-kept-"
OWNER_FILE = "owner.json"
KEPT_FILE = "kept.json"
_LOCKS: dict[Path, int] = {}  # swap directory -> its owner.json's descriptor, locked (NOTE above)


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, proc(5)); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def make_swap_dir(parent: str | os.PathLike[str] | None) -> Path:
    """A new private swap directory under ``parent`` (default: the system temporary
    directory), with its owner record."""
    base = Path(parent) if parent is not None else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=SWAP_PREFIX, dir=base))
    os.chmod(path, 0o700)
    # locked before it says so: a sweep reads an empty record as no record, and leaves it
    fd = os.open(path / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks (NFS mounted nolock): judged by pid, as before
        os.write(fd, (json.dumps(_owner()) + "\n").encode())
        os.close(fd)
        return path
    os.write(fd, (json.dumps({**_owner(), "locked": True}) + "\n").encode())
    _LOCKS[path] = fd
    return path


def _release(path: Path) -> None:
    fd = _LOCKS.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_swap_dir(path: Path) -> None:
    """Remove a swap directory of this process (its lock released)."""
    _release(path)
    shutil.rmtree(path, ignore_errors=True)


def _lock_held(path: Path) -> bool:
    """Whether some process holds the lock of ``path`` (an owner record). Opened for writing,
    as NFS's emulation of flock needs for an exclusive lock; any doubt (an error other than
    the lock being held elsewhere) counts as held, so the directory is left alone."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # with our lock, if we took it
    return False


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class Sweep:
    """What ``sweep`` found under one parent directory."""

    removed: tuple[Path, ...]  # swap directories of processes that are gone, removed
    removed_bytes: int
    unowned: tuple[Path, ...]  # swap directories without an owner record, left alone
    kept: tuple[Path, ...]  # teraio-kept-* directories, left alone


def _is_stale(path: Path, host: str) -> bool | None:
    """Whether the swap directory's owner is gone; None without a readable owner record."""
    try:
        owner = json.loads((path / OWNER_FILE).read_text())
        pid, start, where = int(owner["pid"]), owner.get("start"), str(owner["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if where != host:
        return False  # another node's, on a shared file system: not ours to judge
    if path in _LOCKS:
        return False  # this process's own
    if owner.get("locked"):
        return not _lock_held(path / OWNER_FILE)
    now = _start_time(pid)
    return now is None or (start is not None and now != start)


def sweep(parent: str | os.PathLike[str] | None, remove: bool = True) -> Sweep:
    """Find (and with ``remove``, remove) the swap directories under ``parent`` whose owner
    process on this host is gone (NOTE [ Swap directories ])."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed, unowned, kept = [], [], []
    freed = 0
    host = socket.gethostname()
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return Sweep((), 0, (), ())
    for path in entries:
        if not path.is_dir() or path.is_symlink():
            continue
        if path.name.startswith(KEPT_PREFIX):
            kept.append(path)
        elif path.name.startswith((SWAP_PREFIX, "teraio-gds-")):
            stale = _is_stale(path, host)
            if stale is None:
                unowned.append(path)
            elif stale:
                freed += _size(path)
                if remove:
                    shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return Sweep(tuple(removed), freed, tuple(unowned), tuple(kept))


def keep_swap_dir(path: Path, files: list[dict[str, Any]]) -> Path:
    """Keep swap directory ``path`` with only ``files`` in it (dicts with a ``file`` name and
    what is known of the tensor), renamed ``teraio-kept-*``, with a ``kept.json`` manifest."""
    names = {str(f["file"]) for f in files}
    for entry in path.iterdir():
        if entry.name not in names and entry.name != OWNER_FILE:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    # still locked until it is a teraio-kept-* directory, which no sweep touches
    kept = path.with_name(KEPT_PREFIX + path.name.removeprefix(SWAP_PREFIX))
    path.rename(kept)
    (kept / KEPT_FILE).write_text(json.dumps({"owner": _owner(), "files": files}, indent=1) + "\n")
    (kept / OWNER_FILE).unlink(missing_ok=True)
    _release(path)
    return kept
