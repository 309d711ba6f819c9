"""plan.json, format ``teraio-plan/6``: the one model of it, its writing and its reading.

Every key, unit and meaning is written down in ``docs/formats.md``; the
planner writes this model and the runtime reads it (``load_plan``).

NOTE [ Plans of a job ]: a plan made from a profile of several ranks holds a
section per rank, the job's ``world_size`` and each rank's profile signature
(``signatures``). Every rank of a job runs the section of its own rank in the
plan of that same job, or the job stops with one error: ``check_rank`` is the
check a rank makes before it follows the plan. Both keys are optional (a plan
made before them reads as one of ``len(ranks)`` ranks, signatures unknown).

A plan holds, per rank, the migrations sorted by ``trigger_op`` (then
priority). Each migration is a dict:

- ``tensor_id``, ``size_bytes``;
- ``action``: ``offload`` (with ``target``) or ``prefetch`` (with ``source``),
  ``ssd`` or ``host``;
- ``trigger_op``: the transfer starts before this op;
- ``deadline_op``: offload: the op from which the plan counts its memory free
  (no op waits for it there: NOTE [ Room ] in ``runtime.executor``); prefetch:
  the next use of the tensor, which waits until it is complete;
- ``start_us``, ``end_us``: when the simulator predicts it to start and end,
  from the start of the iteration in which it is triggered (``end_us`` may pass
  the iteration's end; ``null`` when the simulated iteration did not run it);
- ``urgent``: an op waits for it in the simulation; serve it before others
  (where the prefetches are served by deadline: offloads, and prefetches due
  in the iteration after the one that triggers them);
- ``priority``: the order (lower first) in which pending transfers are served
  after the urgent ones: offloads in the order the planner reserved
  bandwidth, prefetches the same or by deadline (NOTE [ Prefetch early, serve
  by deadline ] in ``planner.early``). The simulator serves each channel so,
  preemptively; the runtime's engine serves each direction's queue so (SSD
  and host together), each job whole;
- ``keep_copy`` (prefetch) and ``reuse_copy`` (offload), both false when absent:
  the prefetch leaves its copy where it was, and the storage's next planned
  offload frees the storage without writing if that copy is still good (no op
  wrote the storage since, which the runtime checks: NOTE [ Copies kept ] in
  ``planner.clean``);
- ``wraps``, ``period_start_op``, ``period_end_op``: the inactive period moved;
- ``name`` (only for named tensors: parameters, gradients, optimizer state):
  the tensor's name in the profile, which lets the runtime find a storage
  whose id changes at the boundary (NOTE [ Offloads without a prefetch ]).

Per rank, ``op_names`` lists the ops of an iteration and ``made_bytes`` the
bytes of the storages each of them allocates in the profile: before an op, the
runtime waits for offloads in flight until those bytes fit the budget (NOTE [
Room ] in ``runtime.executor``), as the simulator does.

NOTE [ Op indices in plans ]: every ``trigger_op`` and ``deadline_op`` is an
op index of one iteration, in ``[0, num_ops)``; the runtime applies the same
migrations every iteration. A period that spans the iteration boundary has
``wraps: true`` and ``period_end_op >= num_ops`` (the op ``period_end_op -
num_ops`` of the next iteration); its events that fall in the next iteration
are given modulo ``num_ops``: the offload is triggered at ``(period_start_op
+ 1) % num_ops``, and the prefetch's ``trigger_op`` and ``deadline_op`` are ops
of the iteration after the one that offloaded it (so a prefetch whose tensor
was not offloaded, as in the first iteration, finds nothing to do). For every
migration, ``trigger_op`` and ``deadline_op`` lie on the period's ops
``period_start_op + 1 .. period_end_op`` folded modulo ``num_ops``.

NOTE [ The first iteration's plan ]: a profile that recorded iteration 0
(NOTE [ The first iteration ] in ``profiles.model``) gets a plan of its own for
it, under ``first_iteration``: a whole plan of the same format (its own
``signature``, ``parameters``, ``summary``, ``op_names`` and ``ranks``), made
for one pass (nothing wraps; what it leaves alive may go out for good), whose
``parameters.gpu_mem_bytes`` is the budget iteration 0 is held to: the plan's
own, or more when iteration 0 cannot fit it. Its ``carried_into_next`` maps,
per rank, the steady id of each transient storage iteration 0 hands to
iteration 1 to that storage's id in iteration 1 (keys and values decimal), so
that the steady plan can move it at the boundary. Both keys are optional:
a reader that does not know them reads the steady plan as before (DESIGN.md
section 5 does not list them yet). Where the profile's first kept iteration is
2 or later, the steady plan's ``kept_for_good`` (new in version 6; version 5's
``carried_into_first_kept`` mapped the first kept iteration alone) maps, per
rank, for each iteration from 2 to that one, the long ids of the storages the
iteration before made and kept for good to their ids in it (NOTE [ Kept for
good ] in ``torch_patch.tracer``).

NOTE [ Offloads without a prefetch ]: an offload with no prefetch of the same
``tensor_id`` and ``period_start_op`` moves a *trailing* period (NOTE [
Trailing periods ] in ``planner.problem``): the storage is not used again
before it dies, and ``period_end_op`` is the op at which it is no longer alive
(``>= num_ops``, with ``wraps: true``, when it dies in a later iteration, as
gradients freed by the next iteration's ``zero_grad(set_to_none=True)``, or
``num_ops + 1`` for a storage no op of the iteration uses: NOTE [ Untouched
storages ] in ``profiles.views``).
The runtime leaves such a tensor out: if something touches it anyway it is
faulted in on demand, and its copy is deleted when the storage dies. A
gradient made in backward is such a tensor: it gets its persistent name (and
id) at the boundary, and ``name`` is how the runtime finds it there when the
iteration before did not follow the plan.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import PlanFormatError

__all__ = ["FORMAT", "Migration", "Plan", "check_rank", "load_plan", "save_plan", "signatures_of"]

FORMAT = "teraio-plan/6"
# 5: carried_into_first_kept, the first kept iteration's map alone (read as kept_for_good of that
# iteration); 4: no map (its profile named such storages twice); 3: also no keep_copy and
# reuse_copy, read as plans keeping none
_READ_TOO = ("teraio-plan/5", "teraio-plan/4", "teraio-plan/3")
_OLDER = ("teraio-plan/1", "teraio-plan/2")
_ACTIONS = {"offload": "target", "prefetch": "source"}
_PLACES = ("ssd", "host")


@dataclass(frozen=True)
class Migration:
    """One planned transfer; see the module docstring for the fields."""

    tensor_id: int
    size_bytes: int
    action: str  # "offload" | "prefetch"
    place: str  # "ssd" | "host": the offload's target or the prefetch's source
    trigger_op: int
    deadline_op: int
    start_us: float | None
    end_us: float | None
    urgent: bool
    priority: int
    wraps: bool
    period_start_op: int
    period_end_op: int
    name: str | None = None
    keep_copy: bool = False  # prefetch: leave the copy (NOTE [ Copies kept ] in planner.clean)
    reuse_copy: bool = False  # offload: free without writing where the kept copy is good

    def to_dict(self) -> dict[str, Any]:
        d = {
            "tensor_id": self.tensor_id, "size_bytes": self.size_bytes, "action": self.action,
            _ACTIONS[self.action]: self.place, "trigger_op": self.trigger_op,
            "deadline_op": self.deadline_op, "start_us": self.start_us, "end_us": self.end_us,
            "urgent": self.urgent, "priority": self.priority, "wraps": self.wraps,
            "period_start_op": self.period_start_op, "period_end_op": self.period_end_op,
        }
        if self.name is not None:
            d["name"] = self.name
        if self.keep_copy:
            d["keep_copy"] = True
        if self.reuse_copy:
            d["reuse_copy"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_ops: int | None) -> Migration:
        action = d["action"]
        if action not in _ACTIONS:
            raise ValueError(f"action {action!r}, expected offload or prefetch")
        place = d[_ACTIONS[action]]
        if place not in _PLACES:
            raise ValueError(f"{_ACTIONS[action]} {place!r}, expected ssd or host")
        m = cls(
            tensor_id=int(d["tensor_id"]), size_bytes=int(d["size_bytes"]), action=action,
            place=place, trigger_op=int(d["trigger_op"]), deadline_op=int(d["deadline_op"]),
            start_us=_opt_float(d.get("start_us")), end_us=_opt_float(d.get("end_us")),
            urgent=bool(d.get("urgent", False)), priority=int(d.get("priority", 0)),
            wraps=bool(d.get("wraps", False)), period_start_op=int(d.get("period_start_op", -1)),
            period_end_op=int(d.get("period_end_op", -1)),
            name=None if d.get("name") is None else str(d["name"]),
            keep_copy=bool(d.get("keep_copy", False)), reuse_copy=bool(d.get("reuse_copy", False)),
        )
        if m.size_bytes < 0:
            raise ValueError(f"negative size_bytes {m.size_bytes}")
        for name in ("trigger_op", "deadline_op"):
            op = getattr(m, name)
            if op < 0 or (num_ops is not None and op >= num_ops):
                raise ValueError(f"{name} {op} outside [0, {num_ops})")
        return m


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class Plan:
    """A whole plan: what it was made for, its parameters and summary, per-rank migrations."""

    signature: str
    parameters: dict[str, Any]
    summary: dict[str, Any]
    migrations: dict[int, list[Migration]]
    op_names: dict[int, list[str]] = field(default_factory=dict)
    made_bytes: dict[int, list[int]] = field(default_factory=dict)  # rank -> bytes each op allocates
    summary_by_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    first: Plan | None = None  # NOTE [ The first iteration's plan ]
    carried_into_next: dict[int, dict[int, int]] = field(default_factory=dict)  # in ``first`` only
    # rank -> {iteration: {long id: id in it}}, in the steady plan only (NOTE [ Kept for good ])
    kept_for_good: dict[int, dict[int, dict[int, int]]] = field(default_factory=dict)
    world_size: int | None = None  # NOTE [ Plans of a job ]; None: the plan does not say
    signatures: dict[int, str] = field(default_factory=dict)  # rank -> its profile's signature

    def __post_init__(self) -> None:
        for rank, names in self.op_names.items():  # NOTE [ Room ] in runtime.executor needs them
            made = self.made_bytes.get(rank, ())
            if len(made) != len(names):
                raise ValueError(f"rank {rank}: made_bytes has {len(made)} entries for {len(names)} ops")
            if made and min(made) < 0:
                raise ValueError(f"rank {rank}: negative made_bytes")

    @property
    def job_size(self) -> int:
        """The number of ranks of the job this plan is for: ``world_size``, or for a plan that does
        not say, the ranks it has sections for."""
        return self.world_size if self.world_size is not None else len(self.migrations)

    def num_ops(self, rank: int) -> int | None:
        names = self.op_names.get(rank)
        return None if names is None else len(names)

    @property
    def budget_bytes(self) -> int | None:
        """The device memory this plan holds its iterations to (``parameters.gpu_mem_bytes``)."""
        value = self.parameters.get("gpu_mem_bytes")
        return None if value is None else int(value)

    @property
    def device_type(self) -> str | None:
        """The device its profile trained on (``parameters.device_type``: ``cpu``, ``cuda``,
        ``synthetic``), or None where the plan does not say."""
        value = self.parameters.get("device_type")
        return None if value is None else str(value)

    @property
    def profiled_from(self) -> int:
        """The first iteration its profile recorded (``parameters.warmup``; 1 where the plan does
        not say): the run's iterations before it may differ from the plan's."""
        value = self.parameters.get("warmup")
        return 1 if value is None else int(value)

    @property
    def host_mem_bytes(self) -> int | None:
        value = self.parameters.get("host_mem_bytes")
        return None if value is None else int(value)

    def out_at_boundary(self, rank: int) -> list[Migration]:
        """The offloads whose tensors this plan has out when an iteration begins.

        That is a period that spans the boundary (``wraps``) whose offload is triggered
        before it: after its own prefetch once both are folded into one iteration, or,
        with no prefetch (a trailing period, NOTE [ Offloads without a prefetch ]), at
        ``period_start_op + 1`` still inside the iteration.
        """
        moves = self.migrations.get(rank, [])
        prefetch_at = {(m.tensor_id, m.period_start_op): m.trigger_op for m in moves
                       if m.action == "prefetch"}
        num_ops = self.num_ops(rank)
        out = []
        for m in moves:
            if m.action != "offload" or not m.wraps:
                continue
            prefetch = prefetch_at.get((m.tensor_id, m.period_start_op))
            if prefetch is not None:
                if m.trigger_op > prefetch:
                    out.append(m)
            elif num_ops is not None and m.period_start_op >= 0 and m.period_start_op + 1 < num_ops:
                out.append(m)
        return out

    def to_json(self) -> dict[str, Any]:
        doc = {
            "format": FORMAT,
            "signature": self.signature,
            "parameters": self.parameters,
            "summary": _finite(self.summary),
            "summary_by_rank": {str(r): _finite(s) for r, s in self.summary_by_rank.items()},
            "comparison": _finite(self.comparison),
            "num_ops": {str(r): len(n) for r, n in self.op_names.items()},
            "op_names": {str(r): n for r, n in self.op_names.items()},
            "made_bytes": {str(r): m for r, m in self.made_bytes.items()},
            "ranks": {str(r): [m.to_dict() for m in ms] for r, ms in self.migrations.items()},
        }
        if self.world_size is not None:
            doc["world_size"] = self.world_size
        if self.signatures:
            doc["signatures"] = {str(r): s for r, s in sorted(self.signatures.items())}
        if self.carried_into_next:
            doc["carried_into_next"] = {str(r): {str(k): v for k, v in m.items()}
                                        for r, m in self.carried_into_next.items()}
        if self.kept_for_good:
            doc["kept_for_good"] = {str(r): {str(i): {str(k): v for k, v in ids.items()} for i, ids in its.items()}
                                    for r, its in self.kept_for_good.items()}
        if self.first is not None:
            doc["first_iteration"] = self.first.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: Any, source: object = "plan") -> Plan:
        """Validate and read a ``teraio-plan/6`` (or ``/5``, ``/4``, ``/3``) document;
        ``PlanFormatError`` on any problem (an older plan is refused with what to do)."""
        if not isinstance(doc, dict):
            raise PlanFormatError(source, "not a JSON object")
        if doc.get("format") in _OLDER:
            profile = (doc.get("parameters") or {}).get("profile") or "its profile"
            raise PlanFormatError(source, f"format {doc['format']!r} was written by an older teraio; "
                                          f"make the plan again from {profile} with `teraio plan`")
        if doc.get("format") not in (FORMAT, *_READ_TOO):
            raise PlanFormatError(source, f"format {doc.get('format')!r}, expected {FORMAT!r}; "
                                          "make the plan again with `teraio plan`")
        try:
            op_names = {int(r): [str(x) for x in n] for r, n in doc.get("op_names", {}).items()}
            made = {int(r): [int(x) for x in m] for r, m in doc.get("made_bytes", {}).items()}
            migrations: dict[int, list[Migration]] = {}
            for r, entries in doc["ranks"].items():
                rank = int(r)
                num_ops = len(op_names[rank]) if rank in op_names else None
                migrations[rank] = []
                for i, d in enumerate(entries):
                    try:
                        migrations[rank].append(Migration.from_dict(d, num_ops))
                    except (KeyError, TypeError, ValueError) as exc:
                        raise PlanFormatError(source, f"rank {rank}, migration {i}: {_why(exc)}") from None
            first = doc.get("first_iteration")
            return cls(
                signature=str(doc["signature"]), parameters=dict(doc.get("parameters", {})),
                summary=dict(doc.get("summary", {})), migrations=migrations, op_names=op_names,
                made_bytes=made,
                summary_by_rank={int(r): dict(s) for r, s in doc.get("summary_by_rank", {}).items()},
                comparison=dict(doc.get("comparison", {})),
                first=None if first is None else cls.from_json(first, f"{source}, first_iteration"),
                carried_into_next={int(r): {int(k): int(v) for k, v in m.items()}
                                   for r, m in doc.get("carried_into_next", {}).items()},
                kept_for_good=_kept_for_good(doc),
                world_size=None if doc.get("world_size") is None else int(doc["world_size"]),
                signatures={int(r): str(sig) for r, sig in doc.get("signatures", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFormatError(source, f"malformed plan: {_why(exc)}") from None


def _kept_for_good(doc: dict[str, Any]) -> dict[int, dict[int, dict[int, int]]]:
    """A plan's ``kept_for_good``; a version 5 plan's ``carried_into_first_kept`` as the map of
    its one iteration."""
    kept = doc.get("kept_for_good", {})
    if "carried_into_first_kept" in doc and "kept_for_good" not in doc:
        kept = {r: {k["iteration"]: k["ids"]} for r, k in doc["carried_into_first_kept"].items()}
    return {int(r): {int(i): {int(a): int(b) for a, b in ids.items()} for i, ids in its.items()}
            for r, its in kept.items()}


def signatures_of(meta: dict[str, Any]) -> dict[int, str]:
    """Each rank's signature from a profile's ``meta.json`` dict: its ``signatures`` (rank -> sha),
    or for a profile without them, ``signature`` as the lowest rank's (``ranks``, else 0)."""
    if meta.get("signatures"):
        return {int(r): str(sig) for r, sig in meta["signatures"].items()}
    if meta.get("signature") is None:
        return {}
    return {min((int(r) for r in meta.get("ranks") or [0]), default=0): str(meta["signature"])}


