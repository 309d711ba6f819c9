"""The job's iteration from all its ranks together: one graph of every rank's ops.

Each rank is planned and simulated alone (``planner.simulate``), but the ranks
of a job wait on each other at their sends, receives and collectives, so a
stall on one rank can hold the others back. ``predict_job`` puts every rank's
ops of one iteration in one directed acyclic graph (networkx) and takes its
longest path: the job's iteration time and the ops that set it.

NOTE [ The job graph ]: the nodes are the ops, ``(rank, op_index)``, each
weighted with its own time (below), what the rank's simulation added to it
(``charge_us``: copies on the compute and the runtime's per-op cost, NOTE [
Copies on the compute ] in ``planner.simulate``) and the stall the simulation
had before it (``SimResult.stall_us_before``); edges follow each rank's program
order. A node ends at the latest end of its predecessors plus its weight, and
every rank starts the iteration at 0 (the iteration boundary lines the ranks
up). Communication adds *join* nodes of weight 0:

- point to point: the k-th ``c10d.send`` from rank a to rank b (``peer == b``)
  pairs with the k-th ``c10d.recv_`` on rank b from a (``peer == a``), in op
  order. A join after the pair has both as predecessors and the receiving
  rank's next op as successor: the receive is complete when both sides have
  done the transfer, ``max(ready_recv, ready_send) + transfer``. The sender
  does not wait for the receiver (pipelining's ``batch_isend_irecv`` sends
  asynchronously): its next op follows the send alone;
- collectives (every other ``c10d.`` op: all-reduce, broadcast, all-gather,
  reduce-scatter, barrier...; and the functional collectives, ``_c10d_functional.all_reduce``
  and the rest, which DTensor's redistributions use): the k-th collective of every rank is one
  operation of the whole job; its join has every rank's k-th collective as
  predecessor and each rank's next op as successor, so it completes at the
  latest rank's arrival plus the transfer. Every collective is taken to span
  all the ranks of the profile (process sub-groups are not recorded), and
  the k-th of each rank must be the same op.

The simulated iteration of each rank is its ops and stalls back to back (host
gaps left out, as in ``PlanProblem.ideal_iteration_us``), so with no
communication the job's time is the slowest rank's. What the model does not
see: a collective is synchronised where its op is issued, while the wait that
really blocks (``Work.wait``, not seen by the tracer) may come later with
compute in between, and a rank's stalls were simulated on its own timeline, so
a stall and a wait for a peer that would overlap in a run add up here (both
make the prediction longer than the run); a sender that a backend holds until
its receiver is ready (a rendezvous send) waits in a run but not here (shorter).

NOTE [ Waits in measured communication ]: a profiled send, receive or
collective may have waited for its peers inside its own measured duration (on
gloo, the receives and sends of the example pipeline do; where an op returns
at once, the wait falls in the host gap after it, which the planner leaves
out).
Weighting the op with its measured time would count that wait twice: once as
the op's time and once more through the graph's edge from the peer it waited
for. So a communication op's own weight is its *transfer* time, estimated as
the **least** measured duration among its participants (both sides of a
send/receive pair; every rank of a collective): each participant measured its
wait plus the transfer, and the one that arrived last waited least, so the
least duration is the closest bound on the transfer that the profile holds,
and no wait is in it. The graph then supplies each wait once, from the
dependencies. Each participant's node carries that transfer time, plus its own
charge and stall (a rank's copy cost owed at a communication op is its own;
taking a peer's smaller figure would drop it), so a profile measured with the
waits inside the ops and one measured without them predict the same job
(tested).

NOTE [ The critical rank ]: the longest path's time is split among the ranks
by the ops on it (an op's weight goes to its rank; joins weigh nothing). The
critical rank is the rank that owns most of it: the rank whose own ops and
stalls the job's iteration waits on most, so the one whose plan (or budget)
to look at first. Ties in the path (predecessors that end at the same time)
go to the same rank's previous op, then to the lowest rank, so results do
not depend on the order in which ranks are given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from planner.errors import JobGraphError
from planner.problem import PlanProblem
from planner.simulate import SimResult
from profiles.ops import functional_collective

__all__ = ["RECV", "SEND", "JobPrediction", "RankOps", "is_collective", "job_graph", "predict_job",
           "rank_ops", "rank_ops_from_kernels"]

SEND = "c10d.send.default"
RECV = "c10d.recv_.default"
_AGAIN = "are the ranks' profiles of the same job and iteration? profile the job again"


def is_collective(op_name: str) -> bool:
    """An op that every rank of the job takes part in: anything c10d but send and recv, and a
    functional collective (``profiles.ops.functional_collective``)."""
    if op_name.startswith("c10d."):
        return op_name not in (SEND, RECV)
    return functional_collective(op_name)


@dataclass(frozen=True, eq=False)
class RankOps:
    """One rank's iteration as the job graph sees it. Times us."""

    rank: int
    op_names: tuple[str, ...]
    duration_us: np.ndarray  # (num_ops,) float64: each op's own time (the profiled one)
    peer: np.ndarray  # (num_ops,) int64: the other rank of a send or recv, -1 otherwise
    stall_us: np.ndarray  # (num_ops,) float64: how long the rank waited before each op
    # (num_ops,) float64: what the rank's plan added to each op's own time (copies on the compute,
    # the runtime's per-op cost); the rank's own even where peers share the op's time. None: nothing.
    charge_us: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.op_names)
        if not len(self.duration_us) == len(self.peer) == len(self.stall_us) == n:
            raise ValueError(f"rank {self.rank}: op_names, duration_us, peer and stall_us differ in length")
        if self.charge_us is not None and len(self.charge_us) != n:
            raise ValueError(f"rank {self.rank}: charge_us has {len(self.charge_us)} entries for {n} ops")

    @property
    def num_ops(self) -> int:
        return len(self.op_names)


