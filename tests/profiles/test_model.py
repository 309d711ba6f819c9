"""The version-1 profile format: exact schemas, round trips, validation, derived views."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profiles import (
    FORMAT,
    Profile,
    ProfileFormatError,
    active_bytes,
    find_newest_profile,
    inactive_periods,
    memory_curve,
    read_profile,
    write_profile,
)
from profiles.schema import ACCESSES_SCHEMA, KERNELS_SCHEMA, TENSORS_SCHEMA


def tiny_profile() -> Profile:
    """Four ops; a persistent weight w (id 0), an activation a and a temporary t.

    op:        0      1      2      3
    w (100)    read   .      .      read      persistent
    a (10)     write  .      .      read      alive [0, 4)
    t (1)      .      write  read   .         alive [1, 3)
    """
    kernels = pd.DataFrame({
        "rank": 0, "iteration": 1, "op_index": range(4),
        "op_name": ["aten.mm", "aten.relu", "aten.sum", "aten.mm"],
        "phase": ["forward", "forward", "forward", "backward"],
        "module": ["l1", None, None, "l1"],
        "start_us": [0.0, 10.0, 20.0, 30.0], "duration_us": [10.0, 10.0, 10.0, 10.0], "peer": -1,
        "scratch_bytes": [0, 0, 5, 0],
    })
    tensors = pd.DataFrame({
        "rank": 0, "tensor_id": [0, 1, 2], "size_bytes": [100, 10, 1],
        "kind": ["param", "activation", "temporary"], "dtype": "float32",
        "name": ["l1.weight", None, None], "persistent": [True, False, False],
        "alloc_op": [-1, 0, 1], "free_op": [-1, 4, 3], "resizable": True,
    })
    accesses = pd.DataFrame({
        "rank": 0, "iteration": 1, "op_index": [0, 0, 1, 2, 3, 3],
        "tensor_id": [0, 1, 2, 2, 0, 1],
        "access": ["read", "write", "write", "read", "read", "read"],
    })
    return Profile(meta={"signature": "x", "mode": "real"}, kernels=kernels, tensors=tensors,
                   accesses=accesses)


def test_round_trip_keeps_exact_columns_and_values(tmp_path: Path) -> None:
    p = tiny_profile()
    out = write_profile(p, tmp_path / "p")
    assert sorted(f.name for f in out.iterdir()) == [
        "accesses.parquet", "kernels.parquet", "meta.json", "tensors.parquet"]
    for name, schema in [("kernels", KERNELS_SCHEMA), ("tensors", TENSORS_SCHEMA),
                         ("accesses", ACCESSES_SCHEMA)]:
        table = pq.read_table(out / f"{name}.parquet")
        assert table.schema.names == schema.names
        assert table.schema.metadata[b"format"] == FORMAT.encode()
    back = read_profile(out)
    assert back.meta["format"] == FORMAT
    for name in ("kernels", "tensors", "accesses"):
        pd.testing.assert_frame_equal(getattr(back, name), getattr(p, name), check_dtype=False)


def test_the_first_iteration_round_trips_in_its_subdirectory(tmp_path: Path) -> None:
    first = tiny_profile()
    p = Profile(meta=tiny_profile().meta, kernels=tiny_profile().kernels, tensors=tiny_profile().tensors,
                accesses=tiny_profile().accesses,
                first=Profile(meta={**first.meta, "carried_into_next": {"0": {"5": 7}}}, kernels=first.kernels.assign(
                    iteration=0), tensors=first.tensors, accesses=first.accesses.assign(iteration=0)))
    out = write_profile(p, tmp_path / "p")
    assert (out / "first_iteration" / "kernels.parquet").is_file()
    back = read_profile(out)
    assert back.first is not None and back.first.first is None
    assert back.first.meta["carried_into_next"] == {"0": {"5": 7}}
    for name in ("kernels", "tensors", "accesses"):
        pd.testing.assert_frame_equal(getattr(back.first, name), getattr(p.first, name), check_dtype=False)
    assert read_profile(write_profile(tiny_profile(), tmp_path / "q")).first is None
    (out / "first_iteration" / "accesses.parquet").write_bytes(b"junk")
    with pytest.raises(ProfileFormatError, match=r"first_iteration/accesses\.parquet"):
        read_profile(out)


def test_write_refuses_existing_directory(tmp_path: Path) -> None:
    write_profile(tiny_profile(), tmp_path / "p")
    with pytest.raises(FileExistsError):
        write_profile(tiny_profile(), tmp_path / "p")
    write_profile(tiny_profile(), tmp_path / "p", force=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_damaged_and_foreign_files_are_named(tmp_path: Path) -> None:
    out = write_profile(tiny_profile(), tmp_path / "p")
    (out / "tensors.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ProfileFormatError, match="tensors.parquet: not a readable Parquet"):
        read_profile(out)

    out = write_profile(tiny_profile(), tmp_path / "q")
    table = pq.read_table(out / "kernels.parquet")
    pq.write_table(table.replace_schema_metadata({b"format": b"teraio-profile/0"}),
                   out / "kernels.parquet")
    with pytest.raises(ProfileFormatError, match="kernels.parquet: format 'teraio-profile/0'"):
        read_profile(out)

    out = write_profile(tiny_profile(), tmp_path / "r")
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "format": "teraio-profile/9"}))
    with pytest.raises(ProfileFormatError, match="meta.json: format 'teraio-profile/9'"):
        read_profile(out)

    out = write_profile(tiny_profile(), tmp_path / "s")
    (out / "accesses.parquet").unlink()
    with pytest.raises(ProfileFormatError, match="accesses.parquet: file is missing"):
        read_profile(out)

    with pytest.raises(ProfileFormatError, match="no such profile directory"):
        read_profile(tmp_path / "nowhere")


def as_version(out: Path, version: int) -> None:
    """Rewrite profile ``out`` as an older teraio wrote it: version 1 had no ``resizable`` or
    ``peer``, version 2 no ``scratch_bytes``, version 3 no ``carried_into_first_kept``, version 4
    that key where version 5 has ``kept_for_good``."""
    dropped = {"kernels": (["scratch_bytes"] if version <= 2 else []) + (["peer"] if version == 1 else []),
               "tensors": ["resizable"] if version == 1 else []}
    fmt = f"teraio-profile/{version}"
    for name in ("kernels", "tensors", "accesses"):
        table = pq.read_table(out / f"{name}.parquet").drop(dropped.get(name, []))
        pq.write_table(table.replace_schema_metadata({b"format": fmt.encode()}), out / f"{name}.parquet")
    meta = json.loads((out / "meta.json").read_text())
    kept = meta.pop("kept_for_good", None)
    if version == 4 and kept:  # the first kept iteration's map alone
        meta["carried_into_first_kept"] = {r: {"iteration": int(max(its, key=int)), "ids": its[max(its, key=int)]}
                                           for r, its in kept.items()}
    if version < 4:
        meta.pop("carried_into_first_kept", None)
    (out / "meta.json").write_text(json.dumps({**meta, "format": fmt}))


def test_a_version_2_profile_reads_with_no_scratch(tmp_path: Path) -> None:
    out = write_profile(tiny_profile(), tmp_path / "p")
    assert read_profile(out).kernels["scratch_bytes"].tolist() == [0, 0, 5, 0]
    as_version(out, 2)
    back = read_profile(out)
    assert list(back.kernels.columns) == KERNELS_SCHEMA.names
    assert back.kernels["scratch_bytes"].tolist() == [0, 0, 0, 0]
    assert back.kernels["peer"].tolist() == [-1] * 4
    again = write_profile(back, tmp_path / "again")
    assert json.loads((again / "meta.json").read_text())["format"] == FORMAT == "teraio-profile/5"


def test_older_profiles_read_with_the_maps_they_have_of_storages_kept_for_good(tmp_path: Path) -> None:
    """Version 5 maps each iteration from 2 to the first kept one, version 4 the first kept one
    alone, version 3 none (NOTE [ Kept for good ] in torch_patch.tracer)."""
    p = tiny_profile()
    kept = {"0": {"2": {str(3 << 40): (1 << 47) | 5}, "3": {str((3 << 40) + 1): (1 << 47) | 7}}}
    out = write_profile(Profile(meta={**p.meta, "kept_for_good": kept}, kernels=p.kernels,
                                tensors=p.tensors, accesses=p.accesses), tmp_path / "p")
    assert read_profile(out).kept_for_good(0) == {2: {3 << 40: (1 << 47) | 5}, 3: {(3 << 40) + 1: (1 << 47) | 7}}
    as_version(out, 4)
    assert read_profile(out).kept_for_good(0) == {3: {(3 << 40) + 1: (1 << 47) | 7}}
    as_version(out, 3)
    assert read_profile(out).kept_for_good(0) == {}
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "carried_into_first_kept": {"0": {"ids": {}}}}))
    with pytest.raises(ProfileFormatError, match="kept_for_good of rank 0 is malformed"):
        read_profile(out)


def test_negative_scratch_is_refused(tmp_path: Path) -> None:
    p = tiny_profile()
    out = write_profile(Profile(meta=p.meta, kernels=p.kernels.assign(scratch_bytes=[0, -1, 0, 0]),
                                tensors=p.tensors, accesses=p.accesses), tmp_path / "p")
    with pytest.raises(ProfileFormatError, match="negative scratch_bytes"):
        read_profile(out)


def test_a_version_1_profile_reads_as_the_current_version_with_every_storage_resizable(tmp_path: Path) -> None:
    p = tiny_profile()
    out = write_profile(Profile(meta=p.meta, kernels=p.kernels, tensors=p.tensors.assign(resizable=[True, False, True]),
                                accesses=p.accesses), tmp_path / "p")
    assert list(read_profile(out).tensors["resizable"]) == [True, False, True]
    as_version(out, 1)
    back = read_profile(out)
    assert list(back.tensors.columns) == TENSORS_SCHEMA.names
    assert back.tensors["resizable"].tolist() == [True, True, True]
    assert list(back.kernels.columns) == KERNELS_SCHEMA.names and (back.kernels["peer"] == -1).all()
    assert (back.kernels["scratch_bytes"] == 0).all()
    again = write_profile(back, tmp_path / "again")  # written back as the current version
    assert json.loads((again / "meta.json").read_text())["format"] == FORMAT == "teraio-profile/5"
    pq.write_table(pq.read_table(out / "kernels.parquet").replace_schema_metadata({b"format": FORMAT.encode()}),
                   out / "kernels.parquet")
    with pytest.raises(ProfileFormatError, match="format 'teraio-profile/5', expected 'teraio-profile/1' as in meta"):
        read_profile(out)


def test_wrong_columns_are_refused(tmp_path: Path) -> None:
    out = write_profile(tiny_profile(), tmp_path / "p")
    table = pq.read_table(out / "accesses.parquet").drop(["access"])
    pq.write_table(table.replace_schema_metadata({b"format": FORMAT.encode()}),
                   out / "accesses.parquet")
    with pytest.raises(ProfileFormatError, match="do not match"):
        read_profile(out)


def test_bad_values_are_refused(tmp_path: Path) -> None:
    p = tiny_profile()
    bad = Profile(meta=p.meta, kernels=p.kernels, tensors=p.tensors.assign(kind="weird"),
                  accesses=p.accesses)
    out = write_profile(bad, tmp_path / "p")
    with pytest.raises(ProfileFormatError, match="kind outside"):
        read_profile(out)


def test_memory_curve_and_active_bytes() -> None:
    p = tiny_profile()
    assert memory_curve(p).tolist() == [110, 111, 111, 110]
    assert active_bytes(p).tolist() == [110, 1, 1, 110]


def test_wrapping_lifetime_counts_both_ends() -> None:
    p = tiny_profile()
    tensors = p.tensors.copy()
    tensors.loc[2, ["alloc_op", "free_op"]] = [2, 1]  # alive at ops 0 and 2, 3
    wrapped = Profile(meta=p.meta, kernels=p.kernels, tensors=tensors, accesses=p.accesses)
    assert memory_curve(wrapped).tolist() == [111, 110, 111, 111]


def test_inactive_periods_include_wrap_for_persistent() -> None:
    periods = inactive_periods(tiny_profile()).sort_values(["tensor_id", "start_op"])
    rows = periods[["tensor_id", "start_op", "end_op", "num_ops", "wraps"]].values.tolist()
    # w: gap 0 -> 3, then wrap 3 -> 0 + 4 = 4 has no op between: not a period.
    # a: gap 0 -> 3. t: 1 -> 2 is adjacent: no period.
    assert rows == [[0, 0, 3, 2, False], [1, 0, 3, 2, False]]
    assert np.allclose(periods["duration_us"], [20.0, 20.0])


def test_a_small_byte_storage_is_never_moved() -> None:
    """NOTE [ Random states ] in profiles.views: a random state ``torch.load`` rebuilds (filled
    by ``copy_``, taken by ``set_``, read by an op, then by ``Generator.set_state`` with no op)
    has no period; a large uint8 storage, or a small float one, is planned as before."""
    ops = ["aten.empty.memory_format", "aten.copy_.default", "aten.set_.source_Storage_storage_offset",
           "aten.sum", "aten.relu", "aten.relu", "aten.relu"]
    kernels = pd.DataFrame({"rank": 0, "iteration": 1, "op_index": range(len(ops)), "op_name": ops,
                            "phase": "other", "module": None, "start_us": np.arange(len(ops)) * 10.0,
                            "duration_us": 10.0, "peer": -1, "scratch_bytes": 0})
    # 0: a small state; 1: a large uint8 one; 2: a small float one
    tensors = pd.DataFrame({"rank": 0, "tensor_id": [0, 1, 2], "size_bytes": [5056, 1 << 20, 5056],
                            "kind": "other", "dtype": ["uint8", "uint8", "float32"], "name": None,
                            "persistent": False, "alloc_op": 0, "free_op": -1, "resizable": True})
    accesses = pd.DataFrame({"rank": 0, "iteration": 1, "op_index": [0, 1, 2, 3] * 3,
                             "tensor_id": [0] * 4 + [1] * 4 + [2] * 4,
                             "access": ["write", "write", "read", "read"] * 3})
    prof = Profile(meta={"signature": "x", "mode": "real"}, kernels=kernels, tensors=tensors, accesses=accesses)
    periods = inactive_periods(prof)[["tensor_id", "start_op", "end_op"]].values.tolist()
    assert sorted(periods) == [[1, 3, 7], [2, 3, 7]]


def test_find_newest_profile(tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match="no profile found"):
        find_newest_profile(tmp_path)
    a = write_profile(tiny_profile(), tmp_path / "a")
    b = write_profile(tiny_profile(), tmp_path / "b")
    (tmp_path / "__pycache__").mkdir()
    import os
    os.utime(a / "meta.json", (1, 1))
    assert find_newest_profile(tmp_path) == b


def test_arrow_schemas_are_explicit() -> None:
    assert KERNELS_SCHEMA.field("start_us").type == pa.float64()
    assert TENSORS_SCHEMA.field("tensor_id").type == pa.int64()
    assert not ACCESSES_SCHEMA.field("access").nullable
