"""The figures of what moving tensors costs the training on this CPU, kept per machine.

``runtime.calibrate`` measures them (10-20 s); ``cached_cpu_costs`` measures
them once per machine, swap file system and torch version, and keeps them for
a week (``$XDG_CACHE_HOME/teraio/cpu-costs.json``), so that every
``teraio plan`` of a CPU profile need not. Reading them imports no torch
(2 s of every `teraio plan` on this machine).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_DAYS", "CpuCosts", "cache_path", "cached_cpu_costs"]


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
METHOD = 6  # of ``runtime.calibrate``: figures measured another way are measured again


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # without importing it
    except importlib.metadata.PackageNotFoundError:  # a source build on the path
        import torch

        return str(torch.__version__)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "teraio" / "cpu-costs.json"


def cached_cpu_costs(swap_dir: str | Path | None = None,
                     measuring: Callable[[], None] | None = None) -> tuple[CpuCosts, str]:
    """``measure_cpu_costs`` once per machine, swap file system and torch version, kept for
    ``CACHE_DAYS`` in ``cache_path()``; the figures and how they were had (for a message).
    ``measuring`` is called before a measurement (to say that it takes a while)."""
    where = Path(swap_dir) if swap_dir is not None else Path(tempfile.gettempdir())
    try:
        dev = os.stat(where).st_dev
    except OSError:
        dev = -1
    key = f"{socket.gethostname()}|{os.cpu_count()}|{_torch_version()}|{dev}|{METHOD}"
    path = cache_path()
    try:
        doc = json.loads(path.read_text())
        entry = doc[key]
        if time.time() - float(entry["measured_at"]) < CACHE_DAYS * 86400:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(entry["measured_at"])))
            return CpuCosts(**entry["costs"]), f"measured on this machine {when}, kept in {path}; delete it " \
                                               "to measure again"
    except (OSError, ValueError, KeyError, TypeError):
        doc = {}
    if measuring is not None:
        measuring()
    from runtime.calibrate import measure_cpu_costs

    costs = measure_cpu_costs(swap_dir)
    if not isinstance(doc, dict):
        doc = {}
    doc[key] = {"measured_at": time.time(), "costs": dataclasses.asdict(costs)}
    try:  # atomically: parallel plans may measure at once, and the last one's figures stay
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time
    return costs, f"measured on this machine now, kept in {path} for {CACHE_DAYS} days"