def rank_ops(problem: PlanProblem, sim: SimResult | None = None) -> RankOps:
    """The job graph's view of one planned rank: its ops, as long as ``sim`` ran them (with
    what copies cost the compute there) and with its stalls; with no ``sim``, ideal."""
    n = problem.num_ops
    peer = np.full(n, -1, np.int64) if problem.peer is None else np.asarray(problem.peer, np.int64)
    if sim is None:
        return RankOps(problem.rank, problem.op_names, np.asarray(problem.duration_us, np.float64), peer,
                       np.zeros(n))
    duration = np.asarray(problem.duration_us, np.float64)
    return RankOps(problem.rank, problem.op_names, duration, peer, np.asarray(sim.stall_us_before, np.float64),
                   sim.op_run_us - duration)


def rank_ops_from_kernels(rank: int, kernels: Any) -> RankOps:
    """One rank's ops straight from its ``kernels`` rows (``Profile.kernels_of``), no stalls."""
    n = len(kernels)
    peer = kernels["peer"].to_numpy(np.int64) if "peer" in kernels else np.full(n, -1, np.int64)
    return RankOps(rank, tuple(kernels["op_name"].astype(str)), kernels["duration_us"].to_numpy(np.float64),
                   peer, np.zeros(n))


@dataclass(frozen=True, eq=False)
class JobPrediction:
    """The job's iteration: NOTE [ The job graph ]. Times us from the iteration's start."""

    iteration_us: float
    critical_rank: int  # NOTE [ The critical rank ]
    critical_path: tuple[tuple[int, int], ...]  # (rank, op_index) of the longest path's ops, in order
    critical_us_by_rank: dict[int, float]  # time each rank's ops and stalls take on that path
    op_end_us: dict[int, np.ndarray]  # rank -> (num_ops,) float64: when each op is complete
    busy_us_by_rank: dict[int, float]  # each rank's own ops and stalls (transfers, not waits)

    @property
    def end_us_by_rank(self) -> dict[int, float]:
        return {r: float(e.max()) if len(e) else 0.0 for r, e in self.op_end_us.items()}

    @property
    def wait_us_by_rank(self) -> dict[int, float]:
        """How long each rank waits for its peers in the iteration."""
        ends = self.end_us_by_rank
        return {r: max(ends[r] - self.busy_us_by_rank[r], 0.0) for r in ends}


