"""What the executor follows: one iteration's plan op by op, and what changes at a boundary.

Pure functions of the plan (``planner.plan``) and of the state the executor
reports; no torch, so tests call them directly. The executor only applies them.

NOTE [ Boundaries ]: every iteration from 1 on tries to follow the steady plan
from its first op, whatever the iteration before did; iteration 0 follows its
own plan (NOTE [ The first iteration's plan ] in ``planner.plan``). An
iteration that leaves its plan (an op or a size differs: an evaluation, a log
line or a checkpoint save between steps) runs the rest on demand: nothing more
is started, what is out stays out until an op touches it. At the boundary
after it, ``at_boundary`` puts memory where the plan has it when an iteration
begins: what the plan has out across the boundary goes out (``send_out``, and
the executor waits for it), everything else that is out comes back
(``bring_back``). After an iteration that followed the steady plan to its end,
memory is already so and nothing moves.

A plan names a transient storage by the id the iteration that made it gave it
(``profiles.ids``). A storage alive across the boundary is renamed there (a
carried flag, or a gradient's persistent number), so events after it (a
prefetch, an offload triggered at op 0) look up the plan
id in ``plan_ids``, which maps it to the storage's id now:

- after the steady plan: the boundary's own renaming (the iteration's ids were
  the plan's);
- after iteration 0 followed its own plan to the end: the profile's map of
  what iteration 0 hands on (``carried_into_next``, a storage kept for good under
  its long id: NOTE [ Kept for good ] in ``torch_patch.tracer``), whose ids are those of the
  profiled iteration 0, under the steady id and under that id with the carried
  flag (the name steady iterations give an old copy that overlaps its
  successor, NOTE [ Carried storages ] in ``torch_patch.tracer``), plus
  gradients by their names;
- after an iteration run on demand: gradients by their names, and long-lived
  storages by their long ids, which every iteration gives them alike (a feature
  bank made before the loop; left unmapped, the bank the plan has out stayed in,
  and the iteration after an evaluation went 1.72x over its budget); and what
  it carries that it made before it left the plan, whose ids are the plan's
  (left in, a step of PCGrad whose branch the data decides carried its
  gradients' concatenations into a followed one at 1.06x); its other
  transient ids mean nothing to the plan;
- and before each iteration from 2 to the profile's first kept one, whatever
  came before: the storages the iteration before made and kept for good (DDP's
  buckets, rebuilt in iteration 1), which have a flagged id in it and their long
  one after, by the profile's map of that iteration (``kept_for_good``, NOTE [
  Kept for good ] in ``torch_patch.tracer``).

A map's storage is taken only where it has the plan's size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import Enum

from planner.plan import Migration, Plan
from profiles.ids import CARRIED_FLAG, INPUT_BASE, LONG_BASE, PRODUCED_BASE, produced_op

__all__ = ["Boundary", "Ending", "Schedule", "at_boundary"]


@dataclass(frozen=True)
class Schedule:
    """One iteration's plan for one rank, looked up op by op."""

    triggers: Mapping[int, tuple[Migration, ...]]  # op -> transfers to start before it, offloads first
    op_names: tuple[str, ...]
    made_bytes: tuple[int, ...]  # per op: the bytes it allocates, made room for (NOTE [ Room ])
    budget_bytes: int | None

    @classmethod
    def of(cls, plan: Plan, rank: int) -> Schedule:
        triggers: dict[int, list[Migration]] = {}
        # At one op, offloads start before prefetches: a prefetch waits for room only on
        # offloads in flight (NOTE [ Room ] in runtime.executor), as the simulator's op does.
        for m in sorted(plan.migrations.get(rank, []), key=lambda m: m.action != "offload"):
            triggers.setdefault(m.trigger_op, []).append(m)
        return cls({k: tuple(v) for k, v in triggers.items()}, tuple(plan.op_names.get(rank, ())),
                   tuple(plan.made_bytes.get(rank, ())), plan.budget_bytes)

    @property
    def num_ops(self) -> int:
        return len(self.op_names)


class Ending(Enum):
    """How the iteration that just ended went."""

    STEADY = "steady"  # it followed the steady plan to its end
    FIRST = "first"  # iteration 0 followed its own plan to its end
    ON_DEMAND = "on demand"  # it ran on demand, all of it or from where it left its plan


@dataclass(frozen=True)
class Boundary:
    """What the executor does at a boundary (NOTE [ Boundaries ])."""

    plan_ids: dict[int, int]  # plan id -> the id its storage has now
    send_out: tuple[tuple[int, Migration], ...]  # (id now, offload) to start, urgent, and wait for
    bring_back: tuple[int, ...]  # ids now of offloaded storages the plan has resident


