"""The job graph (planner.job): properties on small hand-built jobs and random pipelines."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from planner.errors import JobGraphError
from planner.job import RECV, SEND, JobPrediction, RankOps, is_collective, predict_job

ALLREDUCE = "c10d.allreduce_.default"
BROADCAST = "c10d.broadcast_.default"


def ops(rank: int, spec: list[tuple[str, float] | tuple[str, float, int]],
        stall: dict[int, float] | None = None) -> RankOps:
    """A rank from ``(op_name, duration_us[, peer])`` tuples and ``{op_index: stall_us}``."""
    stalls = np.zeros(len(spec))
    for k, s in (stall or {}).items():
        stalls[k] = s
    return RankOps(rank, tuple(o[0] for o in spec), np.array([o[1] for o in spec], float),
                   np.array([o[2] if len(o) > 2 else -1 for o in spec]), stalls)  # type: ignore[misc]


def random_job(seed: int, num_stages: int = 3, num_microbatches: int = 3, collectives: bool = True,
               stalls: bool = True) -> dict[int, RankOps]:
    """A GPipe-ordered pipeline (forwards, then backwards) with a gradient all-reduce and a
    broadcast at the end, random durations and stalls; acyclic by construction."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in range(num_stages):
        spec: list[tuple] = []
        for _ in range(num_microbatches):
            spec += [("aten.mm", float(d)) for d in rng.uniform(10, 100, int(rng.integers(0, 3)))]
            if s > 0:
                spec.append((RECV, rng.uniform(1, 50), s - 1))
            spec.append(("aten.mm", rng.uniform(10, 100)))
            if s < num_stages - 1:
                spec.append((SEND, rng.uniform(1, 50), s + 1))
        for _ in range(num_microbatches):
            if s < num_stages - 1:
                spec.append((RECV, rng.uniform(1, 50), s + 1))
            spec.append(("aten.mm", rng.uniform(20, 200)))
            if s > 0:
                spec.append((SEND, rng.uniform(1, 50), s - 1))
        if collectives:
            spec += [(ALLREDUCE, rng.uniform(1, 80)), ("aten.add_", rng.uniform(5, 20)),
                     (BROADCAST, rng.uniform(1, 20))]
        stall = {int(k): float(rng.uniform(0, 150)) for k in rng.choice(len(spec), 3)} if stalls else {}
        out[s] = ops(s, spec, stall)
    return out


def reference_ends(ranks: dict[int, RankOps]) -> dict[int, list[float]]:
    """When each op completes, by stepping the ranks' programs with the rules of NOTE [ The job
    graph ] written out directly (no graph): ready = previous op complete + stall; compute and
    send: ready + own time; receive: max(ready + transfer, its send complete); the i-th
    collective: latest ready of all ranks + transfer. Transfer: the least duration of the
    participants (NOTE [ Waits in measured communication ])."""
    pair: dict[tuple[int, int], int] = {}  # (rank, op) of a send or recv -> its pair number
    count: dict[tuple[int, int, str], int] = {}
    coll: dict[tuple[int, int], int] = {}
    for r, o in ranks.items():
        n_coll = 0
        for k, name in enumerate(o.op_names):
            if name in (SEND, RECV):
                key = (r, int(o.peer[k]), name) if name == SEND else (int(o.peer[k]), r, name)
                pair[(r, k)] = count.get(key, 0)
                count[key] = pair[(r, k)] + 1
            elif is_collective(name):
                coll[(r, k)] = n_coll
                n_coll += 1

    def dur(r: int, k: int) -> float:
        return float(ranks[r].duration_us[k])

    send_at = {(r, int(ranks[r].peer[k]), i): k for (r, k), i in pair.items() if ranks[r].op_names[k] == SEND}
    coll_at: dict[int, dict[int, int]] = {}
    for (r, k), i in coll.items():
        coll_at.setdefault(i, {})[r] = k
    done: dict[int, list[float]] = {r: [] for r in ranks}
    arrived: dict[int, dict[int, float]] = {}
    progress = True
    while progress:
        progress = False
        for r, o in ranks.items():
            k = len(done[r])
            if k == o.num_ops:
                continue
            ready = (done[r][k - 1] if k else 0.0) + float(o.stall_us[k])
            name = o.op_names[k]
            if name == SEND:
                recv_rank = int(o.peer[k])
                recv_op = next(kk for (rr, kk), i in pair.items() if rr == recv_rank and i == pair[(r, k)]
                               and ranks[rr].op_names[kk] == RECV and int(ranks[rr].peer[kk]) == r)
                done[r].append(ready + min(dur(r, k), dur(recv_rank, recv_op)))
            elif name == RECV:
                src = int(o.peer[k])
                s_op = send_at[(src, r, pair[(r, k)])]
                if len(done[src]) <= s_op:
                    continue
                done[r].append(max(ready + min(dur(r, k), dur(src, s_op)), done[src][s_op]))
            elif is_collective(name):
                i = coll[(r, k)]
                arrived.setdefault(i, {})[r] = ready
                if len(arrived[i]) < len(ranks):
                    continue
                t = min(dur(rr, kk) for rr, kk in coll_at[i].items())
                done[r].append(max(arrived[i].values()) + t)
            else:
                done[r].append(ready + dur(r, k))
            progress = True
    assert all(len(done[r]) == ranks[r].num_ops for r in ranks), "reference deadlocked"
    return done


