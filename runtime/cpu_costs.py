"""The figures of what moving tensors costs the training on this CPU, kept per machine (and the
one figure a GPU's plans take: each transfer's cost, ``cached_cuda_transfer_cost``).

``runtime.calibrate`` measures them (10-20 s); ``cached_cpu_costs`` measures
them once per machine, swap file system and torch version, and keeps them for
a week (``$XDG_CACHE_HOME/teraio/cpu-costs.json``), so that every
``teraio plan`` of a CPU profile need not. Reading them imports no torch
(2 s of every `teraio plan` on this machine).

NOTE [ Figures measured beside other work ]: the figures are times, and another
process's compute on the same cores makes them longer: a measurement made while
a test suite ran here gave 54 us per op and 0.83 ns per byte refaulted, where
three on the quiet machine gave 44-49 us and 0.34-0.35 ns, and every plan for a
week would have used them. So the measurement counts the CPU time the rest of
the machine used meanwhile (``/proc/stat``'s busy time of the CPUs this process
may run on, less its own); figures measured while others kept more than ``BUSY_CORES`` of a core
busy on average are kept for an hour, not a week, and the message says so.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CACHE_DAYS", "CpuCosts", "cache_path", "cached_cpu_costs", "cached_cuda_transfer_cost"]


@dataclass(frozen=True, kw_only=True)
class CpuCosts:
    copy_cost_s_per_byte: float
    """Compute time lost per byte moved (out or back)."""
    op_overhead_s: float
    """Time the executor's dispatch mode adds to each op."""
    refault_s_per_byte: float
    """Time to fault memory in again after the boundary's trim, per byte."""
    transfer_cost_s: float
    """Compute time each transfer takes beyond its bytes' copy cost."""
    transfer_latency_s: float
    """Channel time each transfer takes beyond its bytes."""
    posix_write_bw_bytes_per_s: float
    """The posix backend's rate out beside training, beyond each transfer's latency."""
    posix_read_bw_bytes_per_s: float
    """Its rate back."""
    ssd_duplex: float
    """The share of its rate each direction keeps while both move (NOTE [ Duplex ] in planner.simulate)."""


CACHE_DAYS = 7
BUSY_CORES = 0.25  # others' average use above which figures are kept for ``BUSY_KEEP_S`` only
BUSY_KEEP_S = 3600.0
METHOD = 8  # of ``runtime.calibrate``: figures measured another way are measured again


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # without importing it
    except importlib.metadata.PackageNotFoundError:  # a source build on the path
        import torch

        return str(torch.__version__)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "teraio" / "cpu-costs.json"


def _key(swap_dir: str | Path | None) -> str:
    """The cache's key: the machine, swap file system and torch version, and the method."""
    where = Path(swap_dir) if swap_dir is not None else Path(tempfile.gettempdir())
    try:
        dev = os.stat(where).st_dev
    except OSError:
        dev = -1
    return f"{socket.gethostname()}|{os.cpu_count()}|{_torch_version()}|{dev}|{METHOD}"


def cached_cpu_costs(swap_dir: str | Path | None = None,
                     measuring: Callable[[], None] | None = None) -> tuple[CpuCosts, str]:
    """``measure_cpu_costs`` once per machine, swap file system and torch version, kept for
    ``CACHE_DAYS`` in ``cache_path()``; the figures and how they were had (for a message).
    ``measuring`` is called before a measurement (to say that it takes a while)."""
    def measure() -> dict[str, float]:
        from runtime.calibrate import measure_cpu_costs

        return dataclasses.asdict(measure_cpu_costs(swap_dir))

    fields = tuple(f.name for f in dataclasses.fields(CpuCosts))
    costs, how = _cached(_key(swap_dir), fields, measure, measuring)
    return CpuCosts(**costs), how


