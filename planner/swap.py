"""NOTE [ Weights on the idle SSD ]: the greedy takes the SSD first and host memory for what the
SSD cannot carry (``planner.greedy``). A weight and its optimizer states are all written in the
optimizer step, where the states' writes fill the SSD, so the weights land in host memory. Then
every pass that reads the weights reads them all from host memory while the SSD reads little: for
Llama3-70B at batch 1 with 512 GiB of host memory, the forward pass read 263 GiB from host memory
and took 10.9 s against 9.1 s of ops, with the SSD's reads idle (BENCHMARKS.md, bench/policies.py).

A weight whose moves are all in host memory and one of its optimizer states of the same size whose
moves are all on the SSD can trade places. The step writes and reads the same bytes on each link as
before (the weight's where the state's were), and host memory holds the same bytes (both are out
from one step to the next); but the passes that read the weight now read it from the SSD. So
``swap_weights`` trades enough pairs to even out the two links' reads in the window where host
memory's reads lag furthest behind the SSD's, spread over the whole model, so that each part of
that window gains alike. ``planner.make`` trades on the plan the passes after the greedy have
finished, runs those passes again on it (host memory filled first, ``planner.rebalance``: the reads
taken off host memory's link make room there for writes the SSD cannot carry), and keeps the trade
only where the plan so made is faster.
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
    by_name = {name: tid for tid, name in problem.names.items()}
    kind = dict(zip(problem.tensor_id.tolist(), problem.kind.tolist(), strict=True))
    n = problem.num_ops

    def only(tid: int, target: str) -> bool:
        return all(moves[i].target == target for i in chains[tid])

    pairs = []
    for tid, mine in chains.items():
        if kind[tid] != "param" or tid not in problem.names or not only(tid, "host"):
            continue
        for name in sorted(by_name):  # the states named after it: "<weight>.exp_avg", ...
            state = by_name[name]
            if (name.startswith(problem.names[tid] + ".") and kind.get(state) == "optimizer_state"
                    and state in chains and moves[chains[state][0]].size_bytes == moves[mine[0]].size_bytes
                    and only(state, "ssd")):
                pairs.append((min(moves[i].end_op % n for i in mine), mine, chains[state]))
                break
    return [(mine, theirs) for _, mine, theirs in sorted(pairs, key=lambda p: p[0])]


def _lag_bytes(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware, bound: Bound) -> float:
    """The bytes of reads to take from host memory to the SSD so that the two links would finish
    together, in the phase window above its bound where host memory's reads lag furthest behind."""
    bw = hw.channel_bw()
    ssd_bw, host_bw = bw["ssd_read"], bw["host_read"]
    first = bound.window_first_op
    at = np.array([mv.end_op % problem.num_ops for mv in moves if mv.reads_back], np.int64)
    window = np.searchsorted(first, at, side="right") - 1
    size = np.array([mv.size_bytes for mv in moves if mv.reads_back], np.float64)
    on_host = np.array([mv.target == "host" for mv in moves if mv.reads_back], bool)
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
    pairs = _pairs(problem, moves)
    total = sum(moves[mine[0]].size_bytes for mine, _ in pairs)
    if lag <= 0 or not total:
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