# ---- the job's time --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_without_communication_the_job_is_its_slowest_rank(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks = {r: ops(r, [("aten.mm", float(d)) for d in rng.uniform(1, 100, int(rng.integers(1, 30)))],
                    {0: float(rng.uniform(0, 500))}) for r in range(4)}
    job = predict_job(ranks)
    totals = {r: float(o.duration_us.sum() + o.stall_us.sum()) for r, o in ranks.items()}
    assert job.iteration_us == pytest.approx(max(totals.values()))
    assert job.critical_rank == max(totals, key=totals.__getitem__)
    assert job.critical_path == tuple((job.critical_rank, k) for k in range(ranks[job.critical_rank].num_ops))
    assert job.wait_us_by_rank == pytest.approx(dict.fromkeys(ranks, 0.0))  # nobody waits for anyone
    ideal = predict_job(ranks, include_stalls=False)
    assert ideal.iteration_us == pytest.approx(max(float(o.duration_us.sum()) for o in ranks.values()))


@pytest.mark.parametrize("seed", range(6))
def test_graph_agrees_with_stepping_the_ranks_programs(seed: int) -> None:
    ranks = random_job(seed, num_stages=2 + seed % 3)
    job = predict_job(ranks)
    ref = reference_ends(ranks)
    for r in ranks:
        np.testing.assert_allclose(job.op_end_us[r], ref[r], rtol=1e-12)
    assert job.iteration_us == pytest.approx(max(max(v) for v in ref.values()))
    # the critical path's ops and stalls add up to the job's time
    assert sum(job.critical_us_by_rank.values()) == pytest.approx(job.iteration_us)


def test_a_stall_on_stage_0_delays_stage_1_by_exactly_the_chain() -> None:
    # stage 0: F (100 us), send; stage 1: A (a us), recv, G (50 us); transfers 5 us.
    for a in (0.0, 60.0, 150.0):
        base = None
        for stall in (0.0, 30.0, 80.0):
            s0 = ops(0, [("aten.mm", 100.0), (SEND, 5.0, 1)], {0: stall})
            s1 = ops(1, [("aten.mm", a), (RECV, 5.0, 0), ("aten.mm", 50.0)])
            job = predict_job({0: s0, 1: s1})
            end1 = job.end_us_by_rank[1]
            assert end1 == pytest.approx(max(a, stall + 100.0) + 5.0 + 50.0)
            if base is None:
                base = end1
            # stage 1 is delayed by what of the stall its slack (a - 100) does not absorb
            assert end1 - base == pytest.approx(max(0.0, stall + 100.0 - max(a, 100.0)))
            assert job.end_us_by_rank[0] == pytest.approx(stall + 105.0)  # the sender never waits


def test_the_critical_rank_is_the_stalled_stage() -> None:
    def pipeline(stall0: float) -> JobPrediction:
        s0 = ops(0, [("aten.mm", 100.0), (SEND, 5.0, 1), ("aten.mm", 100.0), (SEND, 5.0, 1)], {2: stall0})
        s1 = ops(1, [(RECV, 5.0, 0), ("aten.mm", 150.0), (RECV, 5.0, 0), ("aten.mm", 150.0)])
        return predict_job({0: s0, 1: s1})

    calm, stalled = pipeline(0.0), pipeline(1000.0)
    assert calm.critical_rank == 1
    assert stalled.critical_rank == 0
    assert stalled.critical_us_by_rank[0] >= 1000.0
    assert stalled.iteration_us == pytest.approx(100 + 5 + 1000 + 100 + 5 + 150)
    assert stalled.wait_us_by_rank[1] == pytest.approx(stalled.iteration_us - (5 + 150 + 5 + 150))