def cached_cuda_transfer_cost(measuring: Callable[[], None] | None = None) -> tuple[float, str]:
    """The seconds each transfer takes the training on this machine's GPU (``runtime.calibrate``'s
    ``measure_transfer_cost`` on CUDA), kept as ``cached_cpu_costs`` keeps its figures, per GPU
    model and torch version; the figure and how it was had."""
    import torch

    def measure() -> dict[str, float]:
        from runtime.calibrate import measure_transfer_cost

        return {"transfer_cost_s": measure_transfer_cost(device="cuda")}

    key = f"{socket.gethostname()}|cuda|{torch.cuda.get_device_name()}|{_torch_version()}|{METHOD}"
    costs, how = _cached(key, ("transfer_cost_s",), measure, measuring)
    return costs["transfer_cost_s"], how


def _read(path: Path) -> dict[str, Any]:
    """The cache file's entries; none where it is missing or damaged."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _fresh(entry: Any, fields: tuple[str, ...]) -> tuple[dict[str, float], float, float] | None:
    """(the figures, when measured, others' cores then) of a cache entry that holds exactly
    ``fields`` as numbers and is still kept (NOTE [ Figures measured beside other work ]); None
    for any other (measured again)."""
    try:
        costs = {name: float(value) for name, value in entry["costs"].items()}
        measured_at, others = float(entry["measured_at"]), float(entry.get("others_cores", 0.0))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if set(costs) != set(fields) or time.time() - measured_at >= _kept_s(others):
        return None
    return costs, measured_at, others


def _cached(key: str, fields: tuple[str, ...], measure: Callable[[], dict[str, float]],
            measuring: Callable[[], None] | None) -> tuple[dict[str, float], str]:
    """The figures (``fields``) kept under ``key`` in ``cache_path()`` while they are fresh, else
    ``measure()``'s, added there beside the other keys' (a CPU's and a GPU's figures on one machine);
    with how they were had."""
    path = cache_path()
    kept = _fresh(_read(path).get(key), fields)
    if kept is not None:
        costs, measured_at, others = kept
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(measured_at))
        return costs, f"measured on this machine {when}{_beside(others)}, kept in {path}; delete it to measure again"
    if measuring is not None:
        measuring()
    start = _cpu_now()
    costs = measure()
    others = _others_cores(start)
    doc = _read(path)  # again: another plan may have added its figures meanwhile
    doc[key] = {"measured_at": time.time(), "costs": costs, "others_cores": others}
    try:  # atomically: parallel plans may measure at once, and the last one's figures stay
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time
    kept_for = f"{CACHE_DAYS} days" if others <= BUSY_CORES else "an hour"
    return costs, f"measured on this machine now{_beside(others)}, kept in {path} for {kept_for}"


def _kept_s(others_cores: float) -> float:
    """How long figures measured beside ``others_cores`` of other work are kept (NOTE [ Figures
    measured beside other work ])."""
    return CACHE_DAYS * 86400.0 if others_cores <= BUSY_CORES else BUSY_KEEP_S


def _beside(others_cores: float) -> str:
    if others_cores <= BUSY_CORES:
        return ""
    return (f" while other processes kept {others_cores:.1f} cores busy (figures made longer by them: "
            "plan again on a quieter machine for better ones)")


def _cpu_now() -> tuple[float, float, float] | None:
    """(wall, busy CPU seconds of the CPUs this process may run on, this process's CPU seconds);
    None without ``/proc/stat``. Busy: user, nice, system and steal time, not interrupts (the
    measurement's own I/O makes those)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except (OSError, AttributeError):
        return None
    busy = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in mine:
            user, nice, system, steal = int(fields[1]), int(fields[2]), int(fields[3]), int(fields[8])
            busy += user + nice + system + steal
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def _others_cores(start: tuple[float, float, float] | None,
                  end: tuple[float, float, float] | None = None) -> float:
    """The cores other processes kept busy on average from ``start`` to ``end`` (``_cpu_now``; by
    default now); 0 where unknown."""
    end = _cpu_now() if end is None else end
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    return max((end[1] - start[1]) - (end[2] - start[2]), 0.0) / (end[0] - start[0])