def _where(ops: RankOps, k: int) -> str:
    return f"rank {ops.rank}'s op {k} ({ops.op_names[k]})"


def _p2p_ops(ranks: Mapping[int, RankOps]) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """Sends and receives per (source, destination), each in op order; errors for a bad peer."""
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in sorted(ranks):
        ops = ranks[r]
        for k, name in enumerate(ops.op_names):
            if name not in (SEND, RECV):
                continue
            peer = int(ops.peer[k])
            if peer not in ranks or peer == r:
                have = "no peer recorded (kernels.peer is -1)" if peer < 0 else f"peer {peer}"
                raise JobGraphError(f"{_where(ops, k)} has {have}, not another rank of the profile "
                                    f"(ranks {sorted(ranks)}): the job's iteration needs every rank's profile; "
                                    f"{_AGAIN}")
            if name == SEND:
                sends[(r, peer)].append(k)
            else:
                recvs[(peer, r)].append(k)
    return sends, recvs


def _check_pairs(ranks: Mapping[int, RankOps], src: int, dst: int, sends: list[int], recvs: list[int]) -> None:
    if len(sends) == len(recvs):
        return
    m = min(len(sends), len(recvs))
    if len(sends) > m:
        raise JobGraphError(f"{_where(ranks[src], sends[m])} is send number {m + 1} to rank {dst}, but rank "
                            f"{dst} receives only {len(recvs)} from rank {src} in its iteration; {_AGAIN}")
    raise JobGraphError(f"{_where(ranks[dst], recvs[m])} is receive number {m + 1} from rank {src}, but rank "
                        f"{src} sends only {len(sends)} to rank {dst} in its iteration; {_AGAIN}")


def _collectives(ranks: Mapping[int, RankOps]) -> list[dict[int, int]]:
    """The job's collectives in order: for each, rank -> its op index; errors if they do not line up."""
    per_rank = {r: [k for k, name in enumerate(ranks[r].op_names) if is_collective(name)] for r in sorted(ranks)}
    fewest = min(per_rank, key=lambda r: (len(per_rank[r]), r))
    m = len(per_rank[fewest])
    for r, ks in per_rank.items():
        if len(ks) > m:
            raise JobGraphError(f"{_where(ranks[r], ks[m])} is collective number {m + 1}, but rank {fewest} has "
                                f"only {m} collectives in its iteration (collectives on process sub-groups are "
                                f"not modelled); {_AGAIN}")
    out = []
    for i in range(m):
        at = {r: ks[i] for r, ks in per_rank.items()}
        first = min(at)
        for r, k in at.items():
            if ranks[r].op_names[k] != ranks[first].op_names[at[first]]:
                raise JobGraphError(f"collective number {i + 1} is {_where(ranks[first], at[first])} but "
                                    f"{_where(ranks[r], k)}: the ranks' collectives do not line up; {_AGAIN}")
        out.append(at)
    return out


