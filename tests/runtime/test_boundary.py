"""What changes at an iteration boundary: a pure function of the plan and the executor's state,
tested here without torch (NOTE [ Boundaries ] in runtime.boundary)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from planner.plan import Migration, Plan
from profiles.ids import CARRIED_FLAG, long_id, produced_id
from runtime.boundary import Ending, Schedule, at_boundary
from tests.conftest import ROOT

N = 10  # ops per iteration
GRAD = produced_id(7, 0)  # a gradient made in backward; persistent number 3 after the boundary
BATCH = produced_id(1, 0)  # the last batch, alive across the boundary
STATE = 5  # an optimizer state, persistent


def migration(tid: int, action: str, trigger: int, size: int = 100, start: int = 8, end: int = N + 2,
              name: str | None = None) -> Migration:
    return Migration(tensor_id=tid, size_bytes=size, action=action, place="ssd", trigger_op=trigger,
                     deadline_op=(trigger + 1) % N, start_us=None, end_us=None, urgent=False, priority=0,
                     wraps=end >= N, period_start_op=start, period_end_op=end, name=name)


def plan(first_carried: dict[int, int] | None = None) -> Plan:
    moves = [
        migration(STATE, "offload", 9, start=8, end=N + 2),  # out across the boundary
        migration(STATE, "prefetch", 1, start=8, end=N + 2),
        migration(GRAD, "offload", 8, start=7, end=N + 3, name="w.grad"),  # trailing, out
        migration(BATCH, "offload", 3, size=40, start=2, end=N),  # trailing, out
        migration(produced_id(4, 0), "offload", 5, start=4, end=7),  # inside the iteration
        migration(produced_id(4, 0), "prefetch", 6, start=4, end=7),
    ]
    first = None
    if first_carried is not None:
        first = Plan(signature="first", parameters={"gpu_mem_bytes": 900}, summary={}, migrations={0: []},
                     op_names={0: ["a"] * 12}, made_bytes={0: [0] * 12}, carried_into_next={0: first_carried})
    return Plan(signature="s", parameters={"gpu_mem_bytes": 800}, summary={}, migrations={0: moves},
                op_names={0: [f"op{i}" for i in range(N)]}, made_bytes={0: [0] * N}, first=first)


def sizes(known: dict[int, int]):  # type: ignore[no-untyped-def]
    return known.get


def test_the_plan_says_what_is_out_when_an_iteration_begins() -> None:
    out = plan().out_at_boundary(0)
    assert sorted(m.tensor_id for m in out) == sorted([STATE, GRAD, BATCH])


def test_after_a_followed_iteration_nothing_moves_and_ids_follow_the_renaming() -> None:
    renamed = {BATCH: BATCH | CARRIED_FLAG, GRAD: 3, 7: 8}
    b = at_boundary(plan(), 0, Ending.STEADY, renamed=renamed, names={"w.grad": 3},
                    live_bytes=sizes({}), out={STATE, 3, BATCH | CARRIED_FLAG})
    assert b.plan_ids == {BATCH: BATCH | CARRIED_FLAG, GRAD: 3}  # transient ids only
    assert b.send_out == () and b.bring_back == ()


def test_after_an_iteration_on_demand_the_plans_memory_is_restored() -> None:
    """What the plan has out goes out (found by persistent id or by name), what else is out
    comes back; a transient id of the iteration run on demand means nothing."""
    live = {STATE: 100, 3: 100, BATCH | CARRIED_FLAG: 40, 11: 64}
    b = at_boundary(plan(), 0, Ending.ON_DEMAND, renamed={BATCH: BATCH | CARRIED_FLAG, GRAD: 3},
                    names={"w.grad": 3}, live_bytes=sizes(live), out={11})
    assert b.plan_ids == {GRAD: 3}
    assert sorted((tid, m.tensor_id) for tid, m in b.send_out) == [(3, GRAD), (STATE, STATE)]
    assert b.bring_back == (11,)


def test_what_an_iteration_carries_from_before_it_left_the_plan_has_the_plans_ids() -> None:
    """An iteration that left the plan at op 3 made the batch (op 1) as the plan did: it goes out
    where the plan has it out; one that left at op 1 made it on demand, whose id means nothing."""
    live = {STATE: 100, 3: 100, BATCH | CARRIED_FLAG: 40}
    renamed = {BATCH: BATCH | CARRIED_FLAG, GRAD: 3}
    b = at_boundary(plan(), 0, Ending.ON_DEMAND, renamed=renamed, names={"w.grad": 3}, live_bytes=sizes(live),
                    out=set(), followed_to=3)
    assert b.plan_ids[BATCH] == BATCH | CARRIED_FLAG
    assert (BATCH | CARRIED_FLAG, BATCH) in [(now, m.tensor_id) for now, m in b.send_out]
    b = at_boundary(plan(), 0, Ending.ON_DEMAND, renamed=renamed, names={"w.grad": 3}, live_bytes=sizes(live),
                    out=set(), followed_to=1)
    assert BATCH not in b.plan_ids and BATCH not in [m.tensor_id for _, m in b.send_out]


def test_a_storage_made_anew_is_found_under_the_plans_id_it_took() -> None:
    """NOTE [ Made anew ] in runtime.executor: a long-lived storage replaced by a new one, which took
    its part, goes out under the plan's id where the plan has it out."""
    bank, new = long_id(0), long_id(7)
    p = plan()
    p = dataclasses.replace(p, migrations={0: [*p.migrations[0], migration(bank, "offload", 9, size=64),
                                               migration(bank, "prefetch", 2, size=64)]})
    live = {new: 64, STATE: 100}  # the plan's bank died
    b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes(live), out=set())
    assert new not in [now for now, _ in b.send_out]
    b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes(live), out=set(),
                    made_anew={bank: new})
    assert (new, bank) in [(now, m.tensor_id) for now, m in b.send_out] and b.plan_ids[bank] == new
    b = at_boundary(p, 0, Ending.STEADY, renamed={}, names={}, live_bytes=sizes(live), out={new},
                    made_anew={bank: new})
    assert b.plan_ids[bank] == new and b.send_out == ()


