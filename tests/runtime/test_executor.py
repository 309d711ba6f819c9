"""The executor on real training steps with hand-made plans: bit-exact, and faults handled.

These plans offload every idle stretch of every tensor of 4 KiB or more, as
soon as it starts, under a budget of one byte: every op that allocates waits
for every write in flight first (NOTE [ Room ]), so each write is done before
the next allocation, whatever the machine's speed. Far more traffic than a
real plan, to stress the state machine. Plans from the planner are tested end
to end in test_run_cli.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import os
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import PlanFormatError
from planner.plan import Migration, Plan
from profiles import Profile, inactive_periods, made_bytes
from profiles.ids import PRODUCED_BASE
from runtime.api import first_iteration_warning, offload
from runtime.errors import PlanMismatchError, StorageIOError, SwapKeptError
from torch_patch import ProfileComplete, Tracer, mark_iteration


def mlp_and_data(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.Generator().manual_seed(seed)


def train(steps: int, hook=None, save_at=None) -> tuple[list[float], list[torch.Tensor]]:  # type: ignore[no-untyped-def] # noqa: E501
    """``hook(step)`` and ``save_at(step, model, opt)`` run between each step's forward and backward."""
    model, opt, gen = mlp_and_data()
    losses = []
    for step in range(steps):
        x = torch.randn(64, 32, generator=gen)
        loss = model(x).square().mean()
        if hook is not None:
            hook(step)
        if save_at is not None:
            save_at(step, model, opt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def same(a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]) -> bool:
    """Two ``train`` results bit for bit: losses and final parameters."""
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def on_a_thread(work: Callable[[], Any]) -> None:
    """Run ``work`` on a thread of the script's own, started now, and wait for it."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


class OpNames(TorchDispatchMode):
    """The names of the ops run on this thread in its body: a plan's op list, by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self._thread = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if threading.get_ident() == self._thread:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def extra_op_at(at: int) -> Callable[[int], None]:
    """A ``train`` hook that runs, at step ``at``, an op the profile never saw."""
    def hook(step: int) -> None:
        if step == at:
            torch.ones(3).add_(1)

    return hook


def move(tid: int, action: str, trigger: int, deadline: int, size: int, start_op: int = -1,
         end_op: int = -1, wraps: bool = False, name: str | None = None) -> Migration:
    return Migration(tensor_id=tid, size_bytes=size, action=action, place="ssd", trigger_op=trigger,
                     deadline_op=deadline, start_us=None, end_us=None, urgent=False, priority=0,
                     wraps=wraps, period_start_op=start_op, period_end_op=end_op, name=name)


def plan_of(moves: list[Migration], op_names: list[str], budget: int | None = None,
            first: Plan | None = None, carried: dict[int, int] | None = None,
            summary: dict[str, Any] | None = None, made: list[int] | None = None) -> Plan:
    """A one-rank plan of ``moves`` (the planner's model, as the runtime reads it); ``made``: the
    bytes each op allocates (none: no op makes room)."""
    return Plan(signature="hand", parameters={"gpu_mem_bytes": budget, "device_type": "cpu"}, summary=summary or {},
                migrations={0: moves}, op_names={0: op_names}, made_bytes={0: made or [0] * len(op_names)},
                first=first, carried_into_next={0: carried} if carried is not None else {})


def hand_moves(prof: Profile, min_bytes: int, trailing: bool = False) -> list[Migration]:
    """Every idle stretch inside the iteration, offloaded at its start; with
    ``trailing``, also every one from a last use to the iteration's end (offload only)."""
    periods = inactive_periods(prof)
    n = len(prof.kernels_of())
    to_end = ~periods["reads_back"] & (periods["end_op"] == n)
    periods = periods[(~periods["wraps"] | (to_end if trailing else False))
                      & (periods["num_ops"] >= 3) & (periods["size_bytes"] >= min_bytes)]
    moves = []
    for r in periods.itertuples():
        tid, size, start, end = int(r.tensor_id), int(r.size_bytes), int(r.start_op), int(r.end_op)
        moves.append(move(tid, "offload", start + 1, start + 2, size, start, end))
        if r.reads_back:
            moves.append(move(tid, "prefetch", end - 1, end, size, start, end))
    return moves


def traced() -> Profile:
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        train(5)
    return tracer.profile({})


def op_names(prof: Profile) -> list[str]:
    return prof.kernels_of()["op_name"].tolist()


def hand_plan(prof: Profile | None = None, min_bytes: int = 4096) -> Plan:
    """The steady iteration's stretches, and iteration 0's with what it leaves alive left out
    (of ``prof``, or of a fresh trace of ``train``)."""
    prof = traced() if prof is None else prof
    moves = hand_moves(prof, min_bytes)
    assert len(moves) > 20 and prof.first is not None
    carried = {int(steady): made for steady, made in prof.first.meta["carried_into_next"]["0"].items()}
    first = plan_of(hand_moves(prof.first, min_bytes, trailing=True), op_names(prof.first), budget=1,
                    made=made_bytes(prof.first).tolist(), carried=carried)
    first_moves = first.migrations[0]
    assert sum(m.action == "offload" for m in first_moves) > sum(m.action == "prefetch" for m in first_moves)
    return plan_of(moves, op_names(prof), budget=1, first=first, made=made_bytes(prof).tolist())


@pytest.fixture(scope="module")
def profiled() -> Profile:
    return traced()


@pytest.fixture(scope="module")
def plan(profiled: Profile) -> Plan:
    return hand_plan(profiled)


@pytest.mark.parametrize("backend", ["posix", "host"])
def test_bit_identical_with_offloading(plan: Plan, backend: str, tmp_path: Path) -> None:
    expected_losses, expected_params = train(6)
    with offload(plan, backend=backend, swap_dir=tmp_path) as ex:
        losses, params = train(6)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert ex.stats.bytes_read["ssd"] > 0
    # iteration 0 leaves out what it leaves alive; what the steady plan has in comes back
    assert ex.stats.bytes_read["ssd"] <= ex.stats.bytes_written["ssd"]
    assert not ex.unfollowed and ex.matched_iterations >= 4
    assert not list(tmp_path.iterdir())  # swap directory removed


@pytest.mark.parametrize("backend", ["posix", "host"])
def test_kept_copies_are_reused_only_while_nothing_writes_the_storage(plan: Plan, backend: str,
                                                                       tmp_path: Path) -> None:
    """NOTE [ Copies kept ]: every prefetch keeps its copy and every offload would reuse one, far
    beyond what the planner marks (it marks only unchanged periods): a parameter's offload after
    its backward use reuses the copy its prefetch kept, while Adam's writes to the parameters and
    moments, and a gradient's accumulation, drop theirs and write again. Bit for bit all the same."""
    expected = train(6)
    with offload(plan, backend=backend, swap_dir=tmp_path) as ex:
        normal = train(6)
    steady = {r: [dataclasses.replace(m, keep_copy=m.action == "prefetch", reuse_copy=m.action == "offload")
                  for m in ms] for r, ms in plan.migrations.items()}
    with offload(dataclasses.replace(plan, migrations=steady), backend=backend, swap_dir=tmp_path) as kept:
        reused = train(6)
    assert same(normal, expected) and same(reused, expected)
    assert kept.stats.reused_offloads > 0 and kept.stats.dropped_copies > 0
    assert sum(kept.stats.bytes_written.values()) < sum(ex.stats.bytes_written.values())
    assert not kept.copies and not list(tmp_path.iterdir())  # every copy dropped at the end
    # `teraio run --no-reuse-copies`: the same plan writes every offload
    with offload(dataclasses.replace(plan, migrations=steady), backend=backend, swap_dir=tmp_path,
                 reuse_copies=False) as written:
        assert same(train(6), expected)
    assert written.stats.reused_offloads == 0 and not written.copies
    assert sum(written.stats.bytes_written.values()) == sum(ex.stats.bytes_written.values())


