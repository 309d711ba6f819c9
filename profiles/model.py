"""The in-memory profile and its reading, writing and validation.

NOTE [ The first iteration ]: iteration 0 differs from the steady state: it
runs the script's set-up (the model's parameters are made in it) and the
optimizer makes its state in it, so it has ops, storages and ids of its own.
A profile may carry it as ``Profile.first``, a profile of that one iteration,
written to the ``first_iteration/`` subdirectory with the same tables and
format. Nothing is alive before it except what the script made outside any op
(those storages get ``alloc_op`` at their first access), and what it leaves
alive (parameters, optimizer state, the last batch) has ``free_op == -1``.
Its ``meta.json`` adds ``carried_into_next``: for each transient storage it
hands to iteration 1 (the last batch, logits), the id a steady iteration gives
the storage that takes its place (NOTE [ Carried storages ] in
``torch_patch.tracer``) -> its id in iteration 1 (its iteration-0 id with the
carried flag), as a JSON object keyed by the steady id in decimal.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from profiles.errors import ProfileFormatError
from profiles.schema import (
    ACCESS_KINDS,
    DEFAULTS,
    FORMAT,
    OLDER_FORMATS,
    PHASES,
    TABLE_SCHEMAS,
    TENSOR_KINDS,
    missing_columns,
)

__all__ = ["Profile", "find_newest_profile", "merge_ranks", "read_profile", "write_profile"]

META_FILE = "meta.json"
FIRST_DIR = "first_iteration"  # NOTE [ The first iteration ]


@dataclass(frozen=True)
class Profile:
    """A profile: ``meta`` (the ``meta.json`` dict) and one DataFrame per table."""

    meta: dict[str, Any]
    kernels: pd.DataFrame
    tensors: pd.DataFrame
    accesses: pd.DataFrame
    path: Path | None = field(default=None, compare=False)
    first: Profile | None = None  # iteration 0, if recorded (NOTE [ The first iteration ])

    @property
    def signature(self) -> str:
        return str(self.meta["signature"])

    def kept_for_good(self, rank: int = 0) -> dict[int, dict[int, int]]:
        """{iteration i: {long id: the id its storage has in iteration i}}, for each iteration i
        from 2 to ``rank``'s first kept one, of the storages iteration i - 1 made and kept for
        good, named by their long ids in the tables (NOTE [ Kept for good ] in
        ``torch_patch.tracer``); empty where there are none. A version 4 profile has the first
        kept iteration's map alone (``carried_into_first_kept``)."""
        kept = (self.meta.get("kept_for_good") or {}).get(str(rank))
        if kept is None:
            old = (self.meta.get("carried_into_first_kept") or {}).get(str(rank))
            kept = {old["iteration"]: old["ids"]} if old else {}
        return {int(i): {int(k): int(v) for k, v in ids.items()} for i, ids in kept.items()}

    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in self.kernels["rank"].unique())

    @property
    def iterations(self) -> list[int]:
        return sorted(int(i) for i in self.kernels["iteration"].unique())

    def kernels_of(self, rank: int = 0, iteration: int | None = None) -> pd.DataFrame:
        """The ops of one rank and iteration (the first recorded one by default), by op_index."""
        k = self.kernels[self.kernels["rank"] == rank]
        it = int(k["iteration"].min()) if iteration is None else iteration
        return k[k["iteration"] == it].sort_values("op_index").reset_index(drop=True)

    def accesses_of(self, rank: int = 0, iteration: int | None = None) -> pd.DataFrame:
        a = self.accesses[self.accesses["rank"] == rank]
        it = int(a["iteration"].min()) if iteration is None else iteration
        return a[a["iteration"] == it].reset_index(drop=True)

    def tensors_of(self, rank: int = 0) -> pd.DataFrame:
        return self.tensors[self.tensors["rank"] == rank].reset_index(drop=True)


def merge_ranks(parts: list[Profile]) -> Profile:
    """One profile of a job from its ranks' own profiles (each of one rank): the tables side
    by side (their ``rank`` column tells them apart), ``meta`` of the lowest rank with the
    job's ``ranks``, per-rank ``signatures``, ``carried_into_next``, ``kept_for_good``,
    ``written_unseen`` and set-aside iterations.
    """
    parts = sorted(parts, key=lambda p: p.ranks[0])
    ranks = [r for p in parts for r in p.ranks]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {ranks} appear more than once")

    def meta(key: str) -> dict[str, Any]:
        return {k: v for p in parts for k, v in p.meta.get(key, {}).items()}

    merged = {
        **parts[0].meta, "ranks": ranks, "signatures": meta("signatures"),
        "skipped_iterations": [{**s, "rank": p.ranks[0]} for p in parts for s in p.meta.get("skipped_iterations", [])],
        "compiled": sorted({c for p in parts for c in p.meta.get("compiled", [])}),
        "written_unseen": meta("written_unseen"),
    }
    for key in ("carried_into_next", "kept_for_good"):
        if any(key in p.meta for p in parts):
            merged[key] = meta(key)
    firsts = [p.first for p in parts if p.first is not None]
    return Profile(
        meta=merged,
        kernels=pd.concat([p.kernels for p in parts], ignore_index=True),
        tensors=pd.concat([p.tensors for p in parts], ignore_index=True),
        accesses=pd.concat([p.accesses for p in parts], ignore_index=True),
        first=merge_ranks(firsts) if len(firsts) == len(parts) else None,
    )