def test_what_is_out_already_stays_out_and_another_size_is_left_alone() -> None:
    live = {STATE: 100, 3: 99}  # the gradient has another size: not the plan's tensor
    b = at_boundary(plan(), 0, Ending.ON_DEMAND, renamed={}, names={"w.grad": 3}, live_bytes=sizes(live),
                    out={STATE})
    assert b.send_out == () and b.bring_back == ()
    assert GRAD not in b.plan_ids  # later events of the plan's gradient must not find it


def test_after_an_iteration_on_demand_a_long_lived_storage_is_found_by_its_long_id() -> None:
    """A storage kept for good (a feature bank made before the loop) has its long id in every
    iteration: the plan has it out across the boundary, so it goes out, or stays out."""
    bank = long_id(0)
    p = plan()
    p = Plan(signature=p.signature, parameters=p.parameters, summary={}, op_names=p.op_names,
             made_bytes=p.made_bytes, migrations={0: [*p.migrations[0], migration(bank, "offload", 9, size=64),
                                                      migration(bank, "prefetch", 2, size=64)]})
    live = {bank: 64, STATE: 100}
    b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes(live), out=set())
    assert (bank, bank) in [(now, m.tensor_id) for now, m in b.send_out]
    b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes(live), out={bank})
    assert bank not in [now for now, _ in b.send_out] and b.bring_back == ()


def test_after_iteration_0_the_profiles_map_names_what_it_hands_on() -> None:
    """Under the steady id, and under that id with the carried flag (the old copy of a storage
    that overlaps its successor)."""
    made_in_0 = produced_id(31, 0) | CARRIED_FLAG
    live = {made_in_0: 40, STATE: 100}
    b = at_boundary(plan({BATCH: made_in_0}), 0, Ending.FIRST, renamed={}, names={},
                    live_bytes=sizes(live), out=set())
    assert b.plan_ids[BATCH] == b.plan_ids[BATCH | CARRIED_FLAG] == made_in_0
    assert sorted(tid for tid, _ in b.send_out) == sorted([made_in_0, STATE])
    # the map is iteration 0's: after iteration 0 ran on demand it is not trusted
    b = at_boundary(plan({BATCH: made_in_0}), 0, Ending.ON_DEMAND, renamed={}, names={},
                    live_bytes=sizes(live), out=set())
    assert BATCH not in b.plan_ids and [tid for tid, _ in b.send_out] == [STATE]


def test_after_iteration_0_on_demand_a_storage_kept_for_good_is_found_by_its_size() -> None:
    """A data set made before the loop is named by its long id in the steady plan and by its
    flagged id in iteration 1 (NOTE [ Kept for good ] in torch_patch.tracer): after iteration 0
    ran on demand, the profile's map still finds it, where a storage of the plan's size has
    the flagged id, and only after iteration 0."""
    bank, flagged = long_id(0), produced_id(3, 0) | CARRIED_FLAG
    base = plan({bank: flagged})
    p = Plan(signature="s", parameters=base.parameters, summary={}, op_names=base.op_names,
             made_bytes=base.made_bytes, first=base.first,
             migrations={0: [migration(bank, "offload", 9, size=64), migration(bank, "prefetch", 2, size=64)]})
    b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes({flagged: 64}), out=set(),
                    after_first=True)
    assert b.plan_ids == {bank: flagged} and [tid for tid, _ in b.send_out] == [flagged]
    for live, after_first in (({flagged: 65}, True), ({flagged: 64}, False)):
        b = at_boundary(p, 0, Ending.ON_DEMAND, renamed={}, names={}, live_bytes=sizes(live), out=set(),
                        after_first=after_first)
        assert bank not in b.plan_ids and b.send_out == ()