def at_boundary(plan: Plan, rank: int, ending: Ending, *, renamed: Mapping[int, int],
                names: Mapping[str, int], live_bytes: Callable[[int], int | None],
                out: Collection[int], after_first: bool = False, iteration: int | None = None,
                names_moved: bool = False, made_anew: Mapping[int, int] | None = None,
                followed_to: int = 0) -> Boundary:
    """The boundary before an iteration that follows the steady plan of ``rank``.

    ``renamed``: old id -> new id of every storage renamed at this boundary;
    ``names``: persistent name -> id now; ``live_bytes(id)``: the size of the live
    storage with that id now, in memory or out, None if none; ``out``: ids now of the storages that
    are offloaded or on their way out; ``after_first``: the iteration that ended is 0;
    ``iteration``: the one that begins; ``names_moved``: names were let go at this boundary (a
    model trained after another took them: NOTE [ Late roots ] in torch_patch.opstream), so the
    named storages are not those the plan's moves sent out in a followed iteration that ended;
    ``made_anew``: plan id -> id now of the storages that took the parts of the plan's that died
    (NOTE [ Made anew ] in runtime.executor); ``followed_to``: the ops of the steady plan an
    iteration run on demand ran before it left it, whose storages have the plan's ids.
    """
    kept = plan.kept_for_good.get(rank, {}).get(iteration) if iteration is not None else None
    kept_for_good = _of_its_size(plan, rank, kept, live_bytes) if kept else {}
    anew = dict(made_anew or {})
    if ending is Ending.STEADY and not names_moved:
        return Boundary({old: new for old, new in renamed.items() if old >= PRODUCED_BASE} | anew | kept_for_good,
                        (), ())
    plan_ids: dict[int, int] = anew | kept_for_good
    if ending is Ending.STEADY:  # names moved: the transient storages are where the plan has them
        plan_ids |= {old: new for old, new in renamed.items() if old >= PRODUCED_BASE
                     and not LONG_BASE <= old < CARRIED_FLAG}
    elif ending is Ending.FIRST and plan.first is not None:
        for steady, made in plan.first.carried_into_next.get(rank, {}).items():
            plan_ids[steady] = plan_ids[steady | CARRIED_FLAG] = made
    elif ending is Ending.ON_DEMAND and followed_to:  # made before it left the plan: the plan's ids
        plan_ids |= {old: new for old, new in renamed.items()
                     if PRODUCED_BASE <= old < INPUT_BASE and produced_op(old) < followed_to}
    if after_first and ending is not Ending.FIRST and plan.first is not None:
        # Iteration 0 ran on demand, so its transient ids may not be the profile's; but a storage
        # kept for good has no other name in iteration 1 than its flagged one (before, iteration 1
        # went 1.55x over its budget with the data set it could not find).
        plan_ids |= _of_its_size(plan, rank, plan.first.carried_into_next.get(rank, {}), live_bytes)
    for m in plan.migrations.get(rank, []):
        if m.tensor_id >= PRODUCED_BASE and m.name is not None and m.name in names:
            plan_ids[m.tensor_id] = names[m.name]
    send_out: list[tuple[int, Migration]] = []
    stays_out: set[int] = set()
    for m in plan.out_at_boundary(rank):
        tid = m.tensor_id
        if tid < PRODUCED_BASE:  # by its name (NOTE [ Named by position ] in runtime.executor)
            now = tid if m.name is None else names.get(m.name)
        else:
            now = plan_ids.get(tid, tid if LONG_BASE <= tid < CARRIED_FLAG else None)
        if now is not None and now in out:
            stays_out.add(now)
        elif now is not None and live_bytes(now) == m.size_bytes:
            send_out.append((now, m))
            stays_out.add(now)
        else:  # not found, or another storage: leave it be (it is out once it dies)
            plan_ids.pop(m.tensor_id, None)
    return Boundary(plan_ids, tuple(send_out), tuple(t for t in out if t not in stays_out))


def _of_its_size(plan: Plan, rank: int, ids: Mapping[int, int],
                 live_bytes: Callable[[int], int | None]) -> dict[int, int]:
    """Of ``ids`` (plan id -> id now), the long-lived storages the plan moves whose storage now
    has the plan's size (NOTE [ Kept for good ] in torch_patch.tracer)."""
    sizes = {m.tensor_id: m.size_bytes for m in plan.migrations.get(rank, [])}
    return {steady: made for steady, made in ids.items()
            if LONG_BASE <= steady < CARRIED_FLAG and steady in sizes and live_bytes(made) == sizes[steady]}