@pytest.mark.parametrize("allreduce", [ALLREDUCE, "_c10d_functional.all_reduce.default"])
def test_data_parallel_allreduce_is_the_latest_prefix_plus_the_rest(allreduce: str) -> None:
    """Also a functional collective's (DTensor's), followed by its wrapping, which no rank waits at."""
    after = "_c10d_functional._wrap_tensor_autograd.default" if allreduce != ALLREDUCE else "aten.mm"
    spec = [("aten.mm", 40.0), ("aten.mm", 60.0), (allreduce, 30.0), (after, 20.0), ("aten.add_", 10.0)]
    fast = ops(0, spec, {1: 5.0, 4: 7.0})
    slow_spec = list(spec)
    slow_spec[2] = (allreduce, 12.0)  # this rank arrived last: it waited least, its time is the transfer
    slow = ops(1, slow_spec, {0: 90.0, 2: 3.0})
    job = predict_job({0: fast, 1: slow})
    transfer = 12.0
    prefix = {0: 40 + 65.0, 1: 130 + 60 + 3.0}  # up to the all-reduce, its own stall included
    rest = {0: 20 + 17.0, 1: 30.0}
    assert job.iteration_us == pytest.approx(max(prefix.values()) + transfer + max(rest.values()))
    assert job.op_end_us[0][2] == job.op_end_us[1][2] == pytest.approx(max(prefix.values()) + transfer)
    assert job.wait_us_by_rank[0] == pytest.approx(prefix[1] - prefix[0])
    assert job.critical_rank == 1


def test_a_ranks_charge_at_a_collective_stays_its_own() -> None:
    """What a rank's plan adds to an op (copies on the compute) is the rank's own: at a collective,
    whose own time is the least of its members', rank 0's 50 us charge is not dropped for rank 1's
    none (it was before: the charge was part of the op's time, and the least was taken)."""
    spec = [("aten.mm", 40.0), (ALLREDUCE, 30.0), ("aten.mm", 20.0)]
    charged = dataclasses.replace(ops(0, spec), charge_us=np.array([0.0, 50.0, 0.0]))
    job = predict_job({0: charged, 1: ops(1, spec)})
    assert job.op_end_us[0][1] == job.op_end_us[1][1] == pytest.approx(40 + 30 + 50.0)
    assert job.iteration_us == pytest.approx(40 + 30 + 50 + 20.0)
    assert predict_job({0: charged, 1: ops(1, spec)}, include_stalls=False).iteration_us == pytest.approx(90.0)


@pytest.mark.parametrize("seed", range(4))
def test_waits_inside_measured_ops_are_not_counted_twice(seed: int) -> None:
    """A profile whose receives and collectives measured their waits (a synchronous backend) and
    one that did not (asynchronous ops) predict the same job (NOTE [ Waits in measured
    communication ])."""
    ranks = random_job(seed, stalls=False)
    job = predict_job(ranks)
    measured = {}
    inflated = 0
    for r, o in ranks.items():
        dur = o.duration_us.copy()
        for k, name in enumerate(o.op_names):
            if name in (SEND, RECV) or is_collective(name):
                ready = job.op_end_us[r][k - 1] if k else 0.0
                dur[k] = job.op_end_us[r][k] - ready  # its wait and the transfer, as a blocking op measures
                inflated += dur[k] > o.duration_us[k] + 1e-9
        measured[r] = RankOps(r, o.op_names, dur, o.peer, o.stall_us)
    assert inflated > 0  # some op did wait
    again = predict_job(measured)
    assert again.iteration_us == pytest.approx(job.iteration_us)
    for r in ranks:
        np.testing.assert_allclose(again.op_end_us[r], job.op_end_us[r])