def _to_table(df: pd.DataFrame, name: str) -> pa.Table:
    schema = TABLE_SCHEMAS[name]
    defaults = {k: v for k, v in DEFAULTS.get(name, {}).items() if k not in df.columns}
    if defaults:
        df = df.assign(**defaults)
    missing = [f.name for f in schema if f.name not in df.columns]
    if missing:
        raise ValueError(f"{name} table lacks columns {missing}")
    return pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)


def write_profile(profile: Profile, directory: str | os.PathLike[str], force: bool = False) -> Path:
    """Write ``profile`` to ``directory`` atomically: a half-written profile never looks valid.

    The files go to a temporary sibling directory that is renamed into place
    only when all four are written.
    """
    out = Path(directory)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists (use --force to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_parts(profile, tmp)
        if profile.first is not None:
            (tmp / FIRST_DIR).mkdir()
            _write_parts(profile.first, tmp / FIRST_DIR)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_parts(profile: Profile, directory: Path) -> None:
    for name in TABLE_SCHEMAS:
        pq.write_table(_to_table(getattr(profile, name), name), directory / f"{name}.parquet")
    meta = {**profile.meta, "format": FORMAT}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _read_table(path: Path, name: str, version: str) -> pd.DataFrame:
    """One table of a profile of format ``version`` (meta.json's), as a DataFrame of this version."""
    file = path / f"{name}.parquet"
    if not file.is_file():
        raise ProfileFormatError(file, "file is missing; is this a teraio profile directory?")
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        raise ProfileFormatError(file, f"not a readable Parquet file ({exc})") from None
    found = (table.schema.metadata or {}).get(b"format", b"<none>").decode()
    if found != version:
        raise ProfileFormatError(file, f"format {found!r}, expected {version!r} as in meta.json; "
                                       "re-run `teraio profile`")
    expected = TABLE_SCHEMAS[name].remove_metadata()
    added = missing_columns(version, name)
    for column in added:
        expected = expected.remove(expected.get_field_index(column))
    if table.schema.remove_metadata() != expected:
        raise ProfileFormatError(
            file, f"columns {table.schema.names} do not match the {version} schema {expected.names}"
        )
    df = table.to_pandas()
    if added:  # what older versions did not record (docs/formats.md, versions)
        df = df.assign(**added)[TABLE_SCHEMAS[name].names]
    return df


def _check_values(path: Path, p: Profile) -> None:
    def bad(file: str, problem: str) -> ProfileFormatError:
        return ProfileFormatError(path / file, problem)

    if not p.kernels["phase"].isin(PHASES).all():
        raise bad("kernels.parquet", f"phase outside {PHASES}")
    if not p.tensors["kind"].isin(TENSOR_KINDS).all():
        raise bad("tensors.parquet", f"kind outside {TENSOR_KINDS}")
    if not p.accesses["access"].isin(ACCESS_KINDS).all():
        raise bad("accesses.parquet", f"access outside {ACCESS_KINDS}")
    if (p.tensors["size_bytes"] < 0).any():
        raise bad("tensors.parquet", "negative size_bytes")
    if p.tensors.duplicated(["rank", "tensor_id"]).any():
        raise bad("tensors.parquet", "duplicate (rank, tensor_id)")
    if (p.kernels["duration_us"] < 0).any():
        raise bad("kernels.parquet", "negative duration_us")
    if (p.kernels["scratch_bytes"] < 0).any():
        raise bad("kernels.parquet", "negative scratch_bytes")
    for rank in p.ranks:
        try:
            p.kept_for_good(rank)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise bad(META_FILE, f"kept_for_good of rank {rank} is malformed ({exc!r})") from None
    known = set(zip(p.tensors["rank"], p.tensors["tensor_id"], strict=True))
    used = set(zip(p.accesses["rank"], p.accesses["tensor_id"], strict=True))
    if not used <= known:
        raise bad("accesses.parquet", f"{len(used - known)} tensor ids not in tensors.parquet")


def read_profile(directory: str | os.PathLike[str]) -> Profile:
    """Read and validate a profile directory; raises ``ProfileFormatError`` naming the problem."""
    path = Path(directory)
    if not path.is_dir():
        raise ProfileFormatError(path, "no such profile directory")
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise ProfileFormatError(meta_file, "file is missing; is this a teraio profile?") from None
    except (OSError, ValueError) as exc:
        raise ProfileFormatError(meta_file, f"not valid JSON ({exc})") from None
    version = meta.get("format") if isinstance(meta, dict) else None
    if version not in (FORMAT, *OLDER_FORMATS):
        raise ProfileFormatError(meta_file, f"format {version!r}, expected {FORMAT!r}; re-run "
                                            "`teraio profile` with this teraio")
    tables = {name: _read_table(path, name, str(version)) for name in TABLE_SCHEMAS}
    first = read_profile(path / FIRST_DIR) if (path / FIRST_DIR).is_dir() else None
    profile = Profile(meta=meta, path=path, first=first, **tables)
    _check_values(path, profile)
    return profile


def find_newest_profile(root: str | os.PathLike[str] = "profiles") -> Path:
    """The most recently written profile directory under ``root`` (one holding ``meta.json``)."""
    base = Path(root)
    candidates = [p.parent for p in base.glob(f"*/{META_FILE}")] if base.is_dir() else []
    if not candidates:
        raise ProfileFormatError(
            base, "no profile found here; run `teraio profile SCRIPT` or give a PROFILE path"
        )
    return max(candidates, key=lambda p: (p / META_FILE).stat().st_mtime)