def test_a_ctrl_c_as_a_kept_copy_is_reused_loses_nothing(plan: Plan, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Interrupts ]: a Ctrl-C right after a storage is freed against its kept copy still has
    it brought back at exit (it was lost: neither moved nor kept)."""
    import runtime.executor as rex

    real_free, fired = rex.free_storage, []

    def free_then_interrupt(storage: torch.UntypedStorage) -> None:
        real_free(storage)
        if sys._getframe(1).f_code.co_name == "_reuse_copy" and not fired:
            fired.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(rex, "free_storage", free_then_interrupt)
    steady = {r: [dataclasses.replace(m, keep_copy=m.action == "prefetch", reuse_copy=m.action == "offload")
                  for m in ms] for r, ms in plan.migrations.items()}
    model, opt, gen = mlp_and_data()
    with pytest.raises(KeyboardInterrupt), offload(dataclasses.replace(plan, migrations=steady), backend="host",
                                                   swap_dir=tmp_path):
        for _ in range(6):  # as train()
            loss = model(torch.randn(64, 32, generator=gen)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
    assert fired
    tensors = [t for p in model.parameters() for t in (p, p.grad, *opt.state.get(p, {}).values())
               if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    assert not list(tmp_path.iterdir())


def test_a_rank_the_plan_has_no_section_for_is_refused(plan: Plan, tmp_path: Path) -> None:
    """Through the API too (`teraio run` checks it first): such a rank would train with nothing
    moved. Refused before any thread starts or swap directory is made."""
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(PlanFormatError, match="no section for rank 3"), offload(plan, rank=3, swap_dir=tmp_path):
        pass
    assert not list(tmp_path.iterdir())
    assert {t.name for t in threading.enumerate()} <= threads


def _interrupt(*args: Any, **kwargs: Any) -> Any:
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["runtime.api._signals_as_exit", "torch_patch.opstream.signals_outside_callbacks",
                                   "runtime.executor.PlanExecutor._save"])
def test_a_ctrl_c_while_offload_starts_leaves_nothing_behind(plan: Plan, where: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Wherever a Ctrl-C lands on the way in (after the engine's threads started and the swap
    directory was made, while torch is being patched, after the dispatch mode is in), the
    threads stop, the swap directory goes and torch is as it was."""
    from torch.nn.modules import module
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    threads = {t.name for t in threading.enumerate()}
    before = (torch.compile, torch.UntypedStorage.resize_, torch.serialization._save,
              len(module._global_forward_pre_hooks), len(module._global_forward_hooks))
    monkeypatch.setattr(where, _interrupt)
    with pytest.raises(KeyboardInterrupt), offload(plan, swap_dir=tmp_path):
        pass
    assert not list(tmp_path.iterdir())
    assert {t.name for t in threading.enumerate()} <= threads
    assert _get_current_dispatch_mode() is None
    assert (torch.compile, torch.UntypedStorage.resize_, torch.serialization._save,
            len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == before


def test_offloading_lowers_tracked_peak(plan: Plan) -> None:
    with offload(plan_of([], plan.op_names[0])) as plain:
        train(4)
    with offload(plan) as ex:
        train(4)
    # every iteration, iteration 0 under its own plan, not just the last one
    peaks, plain_peaks = ex.stats.iteration_peak_bytes, plain.stats.iteration_peak_bytes
    assert len(peaks) == 4 and ex.first_left_at is None
    stalls = ex.stats.iteration_stall_s
    assert len(stalls) == 4 and min(stalls) >= 0 and sum(stalls) <= ex.stats.stall_s + 1e-9
    # what each wait from iteration 1 on was for: they add up to those iterations' stalls
    causes = ex.stats.steady_stalls
    assert set(causes) <= {"room", "late read", "fault", "offload", "boundary"}, causes
    assert sum(s for _, s in causes.values()) == pytest.approx(sum(stalls[1:]), abs=1e-6)
    assert max(peaks[1:]) < min(plain_peaks[1:])
    assert peaks[0] < plain_peaks[0]


def test_what_the_first_iteration_left_out_comes_back(plan: Plan) -> None:
    """Iteration 0's plan leaves out what it leaves alive (parameters, optimizer state); the
    steady plan has them in at the boundary, so they come back there, and all is exact."""
    expected_losses, expected_params = train(4)
    left_out: list[int] = []

    def at_step(step: int) -> None:
        if step == 0:  # iteration 0's forward: parameters made in it are out already
            left_out.append(sum(e.state.value in ("ssd", "offloading") for e in ex.moved.values()))
        if step == 1:  # iteration 1's forward: they came back at the boundary, not on demand
            left_out.append(ex.stats.on_demand_fetches)

    with offload(plan) as ex:
        losses, params = train(4, hook=at_step)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert ex.first_left_at is None and ex.matched_iterations >= 3
    assert left_out[0] > 0 and left_out[1] == 0


def test_a_first_iteration_that_differs_goes_on_on_demand(plan: Plan) -> None:
    """An op iteration 0's plan did not see (as under ``offload()`` entered mid-script):
    iteration 0 stops following its plan with one warning, the steady plan is followed."""
    expected = train(5, hook=extra_op_at(0))
    with pytest.warns(RuntimeWarning, match="iteration 0 left its plan at op"):
        with offload(plan) as ex:
            assert same(train(5, hook=extra_op_at(0)), expected)
    assert ex.first_left_at is not None and not ex.unfollowed
    assert ex.matched_iterations == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_reading_what_is_out_stops_itself_and_the_parent_loses_nothing(
        plan: Plan, tmp_path: Path) -> None:
    """A process forked mid-step (a producer that runs the model on batches) inherits the
    executor with none of its I/O threads (NOTE [ Forked children ]): an op on the first layer's
    weight, which this plan has out between forward and backward, stops the child with an
    error that says so (it hung on a job no thread would finish, or deleted the parent's swap
    files draining its finished writes), and the parent trains on bit-identically."""
    codes: list[int] = []

    def fork_and_read(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step != 2:
            return
        pid = os.fork()
        if pid == 0:  # the child: the weight is out (an error) or still being written (its bytes)
            code = 3
            try:
                code = 0 if torch.isfinite(model[0].weight.sum()) else 2
            except RuntimeError as exc:
                code = 1 if "forked from the training process" in str(exc) else 4
            finally:
                os._exit(code)
        for _ in range(300):  # at most 30 s: a child that hangs fails the test
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes.append(os.waitstatus_to_exitcode(status))
                return
            threading.Event().wait(0.1)
        os.kill(pid, 9)
        codes.append(-9)

    plain = train(5)
    with offload(plan, swap_dir=tmp_path, backend="posix"):
        assert same(train(5, save_at=fork_and_read), plain)
    assert codes and codes[0] in (0, 1), codes


@pytest.mark.parametrize("reader", ["an op", "a torch.save"])
def test_deleted_swap_file_is_a_named_error(plan: Plan, reader: str, tmp_path: Path) -> None:
    """Swap files gone when a tensor is read back, for an op or by a torch.save that writes it
    from its copy (NOTE [ Streamed saves ]): an error naming the tensor and the file."""
    def delete_swap_files(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 3:
            ex._drain()
            files = list(tmp_path.glob("teraio-swap-*/*.bin"))
            assert files, "nothing was offloaded before backward"
            for f in files:
                f.unlink()
            if reader == "a torch.save":
                torch.save({"params": list(model.parameters()), "opt": opt.state_dict()}, io.BytesIO())

    with pytest.raises(StorageIOError, match=r"tensor \d+: cannot read it back from .*\.bin") as caught:
        with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
            train(6, save_at=delete_swap_files)
    assert any(Path(e.path).name == "saves.py" for e in caught.traceback) == (reader == "a torch.save")
    assert not list(tmp_path.iterdir())


def test_what_cannot_be_restored_at_exit_is_kept_and_named(plan: Plan, tmp_path: Path) -> None:
    """Truncated swap files: the read that needs one fails with a named error; at exit the
    tensors that cannot be brought back keep their files (a teraio-kept-* directory with a
    manifest), and one error names them, chained to the error that ended the run."""
    def truncate_swap_files(step: int) -> None:
        if step == 3:
            ex._drain()
            for f in tmp_path.glob("teraio-swap-*/*.bin"):
                os.truncate(f, 0)

    with pytest.raises(SwapKeptError) as caught:
        with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
            train(6, hook=truncate_swap_files)
    assert isinstance(caught.value.__cause__, StorageIOError)
    assert "truncated" in str(caught.value.__cause__)
    (kept,) = caught.value.kept
    assert kept.parent == tmp_path and kept.name.startswith("teraio-kept-")
    manifest = json.loads((kept / "kept.json").read_text())
    files = {f["file"] for f in manifest["files"]}
    assert files and files == {p.name for p in kept.glob("*.bin")}
    assert all(f["tensor"] in str(caught.value) for f in manifest["files"])
    # the tensor whose read failed during training keeps its file too
    assert Path(caught.value.__cause__.where).name in files
    assert not list(tmp_path.glob("teraio-swap-*"))


SAVE_BOUND_AT_IMPORT = torch.save  # as `from torch import save` before teraio starts


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("name", ["torch.save", "bound before teraio", "legacy format"])
def test_a_checkpoint_saved_mid_iteration_holds_the_offloaded_bytes(plan: Plan, name: str, hold: bool,
                                                                    tmp_path: Path) -> None:
    """A save between forward and backward, while the first layers' weights are out, whichever
    name the script calls torch.save by: the file holds the plain run's bytes, written from the
    weights' copies with nothing brought back into memory while it is written (NOTE [ Streamed
    saves ] in runtime.saves: before, every out storage came back for the save at once; the legacy
    format's writer still brings them back, and sends them out again after). With the
    iteration held to the budget on demand (NOTE [ On demand within the budget ]), nothing goes
    out while the save runs either (its pickling once sent out what it read: empty records)."""
    class Watched(io.BytesIO):  # the tracked bytes as each record is written
        def write(self, data: Any) -> int:
            seen.append(tracked[0]())
            return super().write(data)

    def save_at(files: list[bytes]) -> Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]:
        def hook(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            if step == 3:
                save = torch.save if name == "torch.save" else SAVE_BOUND_AT_IMPORT
                before.append(tracked[0]())
                f = Watched()
                # the parameters themselves: state_dict()'s detach ops would bring them back first
                obj = {"params": list(model.parameters()), "opt": opt.state_dict()}
                if name == "legacy format":
                    torch.save(obj, f, _use_new_zipfile_serialization=False)
                else:
                    save(obj, f)
                files.append(f.getvalue())
        return hook

    tracked: list[Callable[[], int]] = [lambda: 0]
    seen: list[int] = []
    before: list[int] = []
    plain: list[bytes] = []
    expected = train(5, save_at=save_at(plain))
    ours: list[bytes] = []
    seen.clear()
    before.clear()
    with offload(plan, swap_dir=tmp_path, hold_on_demand=hold) as ex:
        tracked[0] = lambda: ex.stats.tracked_bytes
        assert same(train(5, save_at=save_at(ours)), expected)
    assert ex.stats.save_fetches > 0 and (ex.stats.evictions > 0) == hold
    if name == "legacy format":  # its records are named by storage addresses: compared loaded
        mine, theirs = (torch.load(io.BytesIO(b[0]), weights_only=True) for b in (ours, plain))
        assert all(torch.equal(a, b) for a, b in zip(mine["params"], theirs["params"], strict=True))
        assert all(torch.equal(a, theirs["opt"]["state"][k][n]) for k, st in mine["opt"]["state"].items()
                   for n, a in st.items())
    else:
        assert ours == plain
    assert seen and (max(seen) == before[0]) == (name != "legacy format"), (before, str(seen))


def test_what_a_save_wrote_is_freed_when_the_script_drops_it(plan: Plan) -> None:
    """NOTE [ Streamed saves ] in runtime.saves: the save's note of the storages it pickled goes
    when it ends. torch's pickler classes are reference cycles, and held every storage saved
    until Python's next collection: a script saving its optimizer's state each step to a buffer
    (and loading it back) went to 1.97x its budget."""
    gc.disable()
    try:
        with offload(plan_of([], plan.op_names[0])):
            t = torch.ones(1000).double()
            storage = weakref.ref(t.untyped_storage())
            torch.save({"t": t}, io.BytesIO())
            del t
            assert storage() is None
    finally:
        gc.enable()


class ScaledParam(torch.nn.Parameter):
    """A parameter whose pickled state reads its data (a quantization scale, say)."""

    def __getstate__(self) -> dict[str, float]:
        return {"absmax": self.detach().abs().max().item()}


@pytest.mark.parametrize("elsewhere", [False, True])
@pytest.mark.parametrize("what", ["state read from the data", "one storage as two types"])
def test_a_save_runs_the_ops_and_checks_of_the_plain_one(plan: Plan, what: str, elsewhere: bool) -> None:
    """While a save pickles, only the ``detach`` that pickling a parameter runs leaves an out
    storage out (NOTE [ Streamed saves ]): a parameter subclass whose ``__getstate__`` reads its
    data brings it back (it read the freed storage: a segfault; on a thread of the script's own,
    where no op is seen, it is brought back and held), and the file holds the plain run's bytes.
    A weight saved beside a view of it as another type fails as in the plain run (torch checks
    only storages with memory: the file was written, the view read back as float32)."""
    kept: dict[str, torch.Tensor] = {}

    def save_at(files: list[bytes | str]) -> Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]:
        def hook(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            weight = model[0].weight
            if step == 0:  # sharing the weight's storage
                kept["other"] = (ScaledParam(weight.detach()) if what == "state read from the data"
                                 else weight.detach().view(torch.int32))
            if step == 3:
                files.append(weight.untyped_storage().nbytes() == 0)  # type: ignore[arg-type]
                f = io.BytesIO()

                def save() -> None:
                    try:
                        torch.save({"w": weight, "other": kept["other"]}, f)
                        files.append(f.getvalue())
                    except RuntimeError as exc:
                        files.append(str(exc))
                if elsewhere:
                    on_a_thread(save)
                else:
                    save()
        return hook

    plain: list[bytes | str] = []
    expected = train(5, save_at=save_at(plain))
    ours: list[bytes | str] = []
    with offload(plan):
        assert same(train(5, save_at=save_at(ours)), expected)
    assert ours[0] is True, "the weight was not out at the save"
    assert ours[1] == plain[1]
    assert isinstance(ours[1], str) == (what == "one storage as two types"), ours[1]


def test_a_save_at_every_step_is_in_the_plan() -> None:
    """The parameters saved at every step, as the profile saw: the pickling's ``detach`` ops are
    the plan's, and it is followed with them (NOTE [ Streamed saves ]: they bring nothing back,
    and once they left the plan at each save, so no iteration followed it and it was refused)."""
    def save_at(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        torch.save(list(model.parameters()), io.BytesIO())

    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        train(5, save_at=save_at)
    plan = hand_plan(tracer.profile({}))
    expected = train(6, save_at=save_at)
    with offload(plan) as ex:
        assert same(train(6, save_at=save_at), expected)
    assert ex.unfollowed == [] and ex.matched_iterations >= 4 and ex.stats.save_fetches > 0


def test_a_loaded_checkpoint_counts_the_bytes_it_holds(plan: Plan, tmp_path: Path) -> None:
    """torch.load rebuilds each tensor as an empty one given the file's storage (``set_``): the
    empty storage's id is not counted at the loaded one's size (before, the tracked bytes held
    every loaded tensor twice, for the rest of the run)."""
    model, opt, _ = mlp_and_data()
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    with offload(plan_of([], plan.op_names[0])) as ex:
        loaded = torch.load(tmp_path / "ckpt.pt")
        live = ex.ids.live().values()
        assert ex.stats.tracked_bytes == sum(s.nbytes() for s in live) > 0
        del loaded


def test_a_model_the_script_drops_is_freed(plan: Plan) -> None:
    """A model rebuilt (to resume from a checkpoint, say) or a copy made for an evaluation is
    freed when the script lets go of it, as without teraio (NOTE [ Roots ])."""
    with offload(plan_of([], plan.op_names[0])) as ex:
        model, opt, _ = mlp_and_data()
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        dropped = weakref.ref(model)
        del model, opt
        gc.collect()
        assert dropped() is None and ex.roots() == []


def moments_out(profiled: Profile, keep_copy: bool = False) -> Plan:
    """A plan that has Adam's first moments of 4 KiB or more out from their last use in a step to
    their first in the next (with ``keep_copy``, each freed against the copy its prefetch kept)."""
    names, acc = op_names(profiled), profiled.accesses_of()
    size = profiled.tensors.set_index("tensor_id")["size_bytes"]
    lerped = acc[acc.op_index.isin([k for k, name in enumerate(names) if name == "aten.lerp_.Scalar"])
                 & (acc.access == "write")]
    n, moves = len(names), []
    for tid in {int(t) for t in lerped.tensor_id if size[t] >= 4096}:
        uses = sorted(set(acc[acc.tensor_id == tid].op_index))
        out = move(tid, "offload", uses[-1] + 1, uses[-1] + 2, int(size[tid]), uses[-1], n + uses[0], wraps=True)
        back = move(tid, "prefetch", uses[0] - 1, uses[0], int(size[tid]), uses[-1], n + uses[0], wraps=True)
        moves += [dataclasses.replace(out, reuse_copy=keep_copy), dataclasses.replace(back, keep_copy=keep_copy)]
    assert len(moves) == 6
    return dataclasses.replace(hand_plan(profiled), migrations={0: moves})


def test_what_dies_on_another_thread_at_the_end_is_not_kept(profiled: Profile, tmp_path: Path) -> None:
    """A model and optimizer the script ends with as cyclic garbage (DDP's are), collected on
    another thread (the collector runs on whichever thread allocates, teraio's workers
    included), while the plan has Adam's moments out: their frees are applied at exit. A
    finished run failed there with "18 offloaded tensors could not be restored at exit" and
    left a teraio-kept-* directory for tensors nobody held."""
    plan = moments_out(profiled)

    def cycle(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model.cycle = [model, opt]  # type: ignore[assignment]

    expected = train(4)
    gc.disable()
    try:
        with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
            assert same(train(4, save_at=cycle), expected)
            assert len(ex.moved) == 3  # the moments, out across the boundary
            on_a_thread(gc.collect)
    finally:
        gc.enable()
    assert not ex.moved and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("how", "elsewhere"), [("tolist", False), ("repr", False), ("tolist", True),
                                                 ("repr", True), ("dlpack", True), ("numpy", True)])
def test_memory_read_outside_any_op_is_brought_back(plan: Plan, how: str, elsewhere: bool) -> None:
    """``.tolist()``, ``repr`` (printing) and a DLPack export read a tensor's memory with no op
    teraio sees: between forward and backward, while this plan has the first layer's weight out,
    it comes back first and the numbers are the plain run's (NOTE [ DLPack exports ]), and the
    plan goes on being followed. On a thread of the script's own (``elsewhere``), it is brought
    back and kept in memory for the read, the training thread's records not changed beside it
    (NOTE [ Reads on other threads ]); a DLPack export leaves it in memory for good."""
    def read(w: torch.Tensor) -> object:
        if how == "tolist":
            return sum(sum(w.tolist(), []))
        if how == "repr":
            return repr(w)
        if how == "numpy":  # on a thread its ``detach`` passes as an alias (NOTE [ Ops on other threads ])
            return float(w.detach().numpy().sum())
        return float(np.from_dlpack(w.detach()).sum())

    def reader(out: list[object]) -> Callable[[int, torch.nn.Module, torch.optim.Optimizer], None]:
        def hook(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            if step < 1:
                return
            if not elsewhere:
                out.append(read(model[0].weight))
                return
            on_a_thread(lambda: out.append(read(model[0].weight)))
        return hook

    expected: list[object] = []
    plain = train(5, save_at=reader(expected))
    got: list[object] = []
    with offload(plan) as ex:
        assert same(train(5, save_at=reader(got)), plain)
    assert got == expected and len(got) == 4
    if elsewhere:
        assert ex.stats.save_fetches > 0
    else:
        assert ex.stats.on_demand_fetches > 0 and ex.unfollowed == []


def test_plan_for_another_model_is_refused(plan: Plan) -> None:
    def other() -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 32)).sum().backward()
            opt.step()

    with pytest.raises(PlanMismatchError, match="made for another profile"), offload(plan):
        with pytest.warns(RuntimeWarning, match="iteration 0 left its plan"):
            other()


def test_a_plan_whose_tensors_are_named_otherwise_is_refused(profiled: Profile, plan: Plan) -> None:
    """NOTE [ Other sizes ]: a plan that names the parameters and optimizer state otherwise than
    the run (a script profiled with other arguments, which named them by module in one and by
    optimizer in the other) moves other tensors of the same sizes: it ran as followed at 1.85x
    its budget. Now a move of a tensor named otherwise is left out, and a plan where most are is
    refused."""
    names = profiled.tensors.set_index("tensor_id")["name"]
    named = [dataclasses.replace(m, name=names[m.tensor_id]) for m in plan.migrations[0]
             if m.tensor_id < PRODUCED_BASE]  # parameters and optimizer state
    assert len(named) > 10
    expected = train(4)
    with offload(dataclasses.replace(plan, migrations={0: named})) as ex:
        assert same(train(4), expected)
    assert ex.matched_iterations == 3
    renamed = [dataclasses.replace(m, name=f"x.{m.name}") for m in named]
    with pytest.raises(PlanMismatchError, match=r"tensor \d+ is .*, the plan's x\."):
        with offload(dataclasses.replace(plan, migrations={0: renamed})):
            train(4)


def test_an_iteration_that_leaves_the_plan_runs_on_demand_and_the_next_follows_it(plan: Plan) -> None:
    """An op the plan did not see in iteration 4 (an evaluation, a log line): iteration 4
    runs on demand from there, with one warning; iteration 5 follows the plan again."""
    expected = train(7, hook=extra_op_at(4))
    with pytest.warns(RuntimeWarning, match="iteration 4, op .*ran on demand"):
        with offload(plan) as ex:
            assert same(train(7, hook=extra_op_at(4)), expected)
    assert [u["iteration"] for u in ex.unfollowed] == [4]
    assert ex.stats.iteration_followed == [True, True, True, True, False, True, True]
    assert not ex.moved


def test_offload_entered_after_set_up_says_why_iteration_0_is_not_followed(plan: Plan) -> None:
    """The plan's iteration 0 starts with the script's set-up; entered after it, ``offload()``
    says so once and follows the steady plan from iteration 1."""
    expected = train(4)
    model, opt, gen = mlp_and_data()
    losses = []
    with pytest.warns(RuntimeWarning, match="iteration 0 left its plan at op 0: .*entered later"):
        with offload(plan) as ex:
            for _ in range(4):
                loss = model(torch.randn(64, 32, generator=gen)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    assert same((losses, [p.detach().clone() for p in model.parameters()]), expected)
    assert ex.first_left_at is not None and ex.matched_iterations == 3 and not ex.unfollowed


def test_what_iteration_0_hands_on_is_found_by_the_profiles_map(profiled: Profile) -> None:
    """The steady plan has the last batch out across the boundary; iteration 0 made it at
    another op. The profile's map finds it, is trusted only if iteration 0 followed its
    plan to the end, and a storage of another size is left alone, not a divergence."""
    assert profiled.first is not None
    carried = {int(k): v for k, v in profiled.first.meta["carried_into_next"]["0"].items()}
    size = profiled.tensors.set_index("tensor_id")["size_bytes"]
    x = next(k for k in carried if size.get(k) == 64 * 32 * 4)
    loss = next(k for k in carried if size.get(k) == 4)
    acc = profiled.accesses_of()
    last = int(acc[acc["tensor_id"] == x]["op_index"].max())
    base = hand_plan(profiled)
    assert base.first is not None
    n = len(op_names(profiled))
    out = move(x, "offload", last + 1, last + 2, 64 * 32 * 4, last, n + 1, wraps=True)
    assert out in dataclasses.replace(base, migrations={0: [out]}).out_at_boundary(0)
    expected_losses, expected_params = train(4)

    def run(mapping: dict[int, int], hook: Any = None) -> dict[int, int]:
        first = dataclasses.replace(base.first, carried_into_next={0: mapping})
        found: dict[int, int] = {}

        def at_step(step: int) -> None:
            if hook is not None:
                hook(step)
            if step == 1:  # iteration 1: the plan ids the boundary resolved
                found.update(ex.plan_ids)

        with offload(dataclasses.replace(base, migrations={0: [*base.migrations[0], out]}, first=first)) as ex:
            losses, params = train(4, hook=at_step)
        assert losses == expected_losses
        assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
        return found

    assert run({x: carried[x]}).get(x) == carried[x]
    assert x not in run({x: carried[loss]})  # 4 bytes, not the batch's 8192

    with pytest.warns(RuntimeWarning, match="iteration 0 left its plan"):
        assert x not in run({x: carried[x]}, extra_op_at(0))


def test_first_iteration_warning_when_iteration_0_may_not_fit_the_device() -> None:
    unplanned = plan_of([], [], summary={"peak_before_bytes": 3 << 30})
    assert first_iteration_warning(unplanned, 4 << 30) is None
    why = first_iteration_warning(unplanned, 2 << 30)
    assert why is not None and "no plan for iteration 0" in why and "3.00 GiB" in why and "2.00 GiB" in why
    planned = plan_of([], [], summary={"peak_before_bytes": 3 << 30}, first=plan_of([], [], budget=5 << 29))
    assert first_iteration_warning(planned, 3 << 30) is None
    why = first_iteration_warning(planned, 2 << 30)
    assert why is not None and "planned for 2.50 GiB" in why


def test_a_plan_without_host_memory_allocates_no_host_pool(plan: Plan, tmp_path: Path) -> None:
    no_host = dataclasses.replace(plan, parameters={**plan.parameters, "host_mem_bytes": 0})
    with offload(no_host, backend="posix", swap_dir=tmp_path) as ex:
        train(3)
        assert ex.stats.bytes_written["ssd"] > 0
        assert ex.backends["host"]._pool is None  # type: ignore[attr-defined]
    with offload(plan, backend="host") as ex:  # everything in host memory: a default pool
        train(3)
        assert ex.stats.bytes_written["ssd"] > 0 and ex.backends["host"]._pool is not None  # type: ignore[attr-defined]


def numpy_train(steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """``train`` fed ``torch.from_numpy`` batches, whose storages cannot be resized."""
    import numpy as np

    model, opt, _ = mlp_and_data()
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_planned_storage_that_cannot_be_freed_stays_resident_with_one_warning() -> None:
    """A plan that moves a numpy-backed batch (a version-1 profile did not know): the runtime
    checks before it frees, keeps the batch in memory, warns once naming it, and trains on."""
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        numpy_train(5)
    prof = tracer.profile({})
    fixed = prof.tensors[~prof.tensors["resizable"]]
    assert len(fixed) and (fixed["kind"] == "input").all()
    moves = hand_moves(dataclasses.replace(prof, tensors=prof.tensors.assign(resizable=True)), 4096)
    assert set(fixed["tensor_id"]) & {m.tensor_id for m in moves}, "the hand plan must move the batch"
    expected = numpy_train(6)
    with pytest.warns(RuntimeWarning, match=r"tensor \d+ \(\d[\d,]* bytes\) cannot be freed in place \(its memory "
                      "belongs to numpy") as caught:
        with offload(plan_of(moves, op_names(prof))) as ex:
            assert same(numpy_train(6), expected)
    assert sum("cannot be freed in place" in str(w.message) for w in caught) == 1
    assert ex.stats.not_resizable and ex.stats.bytes_written["ssd"] > 0 and not ex.unfollowed


def test_tensor_lists_passed_by_keyword_are_faulted_in(tmp_path: Path) -> None:
    """``out=[a, b]`` reaches the dispatch mode as a keyword argument holding a tensor list:
    its tensors are inputs like any other, recorded by the tracer and made resident before the
    op writes into them (written into freed storages, they crashed the process)."""
    def run(steps: int) -> list[float]:
        w = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.SGD([w], lr=0.01)
        bufs = [torch.zeros(4096)[:4], torch.zeros(4096)[:4]]
        losses = []
        for _ in range(steps):
            x = torch.arange(8.0) * w
            torch.split_with_sizes_copy(x.detach(), [4, 4], out=bufs)
            loss = (x.sum() + bufs[0].sum() * bufs[1].sum()) / 100
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        run(5)
    prof = tracer.profile({})
    k = int(prof.kernels_of().query("op_name == 'aten.split_with_sizes_copy.out'")["op_index"].iloc[0])
    acc = prof.accesses_of()
    written = [int(t) for t in acc[(acc["op_index"] == k) & (acc["access"] == "write")]["tensor_id"]]
    assert len(written) == 2
    # out from the op after their last read to the next iteration's split: every write faults in
    last = int(acc[acc["tensor_id"].isin(written)]["op_index"].max())
    n = len(op_names(prof))
    moves = [move(b, "offload", last + 1, last + 2, 16384, last, n + k, wraps=True) for b in written]
    expected = run(6)
    # a 1-byte budget: each allocating op waits for the writes in flight, so they are out by the split
    with offload(plan_of(moves, op_names(prof), budget=1, made=made_bytes(prof).tolist()), swap_dir=tmp_path) as ex:
        assert run(6) == expected
    assert ex.stats.bytes_written["ssd"] > 0 and ex.stats.on_demand_fetches >= 4


def ema_train(steps: int, seen: list[int] | None = None,
              write_last: bool = False) -> tuple[list[float], list[torch.Tensor]]:
    """``train`` with a running mean of the batch, written at each step's start (after its norm
    is taken, ``write_last``, or before) and read at its loss; ``seen`` gets the mean's bytes in
    memory as the model's second layer runs."""
    model, opt, gen = mlp_and_data()
    ema = torch.zeros(48, 32)
    if seen is not None:
        model[2].register_forward_hook(lambda *_: seen.append(ema.untyped_storage().nbytes()))
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        norm = ema.norm() if write_last else None
        ema.mul_(0.5).add_(x[:48])
        scale = torch.full((1024,), 1e-3)  # an op that makes room
        norm = ema.view(-1).norm() if norm is None else norm  # a view, then the op that reads it
        loss = model(x).square().mean() + (ema * x[:48]).mean() * norm * scale.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [*(p.detach().clone() for p in model.parameters()), ema.clone()]


@pytest.mark.parametrize("op", ["writes", "reads", "reads once out", "reads once out, then the plan has it in"])
def test_an_op_on_a_tensor_going_out_leaves_it_out(op: str, tmp_path: Path) -> None:
    """NOTE [ Ops on a tensor going out ]: an op the plan has after a tensor's last use uses it
    (as when a schedule orders ops differently from the profile): as its write begins, the op
    writing or reading it, or once it is out (the op before made room, so the write is done), a
    view of it first. It goes out again after the op that reads it, once, out where the plan has
    it out (and stays in where the plan's prefetch of it starts at the next op), and all is exact."""
    write_last = op == "writes"
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        ema_train(5, write_last=write_last)
    prof = tracer.profile({})
    names, acc = op_names(prof), prof.accesses_of()
    ema = int(acc[acc.op_index == names.index("aten.linalg_vector_norm.default")].tensor_id.iloc[0])
    uses = acc[acc.tensor_id == ema].drop_duplicates("op_index").sort_values("op_index")
    gap = int(uses.op_index.diff().fillna(0).to_numpy().argmax())  # the forward pass, where it is idle
    start, read_back = int(uses.op_index.iloc[gap - 1]), int(uses.op_index.iloc[gap])
    assert names[start] == ("aten.add_.Tensor" if write_last else "aten.linalg_vector_norm.default")
    # the plan's offload starts at this op: the mean's last use before the forward, or the op that
    # makes room before its view
    once_out = op.startswith("reads once out")
    at = start - 2 if once_out else start
    assert not once_out or names[at:start + 1] == ["aten.full.default", "aten.view.default",
                                                   "aten.linalg_vector_norm.default"]
    prefetch_at = start + 1 if op.endswith("has it in") else read_back - 1
    size = 48 * 32 * 4
    moves = [move(ema, "offload", at, at + 1, size, start, read_back),
             move(ema, "prefetch", prefetch_at, prefetch_at + 1, size, start, read_back)]
    assert prof.first is not None  # iteration 0's plan moves nothing, and hands the mean on
    carried = {int(k): v for k, v in prof.first.meta["carried_into_next"]["0"].items()}
    first = plan_of([], op_names(prof.first), carried=carried, made=made_bytes(prof.first).tolist())
    plan = plan_of(moves, names, budget=1, first=first, made=made_bytes(prof).tolist())

    expected = ema_train(6, write_last=write_last)
    seen: list[int] = []
    with offload(plan, swap_dir=tmp_path) as ex:
        assert same(ema_train(6, seen, write_last), expected)
    assert ex.matched_iterations >= 4 and not ex.unfollowed
    fetches = ex.stats.iteration_on_demand_fetches  # in the iterations that ended
    if op.endswith("has it in"):  # fetched on demand for the view, then kept in: not sent out, not read again
        assert seen == [size] * 6 and fetches == [0] + [1] * 5 and ex.stats.reused_offloads == 0, (seen, fetches)
        return
    assert seen[0] == size and seen[1:] == [0] * 5, seen  # out in every iteration the plan has it out
    if once_out:  # fetched on demand for the view, freed against its copy after the read
        assert fetches == [0] + [1] * 5 and ex.stats.reused_offloads == 5, fetches


def twin_train(steps: int, swap_from: int | None = None,
               seen: list[int] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """A running mean read in the middle of each step, and a twin of its size the step's last op
    writes: the mean itself from step ``swap_from`` on. ``seen``: the mean's bytes in memory as
    the model's last layer runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    gen = torch.Generator().manual_seed(0)
    ema, twin = torch.zeros(48, 32), torch.zeros(48, 32)
    if seen is not None:
        model[2].register_forward_hook(lambda *_: seen.append(ema.untyped_storage().nbytes()))
    losses = []
    for step in range(steps):
        x = torch.randn(64, 32, generator=gen)
        scale = torch.full((1024,), 1e-3)  # an op that makes room
        out = model(x).square().mean()
        ema.mul_(0.5).add_(x[:48])
        loss = out * (1 + ema.norm() * scale.mean())
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1e-3 * p.grad)
                p.grad = None
        losses.append(loss.item())
        (ema if swap_from is not None and step >= swap_from else twin).add_(0.25)
        mark_iteration()
    return losses, [*(p.detach().clone() for p in model.parameters()), ema, twin]


def test_a_tensor_the_last_op_uses_where_the_plan_has_it_out_goes_out_at_the_boundary(tmp_path: Path) -> None:
    """NOTE [ Ops on a tensor going out ]: the plan has the mean out from its norm to the next
    step's use, and the iteration's last op writes it (from step 2): no later op sends it out
    again, so the boundary does (it stayed in for the next forward pass)."""
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        twin_train(5)
    prof = tracer.profile({})
    names, acc = op_names(prof), prof.accesses_of()
    ema = int(acc[acc.op_index == names.index("aten.linalg_vector_norm.default")].tensor_id.iloc[0])
    uses = sorted(set(acc[acc.tensor_id == ema].op_index))
    n, size = len(names), 48 * 32 * 4
    moves = [move(ema, "offload", uses[-1] + 1, uses[-1] + 2, size, uses[-1], n + uses[0], wraps=True),
             move(ema, "prefetch", uses[0] - 1, uses[0], size, uses[-1], n + uses[0], wraps=True)]
    assert prof.first is not None
    carried = {int(k): v for k, v in prof.first.meta["carried_into_next"]["0"].items()}
    first = plan_of([], op_names(prof.first), carried=carried, made=made_bytes(prof.first).tolist())
    plan = plan_of(moves, names, budget=1, first=first, made=made_bytes(prof).tolist())

    expected = twin_train(7, swap_from=2)
    seen: list[int] = []
    with offload(plan, swap_dir=tmp_path) as ex:
        assert same(twin_train(7, swap_from=2, seen=seen), expected)
    assert ex.matched_iterations == 6 and not ex.unfollowed
    assert seen == [size] + [0] * 6, seen


def fsdp_train(steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model, each layer and the whole sharded with FSDP2 (one rank)."""
    from torch.distributed.fsdp import fully_shard

    model, _, gen = mlp_and_data()
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(64, 32, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.to_local().detach().clone() for p in model.parameters()]


def test_fsdp2s_pointer_check_of_a_sharded_parameter_out_keeps_iteration_0_on_its_plan(tmp_path: Path) -> None:
    """NOTE [ Pointer checks ] in torch_patch.opstream: FSDP2's lazy initialisation compares the
    sharded parameters' pointers at the first forward, where iteration 0's plan has them out;
    each comes back for the check alone, and the iteration follows its plan (it ran an op its
    profile does not have, and went on on demand: an FSDP2 job at its smallest budget reached
    2.1-2.8x the budget in iteration 0)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tracer = Tracer(warmup=1, iters=1)
        with pytest.raises(ProfileComplete), tracer:
            fsdp_train(5)
        plan = hand_plan(tracer.profile({}))
        expected = fsdp_train(4)
        with offload(plan, swap_dir=tmp_path) as ex:
            assert same(fsdp_train(4), expected)
        assert ex.first_left_at is None and ex.matched_iterations == 3
        assert ex.stats.reused_offloads > 0
    finally:
        dist.destroy_process_group()


def evicting(plan: Plan) -> Plan:
    """``plan`` at a 128 KiB budget with a named move, so that `--hold-on-demand` sends out storages
    made in the iteration too (NOTE [ On demand within the budget ])."""
    named = [dataclasses.replace(m, name="w") if k == 0 else m for k, m in enumerate(plan.migrations[0])]
    return dataclasses.replace(plan, migrations={0: named}, parameters={**plan.parameters, "gpu_mem_bytes": 128 << 10})


def test_storages_too_small_to_matter_are_never_sent_out_on_demand(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ On demand within the budget ]: DDP's Reducer fills a small index tensor and reads it
    through its pointer between ops; sent out on demand, a rank failed with "received invalid
    bucket_size". Storages under a thousandth of the budget stay, and under 8 KiB whatever the
    budget (a random state: NOTE [ Random states ] in profiles.views; one sent out, set_state
    failed); larger ones made in the iteration go out as before."""
    held = evicting(plan)
    sizes: dict[str, int] = {}

    def made_between_ops(step: int) -> None:
        if step == 2:
            extra_op_at(2)(step)  # the iteration leaves its plan: on demand from here
            small, large = torch.arange(5), torch.ones(4096)  # 40 bytes, and 16 KiB
            state = torch.Generator().get_state().clone()  # 5,056 bytes
            torch.ones(3).add_(1)  # out with what is not needed before this op
            sizes.update(small=small.untyped_storage().nbytes(), large=large.untyped_storage().nbytes(),
                         state=state.untyped_storage().nbytes())

    expected = train(4)
    with offload(held, swap_dir=tmp_path, hold_on_demand=True) as ex:
        assert same(train(4, hook=made_between_ops), expected)
    assert ex.stats.evictions > 0 and sizes == {"small": 40, "large": 0, "state": 5056}, sizes


def test_a_functional_collectives_result_is_not_sent_out_on_demand(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ On demand within the budget ]: a functional collective's result is written by the
    backend until an op waits for it (NOTE [ Busy in a collective ] in planner.problem), so an
    iteration run on demand keeps it in, as it keeps a collective's inputs: the least recently
    used, it went out first (its bytes taken before the backend wrote them)."""
    import torch.distributed as dist

    held = evicting(plan)
    sizes: dict[str, int] = {}

    def reduced_between_ops(step: int) -> None:
        if step == 2:
            extra_op_at(2)(step)  # the iteration leaves its plan: on demand from here
            c10d = torch.ops._c10d_functional  # funcol's own calls wrap the result at once: busy
            reduced = c10d.all_reduce(torch.ones(4096), "sum", dist.group.WORLD.group_name)
            large = torch.ones(4096)
            torch.ones(3).add_(1)  # out with what is not needed before this op
            sizes.update(reduced=reduced.untyped_storage().nbytes(), large=large.untyped_storage().nbytes())
            assert c10d.wait_tensor(reduced).sum().item() == 4096

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        expected = train(4)
        with offload(held, swap_dir=tmp_path, hold_on_demand=True) as ex:
            assert same(train(4, hook=reduced_between_ops), expected)
    finally:
        dist.destroy_process_group()
    assert ex.stats.evictions > 0 and sizes == {"reduced": 16384, "large": 0}, sizes

def sent_out(ex: Any, t: torch.Tensor) -> int:
    """Send ``t``'s storage out by hand and wait until it is; its id."""
    storage = t.untyped_storage()
    tid = ex.ids.get(storage)
    assert tid is not None
    ex._offload(tid, storage, "ssd", urgent=True)
    ex._wait(ex.moved[tid], "test")
    assert storage.nbytes() == 0
    return int(tid)


def test_a_gradient_kept_across_the_boundary_comes_back_once(tmp_path: Path) -> None:
    """NOTE [ Gradients left out ]: a script that keeps its gradients (``zero_grad(set_to_none=False)``)
    gets those left out at a boundary back when an op first needs them, each once: the plan has them
    in, so they are not sent out again after that op (they were, and read back again, 9 reads on
    demand for 6 gradients: a review's case)."""
    def loop(ex: Any = None, steps: int = 5) -> tuple[list[float], list[torch.Tensor]]:
        model, opt, gen = mlp_and_data()
        step_now, losses = [0], []

        def grads_out(*_: Any) -> None:  # as hold-on-demand sends them out, before the boundary's hook
            if ex is not None and step_now[0] == 2:
                for p in model.parameters():
                    sent_out(ex, p.grad)

        opt.register_step_post_hook(grads_out)
        for step in range(steps):
            step_now[0] = step
            opt.zero_grad(set_to_none=False)
            loss = model(torch.randn(64, 32, generator=gen)).square().mean()
            if step == 2 and ex is not None:
                torch.ones(3).add_(1)  # the iteration leaves its plan: on demand from here
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        loop()
    plan = hand_plan(tracer.profile({}))
    expected = loop()
    with offload(plan, swap_dir=tmp_path) as ex:
        assert same(loop(ex), expected)
    assert ex.stats.iteration_followed[3] and ex.stats.iteration_on_demand_fetches[3] == 6


@pytest.mark.parametrize("accumulate", [False, True])
def test_gradients_out_at_a_boundary_stay_out(plan: Plan, tmp_path: Path, accumulate: bool) -> None:
    """NOTE [ Gradients left out ]: after an iteration run on demand, the boundary (as the
    optimizer's step ends) brings back what is out and the plan has in, but not the gradients: the
    script drops them (``zero_grad()`` after a ``loss.item()``, the next iteration's first op), and
    their reads were in vain, holding their bytes after it did (a DDP job went 1.13x over its budget
    so). A script that accumulates into them reads them back in its backward pass, bit for bit."""
    def loop(ex: Any = None) -> tuple[list[float], list[torch.Tensor]]:
        model, opt, gen = mlp_and_data()
        step_now, losses = [0], []

        def grads_out(*_: Any) -> None:  # as hold-on-demand sends them out, before the boundary's hook
            if ex is not None and step_now[0] == 2:
                out.extend(sent_out(ex, p.grad) for p in model.parameters() if p.grad is not None)

        opt.register_step_post_hook(grads_out)
        for step in range(4):
            step_now[0] = step
            loss = model(torch.randn(64, 32, generator=gen)).square().mean()
            if step == 2:
                torch.ones(3).add_(1)  # the iteration leaves its plan: on demand from here
            if not accumulate or step != 3:
                opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())  # after the boundary: the next iteration's first op
        return losses, [p.detach().clone() for p in model.parameters()]

    expected = loop()
    out: list[int] = []
    reads: list[tuple[int, int, int]] = []
    with offload(plan, swap_dir=tmp_path) as ex:
        submit = ex.engine.submit

        def recording(job: Any) -> Any:
            if job.direction == "read":
                reads.append((ex.iteration, ex.op_index, job.tensor_id))
            return submit(job)

        ex.engine.submit = recording
        assert same(loop(ex), expected)
    grads = {tid for tid, (_, kind) in ex.persistent.items() if kind == "grad"}
    read_in_3 = {tid for iteration, _, tid in reads if iteration == 3 and tid in grads}
    assert len(out) == len(grads) == 6
    if accumulate:  # iteration 3 runs other ops (it adds to the gradients): on demand, faulted in
        assert read_in_3 == grads
    else:  # 1 and 3 followed the plan, 2 ran on demand
        assert not read_in_3 and ex.matched_iterations == 2, reads


def test_a_left_over_teraio_cannot_move_is_said_as_left_over(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Left over ]: a storage an iteration run on demand leaves alive that cannot be freed in
    place (a DataLoader worker's batch, in shared memory) stays in memory, said as left alive by that
    iteration, not as a move of the plan's (a sweep of users' scripts read it as the plan failing on
    their data). One that can move still goes out. One iteration 0 made (a data set the workers
    read, made before the loop) is not said: the profile saw it stay in memory."""
    import warnings

    kept: list[torch.Tensor] = []
    early: list[str] = []  # said before step 2

    def left_over(step: int) -> None:
        if step == 0:
            kept.append(torch.ones(1 << 15).share_memory_())
            torch.add(kept[0], 1)
        if step == 2:
            early.extend(str(w.message) for w in caught if "cannot be freed in place" in str(w.message))
            extra_op_at(2)(step)  # the iteration leaves its plan: on demand from here
            kept.extend([torch.ones(1 << 15).share_memory_(), torch.ones(1 << 15)])  # 128 KiB each
            torch.add(kept[1], kept[2])  # read by an op: made outside any op, as a worker's batch is

    expected = train(4)
    with warnings.catch_warnings(record=True) as caught, offload(plan, swap_dir=tmp_path) as ex:
        warnings.simplefilter("always")
        assert same(train(4, hook=left_over), expected)
        shared, plain = (ex.ids.get(t.untyped_storage()) for t in kept[1:])
        assert kept[1].untyped_storage().nbytes() == 1 << 17 and plain in ex.moved  # out until used
    said = [str(w.message) for w in caught if "cannot be freed in place" in str(w.message)]
    assert not early, early
    assert len(said) == 1 and "(it is in shared memory" in said[0] and "left it alive, and the plan does not move it" \
        in said[0], said
    assert shared is not None and shared not in ex.moved and ex.stats.not_resizable


def test_a_random_state_out_is_brought_back_to_be_restored(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ DLPack exports ] in torch_patch.opstream: ``torch.set_rng_state`` reads its tensor
    with no op (a resumed script's restore of a loaded state failed with "data is not allocated
    yet" where the plan had that state out)."""
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        state = torch.get_rng_state().clone()
        expected = torch.rand(3)
        sent_out(ex, state)
        torch.set_rng_state(new_state=state)  # by keyword too
        assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("op", ["reads", "writes"])
def test_ops_on_a_thread_of_the_scripts_own_find_what_the_plan_has_out(profiled: Profile, plan: Plan, op: str,
                                                                        tmp_path: Path) -> None:
    """NOTE [ Ops on other threads ] in torch_patch.opstream: a thread of the script's own reads the
    weights (norms for a log) or writes the optimizer's state while the plan has them out: each
    op brings back what it uses, and a write drops the kept copy. Unseen, the reads read freed
    memory (a segfault) and a write would be lost to a stale copy."""
    norms: list[float] = []

    def norms_or_moments(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        def work() -> None:
            with torch.no_grad():
                for p in model.parameters():
                    if op == "reads":
                        norms.append(p.norm().item())
                    elif step > 0:
                        opt.state[p]["exp_avg"].mul_(0.5)

        on_a_thread(work)

    expected = train(5, save_at=norms_or_moments)
    plain, norms[:] = norms[:], []
    with offload(plan if op == "reads" else moments_out(profiled, keep_copy=True), swap_dir=tmp_path) as ex:
        assert same(train(5, save_at=norms_or_moments), expected)
    assert norms == plain and ex.stats.save_fetches > 0


def test_a_slice_on_a_thread_of_the_scripts_own_of_a_tensor_out_is_brought_back(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Ops on other threads ]: a view op that checks its storage's size (slice, select,
    transpose) brings back what it views; passed as an alias that reads nothing, it failed with
    "setStorage: ... out of bounds" on the 0 bytes of a storage out."""
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        t = torch.arange(1024.0)
        sent_out(ex, t)
        got: list[float] = []
        on_a_thread(lambda: got.append(t[10:20].t().sum().item()))
        assert got == [145.0]


def test_a_write_on_a_thread_of_the_scripts_own_drops_the_kept_copy(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Ops on other threads ]: a tensor back in memory with its copy kept (NOTE [ Copies
    kept ]) and written on another thread is freed against no stale copy: the copy goes."""
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        t = torch.ones(1024)
        tid = sent_out(ex, t)
        ex.moved[tid].keep_for_reuse = True
        assert t.sum().item() == 1024 and tid in ex.copies  # read back, its copy kept
        on_a_thread(lambda: t.add_(1))
        assert tid not in ex.copies and t.sum().item() == 2048


@pytest.mark.parametrize("what", ["model.state_dict()", "the model"])
def test_a_save_on_a_thread_of_the_scripts_own_brings_nothing_back(plan: Plan, what: str, tmp_path: Path) -> None:
    """NOTE [ Ops on other threads ] and NOTE [ Streamed saves ]: a checkpoint written on a thread
    started during the run (state_dict's detach and the pickling's are aliases, which read
    nothing) leaves the weight the plan has out where it is, its record written from its copy (the
    thread's mode brought every parameter back, 1 MiB here)."""
    model = torch.nn.Linear(256, 1024)
    expected = model.weight.detach().clone()
    buf = io.BytesIO()
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        model(torch.randn(2, 256))
        sent_out(ex, model.weight)
        storage = model.weight.untyped_storage()
        obj = model.state_dict if what == "model.state_dict()" else (lambda: model)
        on_a_thread(lambda: torch.save(obj(), buf))
        assert storage.nbytes() == 0
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert torch.equal(saved["weight"] if what == "model.state_dict()" else saved.weight, expected)


class GatedSave:
    """``torch.save(obj)`` into a buffer on a thread started now (a script's own), its first write of
    ``size`` bytes or more held until ``release``: ``reached`` is set there. The whole object is
    pickled before anything is written, so with ``size`` 0 it waits pickled, no record written."""

    def __init__(self, obj: Any, size: int = 0) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        self.failed: list[BaseException] = []
        gate = self

        class Gated(io.BytesIO):
            def write(self, data: Any) -> int:
                if len(data) >= size:
                    gate.reached.set()
                    gate._go.wait(60)
                return super().write(data)

        self.buffer = Gated()
        self._thread = threading.Thread(target=self._save, args=(obj,))
        self._thread.start()

    def _save(self, obj: Any) -> None:
        try:
            torch.save(obj, self.buffer)
        except BaseException as exc:  # noqa: BLE001 - failed here, asserted on the test's thread
            self.failed.append(exc)

    def release(self) -> None:
        self._go.set()
        self._thread.join()

    def loaded(self) -> Any:
        return torch.load(io.BytesIO(self.buffer.getvalue()))


def test_a_save_on_a_thread_of_the_scripts_own_leaves_what_it_pickled_free_to_go_out(
        plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Streamed saves ] in runtime.saves: a background save that has pickled the weight in
    memory, and not yet written it, leaves it free to go out as the plan sends it; its record is
    then written from the copy. Held from its pickling to the save's end, it stayed in memory:
    background saves under load took the iteration they overlapped to 1.59x its budget."""
    model = torch.nn.Linear(256, 1024)
    expected = model.weight.detach().clone()
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        model(torch.randn(2, 256))
        saving = GatedSave(model.state_dict())
        try:
            assert saving.reached.wait(60)
            sent_out(ex, model.weight)
            assert model.weight.untyped_storage().nbytes() == 0
        finally:
            saving.release()
    assert not saving.failed, saving.failed
    assert torch.equal(saving.loaded()["weight"], expected)


def test_a_save_on_a_thread_of_the_scripts_own_holds_nothing_in_memory_while_it_writes_a_record(
        plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Streamed saves ] in runtime.saves: a background save writes a storage in memory from
    a copy of its bytes, so the plan sends it out while its record is written (held for the
    write, an Adam moment kept an iteration at 1.34x its budget under load), and the file holds
    the bytes it had."""
    model = torch.nn.Linear(256, 1024)
    expected = model.weight.detach().clone()
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
        saving = GatedSave(model.state_dict(), size=model.weight.nbytes)  # held in the weight's record
        try:
            assert saving.reached.wait(60)
            sent_out(ex, model.weight)
        finally:
            saving.release()
    assert torch.equal(saving.loaded()["weight"], expected)


def test_a_storage_resized_between_its_pickling_and_its_record_fails_the_save(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Streamed saves ] in runtime.saves: a background save whose storage another library
    resizes after it was pickled would write a file that does not load; the save fails, saying so."""
    weight = torch.ones(1024)
    with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix"):
        weight.add_(1)  # known to teraio
        saving = GatedSave({"w": weight})
        try:
            assert saving.reached.wait(60)
            weight.untyped_storage().resize_(8192)  # no op teraio sees
        finally:
            saving.release()
    failed = saving.failed
    assert len(failed) == 1 and "pickled at 4096 bytes; its file would not load" in str(failed[0]), failed


def test_what_the_plan_sends_out_while_another_thread_reads_it_goes_out_after(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Reads on other threads ]: an offload the plan starts while a read on another thread
    holds the storage in memory waits for the read, and goes before the training thread's next op."""
    model = torch.nn.Linear(256, 1024)
    reading, go = threading.Event(), threading.Event()

    def ops() -> None:
        model(torch.randn(2, 256, generator=torch.Generator().manual_seed(0)))

    with OpNames() as names:
        ops()
        torch.ones(3).add_(1)
    with offload(plan_of([], names.ops), swap_dir=tmp_path, backend="posix") as ex:
        ops()
        torch.ones(3).add_(1)
        mark_iteration()  # iteration 0 runs on demand: the plan is followed from iteration 1
        ops()
        storage = model.weight.untyped_storage()
        tid = ex.ids.get(storage)
        assert tid is not None

        def read() -> None:  # as a torch.save's copy or an op there holds it
            with ex.kept_in([storage]):
                reading.set()
                go.wait(60)

        holder = threading.Thread(target=read)
        holder.start()
        try:
            assert reading.wait(60)
            with pytest.warns(RuntimeWarning, match="read on another thread"):
                ex._offload(tid, storage, "ssd", urgent=True)
            assert tid not in ex.moved and storage.nbytes() == model.weight.nbytes
        finally:
            go.set()
            holder.join()
        torch.ones(3).add_(1)  # the training thread's next op
        assert ex.schedule is not None, (ex.left_at, names.ops)
        ex._wait(ex.moved[tid], "test")
        assert storage.nbytes() == 0


@pytest.mark.parametrize("bound", [False, True])
def test_safetensors_save_of_a_tensor_out_writes_its_bytes(plan: Plan, tmp_path: Path, bound: bool) -> None:
    """NOTE [ Pointer checks ] in torch_patch.opstream: safetensors hands its writer a pointer to
    every CPU tensor at once; one the plan has out is back and held for the call, and the file
    is the plain one (the save failed: "invalid shape, data type, or offset"). Also through a
    name a module bound before teraio started, as peft's and transformers' ``from
    safetensors.torch import save_file as safe_save_file`` (``teraio.offload()`` entered after
    importing them failed a LoRA adapter's ``save_pretrained`` so); restored after."""
    import types

    import safetensors.torch

    module = types.ModuleType("bound_before_teraio")
    module.safe_save = safetensors.torch.save  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    save = (lambda t: module.safe_save(t)) if bound else (lambda t: safetensors.torch.save(t))
    try:
        model = torch.nn.Linear(256, 1024)
        expected = safetensors.torch.save(dict(model.named_parameters()))
        with offload(plan_of([], plan.op_names[0]), swap_dir=tmp_path, backend="posix") as ex:
            model(torch.randn(2, 256))
            sent_out(ex, model.weight)  # (state_dict()'s detach would bring it back: passed as it is)
            assert save(dict(model.named_parameters())) == expected
        assert module.safe_save is safetensors.torch.save  # type: ignore[attr-defined]
    finally:
        del sys.modules[module.__name__]


def test_a_read_on_its_way_back_at_the_boundary_goes_out_again(profiled: Profile, tmp_path: Path) -> None:
    """NOTE [ Reads before an offload ]: the plan reads Adam's moments back as the backward pass
    ends, and step 2 skips the optimizer's step (a loss scaler's skip, here a script's own with
    ``mark_iteration``), so the iteration ends with their reads in flight or not yet seen done,
    where the plan has them out. They go out again at the boundary: in the next forward pass
    they are out. Counted as out, they stayed in memory the whole iteration."""
    plan = moments_out(profiled)
    last_backward = max(k for k, phase in enumerate(profiled.kernels_of()["phase"]) if phase != "optimizer")
    moves = [dataclasses.replace(m, trigger_op=last_backward) if m.action == "prefetch" else m
             for m in plan.migrations[0]]
    plan = dataclasses.replace(plan, migrations={0: moves})
    out_in_forward: list[int] = []

    def run(steps: int) -> tuple[list[float], list[torch.Tensor]]:
        model, opt, gen = mlp_and_data()
        losses = []
        for step in range(steps):
            loss = model(torch.randn(64, 32, generator=gen)).square().mean()
            if step == 3:
                moments = [s["exp_avg"] for s in opt.state.values() if s["exp_avg"].numel() >= 1024]
                out_in_forward.extend(m.untyped_storage().nbytes() == 0 for m in moments)
            opt.zero_grad()
            loss.backward()
            if step != 2:
                opt.step()
            if step >= 2:  # from the first call on, only these end iterations
                mark_iteration()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    expected = run(5)
    out_in_forward.clear()
    with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
        assert same(run(5), expected)
    assert ex.stats.iteration_followed[3]
    assert out_in_forward == [True, True, True]


def test_what_a_thread_of_the_scripts_own_brought_back_goes_out_again(profiled: Profile, tmp_path: Path) -> None:
    """NOTE [ Reads on other threads ]: a logger thread reads an Adam moment in the forward pass,
    where the plan has it out; once the read is done it goes out again before the training's
    next op (freed against the copy the read kept). It stayed in memory until the plan's next
    offload of it."""
    plan = moments_out(profiled)
    out_after: list[bool] = []
    norms: list[float] = []

    def run(steps: int) -> tuple[list[float], list[torch.Tensor]]:
        model, opt, gen = mlp_and_data()
        losses = []
        for step in range(steps):
            loss = model(torch.randn(64, 32, generator=gen)).square().mean()
            if step == 2:
                moment = opt.state[model[2].weight]["exp_avg"]
                on_a_thread(lambda m=moment: norms.append(m.norm().item()))
                loss.register_hook(lambda g, m=moment: out_after.append(m.untyped_storage().nbytes() == 0))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    expected = run(4)
    out_after.clear()
    with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
        assert same(run(4), expected)
    assert ex.stats.iteration_followed == [True] * 4
    assert norms[1] == norms[0] and out_after == [True]


def collective_train(steps: int, delay: float | list[float], read: bool = False, hold: bool = False,
                     pause: float = 0.0) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model, with a 1 MiB buffer all-reduced each step (a group of one) whose last
    reference a thread of the script's own drops ``delay`` seconds later (0: before the next
    op; a list: each step's), as gloo's worker drops a collective's buffer once the other ranks
    reach it; with ``read``, the thread sums the buffer first (an op, on its thread); with
    ``hold``, the training thread keeps it to the step's end instead; each step ends with
    ``pause`` seconds of other work."""
    import time

    import torch.distributed as dist

    model, opt, gen = mlp_and_data()
    losses, threads = [], []
    for step in range(steps):
        late = delay[step] if isinstance(delay, list) else delay
        loss = model(torch.randn(64, 32, generator=gen)).square().mean()
        buf = torch.full((1 << 18,), loss.item())
        dist.all_reduce(buf, async_op=True).wait()
        threads.append(threading.Thread(target=lambda b=buf, d=late: (time.sleep(d), read and b.sum())))
        threads[-1].start()
        kept = buf if hold else None
        del buf
        if not late:
            threads[-1].join()
        scratch = torch.ones(1 << 18).add_(1)  # allocates as the buffer's free waits for the thread
        opt.zero_grad()
        (loss + scratch[0] * 0).backward()
        opt.step()
        del kept
        time.sleep(pause)
        losses.append(loss.item())
    for t in threads:
        t.join()
    return losses, [p.detach().clone() for p in model.parameters()]


def collective_plan_at_its_peak(tmp_path: Path,
                                steps: int = 4) -> tuple[Plan, tuple[list[float], list[torch.Tensor]], Any]:
    """A plan of ``collective_train`` (in a process group begun) with the budget of the peak it
    reaches where each buffer is freed at once; the plain results of ``steps``, and that run's
    executor."""
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        collective_train(5, delay=0)
    plan = hand_plan(tracer.profile({}))
    expected = collective_train(steps, delay=0)
    with offload(plan, swap_dir=tmp_path) as at_once:
        assert same(collective_train(steps, delay=0), expected)
    budget = max(at_once.stats.iteration_peak_bytes[1:])
    return dataclasses.replace(plan, parameters={**plan.parameters, "gpu_mem_bytes": budget}), expected, at_once


@pytest.mark.parametrize("read", [False, True])
def test_a_collectives_buffer_freed_late_on_another_thread_is_waited_for(read: bool, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: the free of a buffer a collective used comes
    from another thread, later under teraio than in the profile (the other ranks are behind): the
    next op that allocates waits for it, not over the budget (the peak the plan reaches where the
    thread frees it at once). Without the wait the iterations went over it; with
    the thread reading the buffer first, a wait that held the executor's lock blocked that read
    until it gave up, and the iteration went over all the same."""
    import torch.distributed as dist

    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 10.0)  # 0.3 s late, whatever the load
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan, expected, at_once = collective_plan_at_its_peak(tmp_path)
        budget = plan.budget_bytes
        with offload(plan, swap_dir=tmp_path) as late:
            assert same(collective_train(4, delay=0.3, read=read), expected)
    finally:
        dist.destroy_process_group()
    assert late.matched_iterations == at_once.matched_iterations == 3
    # (iteration 1 after iteration 0's own plan, of a budget of one byte: not measured against it)
    assert max(late.stats.iteration_peak_bytes[2:]) <= budget, (late.stats.iteration_peak_bytes, budget)
    assert late.stats.steady_stalls["collective"][1] > 0.2 * 3


def run_at_its_peak(plan: Plan, tmp_path: Path, evaluate: Callable[..., None]) -> tuple[Any, int]:
    """``train(6, save_at=evaluate)`` under ``plan`` at the budget of ``train``'s own peak under
    it, bit-identical to ``train(6)``; its executor, and the budget."""
    expected = train(6)
    with offload(plan, swap_dir=tmp_path) as plain:
        assert same(train(6), expected)
    budget = max(plain.stats.iteration_peak_bytes[1:])
    plan = dataclasses.replace(plan, parameters={**plan.parameters, "gpu_mem_bytes": budget})
    with offload(plan, swap_dir=tmp_path) as ex:
        assert same(train(6, save_at=evaluate), expected)
    return ex, budget


def test_an_evaluations_graph_the_script_keeps_goes_out_though_its_ops_read_it(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Left over ]: an evaluation without ``no_grad`` whose output the script keeps keeps
    the activations its graph saved, which its later ops read as it ran (a pipeline stage keeps
    ``schedule.eval()``'s so). The boundary after it sends them out with the plan's: they were
    left in, as read since made, and every later iteration went over the budget by them (the
    last stage of a pipeline at 2.81x)."""
    kept: list[torch.Tensor] = []

    def evaluate(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 2:
            kept.append(model(torch.randn(256, 32, generator=torch.Generator().manual_seed(7))))

    ex, budget = run_at_its_peak(plan, tmp_path, evaluate)
    assert ex.stats.iteration_followed[1:] == [True, False, True, True, True]
    assert kept[0].grad_fn is not None
    # (the evaluation's input and output, under 64 KiB, stay in)
    assert max(ex.stats.iteration_peak_bytes[3:]) <= budget * 1.05, (ex.stats.iteration_peak_bytes, budget)


def buffer_train(steps: int, renew_at: int | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model fed through a 1 MiB buffer made in the first step and kept across
    steps (a pipeline stage's receive buffer); at step ``renew_at`` the script makes it anew, as a
    stage does for ``schedule.eval()``, and keeps the new one."""
    model, opt, gen = mlp_and_data()
    losses, buf = [], torch.empty(0)
    for step in range(steps):
        if step in (0, renew_at):
            buf = torch.empty(512, 512)
        x = buf[:64, :32].copy_(torch.randn(64, 32, generator=gen)).clone()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        buf[0].sum()  # read again before the step: idle through forward and backward
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_storage_made_anew_takes_the_part_of_the_one_it_replaced(tmp_path: Path) -> None:
    """NOTE [ Made anew ]: a buffer the script keeps across steps, made anew at step 3 (an
    iteration run on demand) and kept: the plan's moves of the old one's long id found nothing,
    and the new one stayed in memory (in a pipeline's stages, 1.03-1.09x over the budget). Found
    where the old one's period began, it takes its part: the iterations after write it out, as
    the plan's did (1 MiB less before)."""
    tracer = Tracer(warmup=2, iters=2)
    with pytest.raises(ProfileComplete), tracer:
        buffer_train(8)
    plan = hand_plan(tracer.profile({}))  # a budget of 1 byte: each op waits for the writes before it
    expected = buffer_train(8)
    with offload(plan, swap_dir=tmp_path) as plain:
        assert same(buffer_train(8), expected)
    expected = buffer_train(8, renew_at=3)
    with offload(plan, swap_dir=tmp_path) as ex:
        assert same(buffer_train(8, renew_at=3), expected)
    assert ex.stats.iteration_followed[1:] == [True, True, False, True, True, True, True]
    assert ex.stats.iteration_on_demand_fetches[5:] == [0, 0, 0]
    written, expected_written = ex.stats.iteration_moved_bytes["write"], plain.stats.iteration_moved_bytes["write"]
    assert min(written[5:7]) > max(expected_written[5:7]) - (1 << 19), (written, expected_written)


def kept_bucket_train(steps: int, keep: bool) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model; with ``keep``, a 1 MiB buffer all-reduced in the first step (a group
    of one) is kept to the end, as DDP keeps its first gradient bucket until it rebuilds them
    (numpy's memory, which teraio cannot send out as left over: NOTE [ Left over ])."""
    import torch.distributed as dist

    model, opt, gen = mlp_and_data()
    losses, kept = [], []
    for step in range(steps):
        loss = model(torch.randn(64, 32, generator=gen)).square().mean()
        if keep and step == 0:
            kept.append(torch.from_numpy(np.full(1 << 18, loss.item(), dtype=np.float32)))
            dist.all_reduce(kept[-1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_collectives_buffer_kept_past_the_boundary_is_not_waited_for(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: a buffer alive at a boundary, its collective
    done, is the script's to keep: an op over the budget does not wait for its free, which no
    other thread will make. accelerate's loop waited so 0.5 s in every run, for DDP's bucket."""
    import torch.distributed as dist

    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 2.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tracer = Tracer(warmup=1, iters=1)
        with pytest.raises(ProfileComplete), tracer:
            kept_bucket_train(5, keep=False)
        plan = hand_plan(tracer.profile({}))
        expected = kept_bucket_train(4, keep=False)
        with offload(plan, swap_dir=tmp_path) as plain:
            assert same(kept_bucket_train(4, keep=False), expected)
        # over by less than the buffer, which so looks as if its free could make room
        budget = max(plain.stats.iteration_peak_bytes[1:]) + (1 << 19)
        plan = dataclasses.replace(plan, parameters={**plan.parameters, "gpu_mem_bytes": budget})
        with offload(plan, swap_dir=tmp_path) as ex:
            assert same(kept_bucket_train(4, keep=True), expected)
    finally:
        dist.destroy_process_group()
    assert ex.matched_iterations == 3
    assert max(ex.stats.iteration_peak_bytes[1:]) > budget  # the buffer the plan does not know of
    assert "collective" not in ex.stats.steady_stalls, ex.stats.steady_stalls


def test_a_collectives_buffer_the_script_holds_on_to_is_waited_for_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: a buffer whose free does not come in the wait's
    time is one the script holds, and the buffer the same op makes in the iterations after is not
    waited for again (a pipeline stage's send buffers, kept for its backward pass: its last stage
    waited 0.5 s in every iteration after an evaluation)."""
    import torch.distributed as dist

    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 0.2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan, expected, _ = collective_plan_at_its_peak(tmp_path)
        with offload(plan, swap_dir=tmp_path) as held:
            assert same(collective_train(4, delay=0, hold=True), expected)
    finally:
        dist.destroy_process_group()
    assert held.matched_iterations == 3
    assert held.stats.steady_stalls["collective"][0] == 1, held.stats.steady_stalls  # 3 before


def test_a_collectives_buffer_late_once_is_waited_for_again(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: a buffer freed on another thread after the wait
    for it ran out (a rank behind once by more than the wait's time) is waited for again in the
    iterations after: marked as held by the script for good, the next iterations' buffers, late
    by less, were not waited for, and went over the budget (1.35x; a review's case)."""
    import torch.distributed as dist

    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 0.5)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan, expected, _ = collective_plan_at_its_peak(tmp_path, steps=6)
        with offload(plan, swap_dir=tmp_path) as late:  # every late free comes by the next step
            assert same(collective_train(6, delay=[0, 0, 0.75, 0.15, 0.15, 0.15], pause=0.4), expected)
    finally:
        dist.destroy_process_group()
    assert max(late.stats.iteration_peak_bytes[4:]) <= plan.budget_bytes, late.stats.iteration_peak_bytes


def gloo_group(store: Any, rank: int) -> Any:
    """Rank ``rank`` of a gloo group of two on ``store``, without ``init_process_group``: both
    ranks in this process."""
    import datetime

    import torch.distributed as dist

    group = dist.ProcessGroup(store, rank, 2)
    backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, datetime.timedelta(seconds=20))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class Partner:
    """Rank 1 of a gloo group of two, a thread of this process that joins each all-reduce of rank
    0 (``group``) ``delay`` seconds after it is asked to (``join_next``), as a rank behind does.
    Its thread runs no op teraio sees."""

    def __init__(self) -> None:
        import queue

        import torch.distributed as dist

        store = dist.HashStore()
        groups: list[Any] = [None, None]
        other = threading.Thread(target=lambda: groups.__setitem__(1, gloo_group(store, 1)))
        other.start()
        groups[0] = gloo_group(store, 0)
        other.join()
        self.group, self._theirs = groups
        self._asked: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def join_next(self, delay: float) -> None:
        import time

        self._asked.put(time.monotonic() + delay)

    def _serve(self) -> None:
        import time

        import torch.distributed as dist

        while (at := self._asked.get()) is not None:
            time.sleep(max(0.0, at - time.monotonic()))
            dist.all_reduce(torch.zeros(1 << 18), group=self._theirs)

    def close(self) -> None:
        self._asked.put(None)
        self._thread.join()


def unwaited_collective_train(partner: Partner, delays: list[float],
                              pauses: dict[int, float] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model, with a 1 MiB buffer all-reduced each step, that ``partner`` joins
    ``delays[step]`` seconds late, and that nobody waits for, as DDP's fp16 hook compresses each
    bucket into a buffer of its own: the collective's work is the buffer's last holder. Before
    step ``i`` the script sleeps ``pauses[i]`` seconds (a slow batch)."""
    import time

    import torch.distributed as dist

    model, opt, gen = mlp_and_data()
    losses = []
    for step, delay in enumerate(delays):
        time.sleep((pauses or {}).get(step, 0.0))
        loss = model(torch.randn(64, 32, generator=gen)).square().mean()
        partner.join_next(delay)
        dist.all_reduce(torch.full((1 << 18,), loss.item()), group=partner.group, async_op=True)
        scratch = torch.ones(1 << 18).add_(1)  # allocates while the work may hold the buffer
        opt.zero_grad()
        (loss + scratch[0] * 0).backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def run_late(tmp_path: Path, delays: list[float], pauses: dict[int, float] | None = None,
             train: Callable[..., tuple[list[float], list[torch.Tensor]]] | None = None) -> tuple[Any, int]:
    """``train`` (``unwaited_collective_train``) with ``delays`` and ``pauses`` under a plan at the
    peak it reaches where each buffer's work is done at once: the executor, and that budget."""
    train = unwaited_collective_train if train is None else train
    partner = Partner()
    try:
        tracer = Tracer(warmup=1, iters=1)
        with pytest.raises(ProfileComplete), tracer:
            train(partner, [0] * 5)
        plan = hand_plan(tracer.profile({}))
        expected = train(partner, [0] * len(delays))
        with offload(plan, swap_dir=tmp_path) as at_once:
            assert same(train(partner, [0] * len(delays)), expected)
        budget = max(at_once.stats.iteration_peak_bytes[1:])
        plan = dataclasses.replace(plan, parameters={**plan.parameters, "gpu_mem_bytes": budget})
        with offload(plan, swap_dir=tmp_path) as late:
            assert same(train(partner, delays, pauses), expected)
    finally:
        partner.close()
    assert late.matched_iterations == len(delays) - 1
    return late, budget


def test_a_collectives_buffer_its_work_holds_is_freed_once_the_work_is_done(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: a buffer whose last holder is its collective's
    work, done 0.3 s late, is freed once the work is done, and the op that waits for its room goes
    on then. teraio's own record of the works not done held the work through the wait, so the
    wait ran out, and the iteration went over its budget (DDP's fp16 hook under load)."""
    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 2.0)
    late, budget = run_late(tmp_path, [0.3] * 4)
    assert max(late.stats.iteration_peak_bytes[2:]) <= budget, (late.stats.iteration_peak_bytes, budget)
    waits, waited = late.stats.steady_stalls["collective"]
    assert waits >= 3 and waited < 2.0, late.stats.steady_stalls  # each ended by its work, not the wait's time


def test_a_buffer_its_work_held_late_once_is_waited_for_again(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Buffers of collectives in flight ]: a buffer whose work was done later than the
    wait's time once, then freed with its work on the training thread, was the work's to hold,
    not the script's: the buffers of the steps after are waited for again (they were not, and
    every iteration after went 1.26x over its budget; a review's case). The iterations after the
    late one go over all the same until the rank behind catches up: the steps here take no time,
    so a slow batch before step 4 gives it the time (where the budget, measured, left no room for
    a buffer beside the next step's, steps 3-6 ran before it did, and all went over)."""
    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 1.0)
    late, budget = run_late(tmp_path, [0, 0.3, 1.5, 0.3, 0.3, 0.3, 0.3], pauses={4: 1.5})
    assert max(late.stats.iteration_peak_bytes[5:]) <= budget, (late.stats.iteration_peak_bytes, budget)


def bank_reduced_train(partner: Partner, delays: list[float],
                       pauses: dict[int, float] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model, with a 1 MiB bank made before the loop and all-reduced as each step
    begins, that ``partner`` joins ``delays[step]`` seconds late and that the script waits for
    after its backward pass, as DDP does its gradient buckets' (the batch takes 50 ms to come,
    ``pauses[step]`` more, and the forward pass makes a 2 MiB scratch tensor)."""
    import time

    import torch.distributed as dist

    model, opt, gen = mlp_and_data()
    bank = torch.zeros(1 << 18)
    losses = []
    for step, delay in enumerate(delays):
        time.sleep((pauses or {}).get(step, 0.0))
        bank.add_(1)
        partner.join_next(delay)
        work = dist.all_reduce(bank, group=partner.group, async_op=True)
        time.sleep(0.05)
        scratch = torch.ones(1 << 19).mul_(2)
        loss = model(torch.randn(64, 32, generator=gen)).square().mean() + scratch[0] * 0
        del scratch
        opt.zero_grad()
        loss.backward()
        work.wait()
        bank.mul_(0.5)
        opt.step()
        losses.append(loss.item())
    return losses, [*(p.detach().clone() for p in model.parameters()), bank.clone()]


def test_a_tensor_a_collective_holds_goes_out_before_the_prefetches_that_need_its_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Out before the prefetches ]: the plan sends the bank out at its all-reduce, held back
    until the work is done; the scratch tensor, which the plan gives its room, waits for the work
    and the bank's write. It did not, and every iteration went over its budget by the bank."""
    monkeypatch.setattr("runtime.executor._COLLECTIVE_WAIT_S", 2.0)
    late, budget = run_late(tmp_path, [0.3] * 5, train=bank_reduced_train)
    assert max(late.stats.iteration_peak_bytes[1:]) <= budget, (late.stats.iteration_peak_bytes, budget)
    assert late.stats.steady_stalls["collective"][0] >= 3, late.stats.steady_stalls
    assert late.stats.held_by_collectives >= 4  # counted for the run's summary


def test_a_functional_collectives_result_kept_after_an_evaluation_goes_out(plan: Plan, tmp_path: Path) -> None:
    """NOTE [ Left over ]: a functional collective's result is not sent out while the collective
    may write it, but once waited for, one an iteration run on demand made and the script keeps
    goes out at the boundary after it, as any other (it stayed in, 1.71x; a review's case)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    kept: list[torch.Tensor] = []

    def evaluate(step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if step == 2:
            x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(7))
            kept.append(fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD)))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ex, budget = run_at_its_peak(plan, tmp_path, evaluate)
    finally:
        dist.destroy_process_group()
    assert max(ex.stats.iteration_peak_bytes[3:]) <= budget * 1.05, (ex.stats.iteration_peak_bytes, budget)


def logged_after_step_train(steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """``train``'s model, logging its hidden features' norm after each step (so at the next
    iteration's first op, where the features are carried, NOTE [ Carried copies ] in
    profiles.views) and dropping them only as the next step makes its own."""
    model, opt, gen = mlp_and_data()
    losses, feats = [], None
    for _ in range(steps):
        if feats is not None:
            losses.append(feats.norm().item())
        feats = model[:4](torch.randn(64, 32, generator=gen))
        loss = model[4](feats).square().mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_storage_the_next_iteration_reads_is_read_back_by_the_plan(tmp_path: Path) -> None:
    """NOTE [ Carried copies ] in profiles.views: the features of one step, read by the next
    iteration's log line and freed as it makes its own, have a period that reads them back by
    then; it ended at the iteration's end reading nothing back, so every iteration read them on
    demand."""
    tracer = Tracer(warmup=1, iters=1)
    with pytest.raises(ProfileComplete), tracer:
        logged_after_step_train(5)
    prof = tracer.profile({})
    periods = inactive_periods(prof)
    feats = periods[periods["wraps"] & (periods["size_bytes"] == 64 * 256 * 4) & (periods["kind"] == "activation")]
    assert len(feats) == 1 and feats["reads_back"].all(), feats
    tid, size, start, end = feats[["tensor_id", "size_bytes", "start_op", "end_op"]].to_numpy()[0]
    n = len(op_names(prof))
    moves = [move(tid, "offload", start + 1, start + 2, size, start, end, wraps=True),  # as the planner would
             move(tid, "prefetch", (end - 2) % n, end % n, size, start, end, wraps=True)]
    plan = hand_plan(prof)
    plan = dataclasses.replace(plan, migrations={0: [*plan.migrations[0], *moves]})
    expected = logged_after_step_train(5)
    with offload(plan, swap_dir=tmp_path, backend="posix") as ex:
        assert same(logged_after_step_train(5), expected)
    assert ex.matched_iterations == 4
    assert ex.stats.iteration_on_demand_fetches[1:] == [0] * 4


def test_an_unnamed_tensor_is_described_by_its_size_and_the_op_that_made_it(tmp_path: Path) -> None:
    """Warnings named such a tensor by its id alone ("tensor 141837019840512", a sweep's), which
    tells a user nothing."""
    from profiles.ids import CARRIED_FLAG, long_id, produced_id

    with offload(plan_of([], ["aten.mm.default", "c10d.allreduce_.default"]), swap_dir=tmp_path) as executor:
        executor.sizes[produced_id(1, 0) | CARRIED_FLAG] = 65536
        executor.sizes[long_id(3)] = 4096
        executor.persistent[0] = ("fc.weight", "param")
        assert executor._describe(produced_id(1, 0)) == (
            f"tensor {produced_id(1, 0)} (made by op 1, c10d.allreduce_.default)")
        # carried from iteration 0, whose ops include the set-up: its op is not named from the plan's
        # (a sweep's data set, made before the loop, was said made by op 0's .item())
        assert executor._describe(produced_id(1, 0) | CARRIED_FLAG) == (
            f"tensor {produced_id(1, 0) | CARRIED_FLAG} (65,536 bytes; made by op 1 of an iteration before)")
        executor.iteration, executor.stats.iteration_followed = 2, [True, True]  # from a steady iteration: named
        assert executor._describe(produced_id(1, 0) | CARRIED_FLAG) == (
            f"tensor {produced_id(1, 0) | CARRIED_FLAG} (65,536 bytes; made by op 1, c10d.allreduce_.default of "
            "an iteration before)")
        assert executor._describe(long_id(3)) == (
            f"tensor {long_id(3)} (4,096 bytes; alive a whole iteration, no name holds it)")
        assert executor._describe(0) == "tensor 0 (fc.weight)"