def job_graph(ranks: Mapping[int, RankOps]) -> nx.DiGraph:
    """The DAG of NOTE [ The job graph ]: op nodes ``(rank, op_index)`` with ``rank``, ``own_us``
    (duration, or transfer time for communication: NOTE [ Waits in measured communication ]),
    ``charge_us`` and ``stall_us``; join nodes ``("p2p", src, dst, k)`` and ``("collective", k)`` with
    ``rank`` None and no time. Raises ``JobGraphError`` when the ranks do not fit together."""
    g = nx.DiGraph()
    for r in sorted(ranks):
        ops = ranks[r]
        charge = np.zeros(ops.num_ops) if ops.charge_us is None else ops.charge_us
        g.add_nodes_from(((r, k), {"rank": r, "own_us": float(ops.duration_us[k]), "charge_us": float(charge[k]),
                                   "stall_us": float(ops.stall_us[k])}) for k in range(ops.num_ops))
        g.add_edges_from(((r, k), (r, k + 1)) for k in range(ops.num_ops - 1))

    def join(node: tuple[Any, ...], members: list[tuple[int, int]], waiting: list[tuple[int, int]]) -> None:
        transfer_us = min(g.nodes[v]["own_us"] for v in members)
        for v in members:
            g.nodes[v]["own_us"] = transfer_us
        g.add_node(node, rank=None, own_us=0.0, charge_us=0.0, stall_us=0.0)
        g.add_edges_from((v, node) for v in members)
        g.add_edges_from((node, (r, k + 1)) for r, k in waiting if k + 1 < ranks[r].num_ops)

    sends, recvs = _p2p_ops(ranks)
    for src, dst in sorted(set(sends) | set(recvs)):
        s_ops, r_ops = sends.get((src, dst), []), recvs.get((src, dst), [])
        _check_pairs(ranks, src, dst, s_ops, r_ops)
        for i, (s, v) in enumerate(zip(s_ops, r_ops, strict=True)):
            join(("p2p", src, dst, i), [(src, s), (dst, v)], [(dst, v)])
    for i, at in enumerate(_collectives(ranks)):
        members = sorted(at.items())
        join(("collective", i), members, members)
    return g


def _preference(node: tuple[Any, ...]) -> tuple[Any, ...]:
    """Lower is preferred among predecessors that end together: ops before joins, low ranks first."""
    return (1, *node) if isinstance(node[0], str) else (0, *node)


def predict_job(ranks: Mapping[int, RankOps], include_stalls: bool = True) -> JobPrediction:
    """The job's iteration: the longest path of ``job_graph(ranks)``; without ``include_stalls``,
    the same graph with no stalls or charges (the job with infinite memory)."""
    if not ranks:
        raise ValueError("predict_job needs at least one rank")
    g = job_graph(ranks)
    try:
        order = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        cycle = [v for edge in nx.find_cycle(g) for v in edge[:1] if not isinstance(v[0], str)]
        where = ", ".join(_where(ranks[r], k) for r, k in sorted(cycle)[:4])
        raise JobGraphError(f"the ranks' sends, receives and collectives wait on each other in a cycle "
                            f"(through {where}): the job as profiled could never finish; {_AGAIN}") from None
    weight = {v: d["own_us"] + (d["charge_us"] + d["stall_us"] if include_stalls else 0.0)
              for v, d in g.nodes(data=True)}
    end: dict[Any, float] = {}
    via: dict[Any, Any] = {}
    for v in order:
        start, best = 0.0, None
        for u in g.predecessors(v):
            e = end[u]
            if best is None or e > start or (e == start and _preference(u) < _preference(best)):
                start, best = e, u
        end[v] = start + weight[v]
        via[v] = best
    last = min(end, key=lambda v: (-end[v], _preference(v))) if end else None
    path = []
    v = last
    while v is not None:
        path.append(v)
        v = via[v]
    path.reverse()
    critical = dict.fromkeys(sorted(ranks), 0.0)
    for v in path:
        if g.nodes[v]["rank"] is not None:
            critical[v[0]] += weight[v]
    # An op is complete when its join is (a receive or a collective waits there).
    done = {v: v for v in g.nodes}
    for j in g.nodes:
        if isinstance(j[0], str):
            for u in g.predecessors(j):
                if j[0] == "collective" or u[0] == j[2]:  # every member; the receiving side of a pair
                    done[u] = j
    op_end = {r: np.array([end[done[(r, k)]] for k in range(ranks[r].num_ops)], np.float64) for r in sorted(ranks)}
    busy = {r: float(sum(weight[(r, k)] for k in range(ranks[r].num_ops))) for r in sorted(ranks)}
    return JobPrediction(
        iteration_us=float(end[last]) if last is not None else 0.0,
        critical_rank=min(critical, key=lambda r: (-critical[r], r)),
        critical_path=tuple(v for v in path if not isinstance(v[0], str)),
        critical_us_by_rank=critical, op_end_us=op_end, busy_us_by_rank=busy,
    )