def check_rank(plan: Plan, rank: int, world_size: int, source: object = "plan") -> None:
    """Refuse, with one ``PlanFormatError``, to run rank ``rank`` of a job of ``world_size`` ranks
    with ``plan`` unless the plan was made for a job of that size and has a section for that
    rank (NOTE [ Plans of a job ])."""
    again = f"profile this job (`teraio profile --nproc {world_size}`) and plan again"
    if plan.job_size != world_size:
        ranks = "rank" if plan.job_size == 1 else "ranks"
        raise PlanFormatError(source, f"this plan was made for a job of {plan.job_size} {ranks}; this job has "
                                      f"{world_size}: {again}")
    if rank not in plan.migrations:
        raise PlanFormatError(source, f"this plan has no section for rank {rank} (it has ranks "
                                      f"{sorted(plan.migrations)} of {plan.job_size}): {again}")


def _why(exc: BaseException) -> str:
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


def _finite(obj: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` as JSON, atomically (a temporary file renamed into place)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    tmp.replace(out)
    return out


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate plan.json; raises ``PlanFormatError`` naming the problem."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanFormatError(p, "no such plan file; make one with `teraio plan`") from None
    except (OSError, ValueError) as exc:
        raise PlanFormatError(p, f"not valid JSON ({exc})") from None
    return Plan.from_json(doc, p)