@pytest.mark.parametrize("seed", range(4))
def test_results_do_not_depend_on_rank_order_or_labels(seed: int) -> None:
    ranks = random_job(seed, num_stages=3)
    job = predict_job(ranks)
    backwards = predict_job(dict(reversed(list(ranks.items()))))
    assert backwards.iteration_us == job.iteration_us
    assert backwards.critical_rank == job.critical_rank
    assert backwards.critical_path == job.critical_path
    # relabel the ranks: 0 -> 2, 1 -> 0, 2 -> 1
    label = {0: 2, 1: 0, 2: 1}
    moved = {label[r]: RankOps(label[r], o.op_names, o.duration_us,
                               np.array([label[int(p)] if p >= 0 else -1 for p in o.peer]), o.stall_us)
             for r, o in ranks.items()}
    relabelled = predict_job(moved)
    assert relabelled.iteration_us == pytest.approx(job.iteration_us)
    assert relabelled.critical_rank == label[job.critical_rank]
    for r in ranks:
        np.testing.assert_allclose(relabelled.op_end_us[label[r]], job.op_end_us[r])


def test_ideal_is_the_same_graph_without_stalls() -> None:
    ranks = random_job(7)
    job, ideal = predict_job(ranks), predict_job(ranks, include_stalls=False)
    calm = {r: RankOps(r, o.op_names, o.duration_us, o.peer, np.zeros(o.num_ops)) for r, o in ranks.items()}
    assert ideal.iteration_us == pytest.approx(predict_job(calm).iteration_us)
    assert ideal.iteration_us <= job.iteration_us
    assert math.isfinite(job.iteration_us)


# ---- ranks that do not fit together -----------------------------------------------------


@pytest.mark.parametrize(("ranks", "message"), [
    ({0: ops(0, [("aten.mm", 1.0), (SEND, 1.0, 1), (SEND, 1.0, 1)]), 1: ops(1, [(RECV, 1.0, 0)])},
     "rank 0's op 2 (c10d.send.default) is send number 2 to rank 1, but rank 1 receives only 1"),
    ({0: ops(0, [(SEND, 1.0, 1)]), 1: ops(1, [(RECV, 1.0, 0), ("aten.mm", 1.0), (RECV, 1.0, 0)])},
     "rank 1's op 2 (c10d.recv_.default) is receive number 2 from rank 0, but rank 0 sends only 1"),
    ({0: ops(0, [(SEND, 1.0)]), 1: ops(1, [(RECV, 1.0, 0)])},
     "rank 0's op 0 (c10d.send.default) has no peer recorded"),
    ({0: ops(0, [(SEND, 1.0, 3)]), 1: ops(1, [(RECV, 1.0, 0)])},
     "rank 0's op 0 (c10d.send.default) has peer 3, not another rank of the profile (ranks [0, 1])"),
    ({0: ops(0, [(ALLREDUCE, 1.0), (ALLREDUCE, 1.0)]), 1: ops(1, [(ALLREDUCE, 1.0)])},
     "rank 0's op 1 (c10d.allreduce_.default) is collective number 2, but rank 1 has only 1"),
    ({0: ops(0, [(ALLREDUCE, 1.0)]), 1: ops(1, [("aten.mm", 1.0), (BROADCAST, 1.0)])},
     "collective number 1 is rank 0's op 0 (c10d.allreduce_.default) but rank 1's op 1 (c10d.broadcast_"),
    ({0: ops(0, [(RECV, 1.0, 1), (SEND, 1.0, 1)]), 1: ops(1, [(RECV, 1.0, 0), (SEND, 1.0, 0)])},
     "wait on each other in a cycle (through rank 0's op 1 (c10d.send.default), rank 1's op 1"),
])
def test_ranks_that_do_not_fit_together_are_one_clear_error(ranks: dict[int, RankOps], message: str) -> None:
    with pytest.raises(JobGraphError) as exc:
        predict_job(ranks)
    assert message in str(exc.value)
    assert "profile the job again" in str(exc.value)


def test_functional_collectives_join_the_ranks_and_their_sends_and_waits_do_not() -> None:
    assert is_collective("_c10d_functional.all_reduce.default") and is_collective("c10d.allreduce_.default")
    assert is_collective("_c10d_functional_autograd.all_to_all_single.default")
    for name in ("_c10d_functional.isend.default", "_c10d_functional.irecv.default", SEND, RECV,
                 "_c10d_functional.wait_tensor.default", "_c10d_functional._wrap_tensor_autograd.default"):
        assert not is_collective(name), name