@pytest.mark.parametrize("ending", list(Ending))
def test_before_the_first_kept_iteration_a_storage_the_one_before_kept_for_good_is_found(ending: Ending) -> None:
    """DDP's buckets, rebuilt in iteration 1, have a flagged id in iteration 2 and their long id
    from 3 on (NOTE [ Kept for good ] in torch_patch.tracer): the plan's map of iteration 2 finds
    them before iteration 2 whatever came before, where the storage has the plan's size, and
    before no other iteration (a cache made in iteration 2 is found by the map of 3 alone)."""
    bucket, flagged = long_id(1), produced_id(5, 1) | CARRIED_FLAG
    cache, cache_flagged = long_id(2), produced_id(6, 0) | CARRIED_FLAG
    base = plan()
    p = Plan(signature="s", parameters=base.parameters, summary={}, op_names=base.op_names,
             made_bytes=base.made_bytes, kept_for_good={0: {2: {bucket: flagged}, 3: {cache: cache_flagged}}},
             migrations={0: [migration(bucket, "offload", 9, size=64), migration(bucket, "prefetch", 2, size=64)]})
    b = at_boundary(p, 0, ending, renamed={}, names={}, live_bytes=sizes({flagged: 64}), out=set(), iteration=2)
    assert b.plan_ids == {bucket: flagged}
    assert [tid for tid, _ in b.send_out] == ([] if ending is Ending.STEADY else [flagged])
    # out already (a plan's offload in iteration 1 before it left its plan): it stays out, not
    # brought back for the iteration to keep in memory (the runtime's live_bytes gives its size)
    b = at_boundary(p, 0, ending, renamed={}, names={}, live_bytes=sizes({flagged: 64}), out={flagged},
                    iteration=2)
    assert b.plan_ids == {bucket: flagged} and b.send_out == () and b.bring_back == ()
    for live, iteration in (({flagged: 65}, 2), ({flagged: 64}, 3), ({flagged: 64}, None)):
        b = at_boundary(p, 0, ending, renamed={}, names={}, live_bytes=sizes(live), out=set(), iteration=iteration)
        assert bucket not in b.plan_ids and b.send_out == ()
    p = dataclasses.replace(p, migrations={0: [migration(cache, "offload", 9, size=64)]})
    b = at_boundary(p, 0, ending, renamed={}, names={}, live_bytes=sizes({cache_flagged: 64}), out=set(), iteration=3)
    assert b.plan_ids == {cache: cache_flagged}
    b = at_boundary(p, 0, ending, renamed={}, names={}, live_bytes=sizes({cache_flagged: 64}), out=set(), iteration=2)
    assert cache not in b.plan_ids


def test_a_schedule_starts_offloads_before_prefetches_at_one_op() -> None:
    p = plan()
    moves = [migration(1, "prefetch", 2), migration(2, "offload", 2, start=1, end=4)]
    made = list(range(N))
    p = Plan(signature="s", parameters={"gpu_mem_bytes": 800}, summary={}, migrations={0: moves},
             op_names=p.op_names, made_bytes={0: made})
    s = Schedule.of(p, 0)
    assert [m.action for m in s.triggers[2]] == ["offload", "prefetch"]
    assert s.made_bytes == tuple(made) and s.budget_bytes == 800 and s.num_ops == N


def test_the_boundary_logic_needs_no_torch() -> None:
    code = "import sys, runtime.boundary; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_a_persistent_tensor_named_otherwise_than_the_plans_is_not_sent_out() -> None:
    """NOTE [ Other sizes ] in runtime.executor: the plan's optimizer state 5 is named ``s``; in a
    run where 5 is named otherwise (a script profiled with other arguments), 5 is another tensor
    of that size, and stays where it is after an iteration run on demand."""
    def named(name: str | None) -> Plan:
        p = plan()
        return Plan(signature=p.signature, parameters=p.parameters, summary={}, op_names=p.op_names,
                    made_bytes=p.made_bytes, migrations={0: [dataclasses.replace(m, name=name) if m.tensor_id == STATE
                                                             else m for m in p.migrations[0]]})

    for name, names, sent in [(None, {}, True), ("s", {"s": STATE}, True), ("s", {"t": STATE}, False)]:
        b = at_boundary(named(name), 0, Ending.ON_DEMAND, renamed={}, names=names,
                        live_bytes=sizes({STATE: 100}), out=set())
        assert (STATE in [t for t, _ in b.send_out]) == sent, (name, names)
