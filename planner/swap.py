"""NOTE [ Weights on the idle SSD ]: the greedy takes the SSD first and host memory for what the
SSD cannot carry (``planner.greedy``). A weight and its optimizer states are all written in the
optimizer step, where the states' writes fill the SSD, so the weights land in host memory. Then
every pass that reads the weights reads them all from host memory while the SSD reads little: for
Llama3-70B at batch 1 with 512 GiB of host memory, the forward pass read 263 GiB from host memory
and took 10.9 s against 9.1 s of ops, with the SSD's reads idle (BENCHMARKS.md, bench/policies.py).

A weight whose moves are all in host memory and one of its optimizer states of the same size whose
moves are all on the SSD can trade places. The optimizer step reads and writes the same bytes on each
link as before (the weight's where the state's were); host memory holds the state from one step to
the next where it held the weight between its uses (``swap_weights`` checks that it has the room at
every op); and the passes that read the weight read it from the SSD. So ``swap_weights`` trades as
many bytes as would even out the two links' reads in the phase window where host memory's reads lag
furthest behind the SSD's (where that window reads each traded weight once, as a forward pass does),
spread over the whole model in the order the weights are read, so that each part of that window
gains alike. The traded moves keep their triggers; the simulation judges them. ``planner.make``
trades on the plan the passes after the greedy have finished, runs those passes again on it (its
copies marked again: a pass may split a traded weight's periods between the two places), and keeps
the trade only where the plan so made is faster: the reads taken off host memory's link make room
there for writes the SSD cannot carry, which filling host memory again (``planner.rebalance``) sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from planner.bound import Bound
from planner.clean import fold, host_held, host_span
from planner.greedy import Move
from planner.hardware import Hardware
from planner.problem import PlanProblem
from planner.rebalance import window_times_us
from planner.simulate import SimResult

__all__ = ["swap_weights"]


def _pairs(problem: PlanProblem, moves: Sequence[Move]) -> list[tuple[list[int], list[int]]]:
    """(the weight's moves, the state's moves) for each weight moved to host memory alone that has an
    optimizer state of its size moved to the SSD alone, in the order the weights are first read."""
    chains: dict[int, list[int]] = {}
    for i, mv in enumerate(moves):
        chains.setdefault(mv.tensor_id, []).append(i)
    kind = dict(zip(problem.tensor_id.tolist(), problem.kind.tolist(), strict=True))
    n = problem.num_ops

    def only(tid: int, target: str) -> bool:
        return all(moves[i].target == target for i in chains[tid])

    weights = {name: tid for tid, name in problem.names.items() if kind.get(tid) == "param" and tid in chains}
    states: dict[int, list[int]] = {}  # weight -> its states moved, "<weight>.exp_avg", ... by name
    for tid, name in sorted(problem.names.items(), key=lambda t: t[1]):
        if kind.get(tid) == "optimizer_state" and tid in chains:
            parts = name.split(".")
            owner = next((weights[w] for k in range(len(parts) - 1, 0, -1) if (w := ".".join(parts[:k])) in weights),
                         None)
            if owner is not None:
                states.setdefault(owner, []).append(tid)
    pairs = []
    for tid, mine in chains.items():
        if tid not in states or not only(tid, "host"):
            continue
        size = moves[mine[0]].size_bytes
        state = next((s for s in states[tid] if moves[chains[s][0]].size_bytes == size and only(s, "ssd")), None)
        if state is not None:
            pairs.append((min(moves[i].end_op % n for i in mine), mine, chains[state]))
    return [(mine, theirs) for _, mine, theirs in sorted(pairs, key=lambda p: p[0])]


def _lag_bytes(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware, bound: Bound) -> float:
    """The bytes of reads to take from host memory to the SSD so that the two links would finish
    together, in the phase window above its bound where host memory's reads lag furthest behind."""
    bw = hw.channel_bw()
    ssd_bw, host_bw = bw["ssd_read"], bw["host_read"]
    first = bound.window_first_op
    reads = [mv for mv in moves if mv.reads_back]
    window = np.searchsorted(first, np.array([mv.end_op % problem.num_ops for mv in reads], np.int64), side="right") - 1
    size = np.array([mv.size_bytes for mv in reads], np.float64)
    on_host = np.array([mv.target == "host" for mv in reads], bool)
    host = np.bincount(window[on_host], size[on_host], len(first))
    ssd = np.bincount(window[~on_host], size[~on_host], len(first))
    above = window_times_us(sim, first) > bound.window_us
    lag = np.where(above, (host * ssd_bw - ssd * host_bw) / (ssd_bw + host_bw), 0.0)
    return float(lag.max(initial=0.0))


def swap_weights(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware,
                 bound: Bound) -> list[Move] | None:
    """NOTE [ Weights on the idle SSD ]: ``moves`` (simulated as ``sim``) with weights moved to the SSD
    and as many bytes of their optimizer states moved to host memory, where host memory holds them at
    every op; None where there is nothing to trade."""
    if hw.host_mem_bytes <= 0 or problem.num_ops == 0:
        return None
    lag = _lag_bytes(problem, moves, sim, hw, bound)
    pairs = _pairs(problem, moves) if lag > 0 else []
    total = sum(moves[mine[0]].size_bytes for mine, _ in pairs)
    if not total:
        return None
    out, n = list(moves), problem.num_ops
    held = host_held(problem, out)
    share, owed, traded = min(1.0, lag / total), 0.0, False
    for mine, theirs in pairs:  # every weight's share of the lag, a whole pair at a time
        size = out[mine[0]].size_bytes
        owed += share * size
        if owed < size / 2:
            continue
        change = np.zeros(n)
        for i, sign in [(i, -1.0) for i in mine] + [(i, 1.0) for i in theirs]:
            for a, b in fold(*host_span(out[i], n), n):
                change[a:b] += sign * size
        if (held + change).max() > max(hw.host_mem_bytes, held.max()):
            continue
        held += change
        owed -= size
        traded = True
        for i in mine:
            out[i] = replace(out[i], target="ssd")
        for i in theirs:
            out[i] = replace(out[i], target="host")
    return out if traded else None
