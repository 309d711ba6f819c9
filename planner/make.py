"""From a profile to a plan: plan each rank, simulate it, mark urgent transfers, summarise."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np

from planner.bound import Bound, iteration_bound
from planner.clean import keep_copies
from planner.early import by_deadline, prefetch_early
from planner.greedy import Move, Progress, plan_greedy
from planner.hardware import ComputeCosts, Hardware
from planner.job import predict_job, rank_ops
from planner.pace import DEFAULT_MARGINS, paced_durations
from planner.phases import phase_report
from planner.plan import Migration, Plan
from planner.problem import PlanProblem
from planner.rebalance import fill_host
from planner.simulate import SimResult, simulate
from planner.swap import swap_weights

__all__ = ["RankPlan", "build_plan", "job_summary", "plan_rank", "settle_urgency", "summarize"]

# Plans (of the greedy on its clocks) that go through the passes after it (``_after_greedy``).
FINISHED_CLOCKS = 2


@dataclass(frozen=True, eq=False)
class RankPlan:
    """One rank's moves and their simulation. ``settled``: every transfer an op waits on in
    ``sim`` is marked urgent (``settle_urgency``), but for most prefetches served by deadline (NOTE [
    Prefetch early, serve by deadline ] in ``planner.early``)."""

    problem: PlanProblem
    moves: tuple[Move, ...]
    sim: SimResult
    settled: bool = True


def settle_urgency(problem: PlanProblem, moves: Sequence[Move], bw_bytes_per_s: dict[str, float],
                   capacity_bytes: float, max_rounds: int = 4, *, sim: SimResult | None = None,
                   prefetches: bool = True, **costs: Unpack[ComputeCosts]) -> RankPlan:
    """Simulate, mark what ops waited on as urgent, and simulate again until nothing new waits.

    Marking only adds urgency. Urgent transfers are served first, which can make
    other ones late, and the marking need not settle: for Llama3-70B at batch 1
    with host memory, each of 44 rounds marked 6 or more transfers, and the
    prediction moved within 1%. After ``max_rounds`` it stops. The simulation
    returned is always of the moves returned (it was of the marking before the
    last one, 0.3% off there); where the marking did not settle (``settled``
    false), an op in it can wait on a transfer that is not urgent, and the
    runtime serves that one first once an op waits on it.
    ``costs``: ``Hardware.compute_costs()``, as ``planner.simulate.simulate`` takes them. ``sim``:
    the simulation of ``moves`` with these figures, if at hand.
    ``prefetches`` false marks offloads, and only those prefetches whose trigger and deadline fall in
    different iterations: on moves whose prefetches are served by deadline (NOTE [ Prefetch early,
    serve by deadline ] in ``planner.early``), any other one an op waits on is already served first.
    """

    def sim_of(moves: tuple[Move, ...]) -> SimResult:
        return simulate(problem, moves, bw_bytes_per_s, capacity_bytes, **costs)

    n = max(problem.num_ops, 1)
    current = tuple(moves)
    if sim is None:
        sim = sim_of(current)
    for round_ in range(max_rounds + 1):
        marked = tuple(
            mv.with_urgency(i in sim.waited_offloads, i in sim.waited_prefetches and (
                prefetches or mv.prefetch_trigger // n != mv.prefetch_deadline // n))
            for i, mv in enumerate(current)
        )
        if marked == current:
            return RankPlan(problem, current, sim)
        if round_ == max_rounds:
            break
        current = marked
        sim = sim_of(current)
    return RankPlan(problem, current, sim, settled=False)


def plan_rank(problem: PlanProblem, hw: Hardware, progress: Progress | None = None,
              margins: Sequence[float] = DEFAULT_MARGINS, finished_clocks: int = FINISHED_CLOCKS) -> RankPlan:
    """Plan one rank and simulate the plan: ``plan_greedy`` (which reports to ``progress`` on long
    work) on the ops' own clock and, when some window's transfers need more time than its ops take,
    on the clock paced by each of ``margins`` (NOTE [ Paced clock ] in ``planner.pace``). Each plan
    is simulated with its copies kept (NOTE [ Copies kept ] in ``planner.clean``); the
    ``finished_clocks`` that fit and run fastest each get SSD moves sent to idle host memory
    where that is faster (NOTE [ Host memory left idle ] in ``planner.rebalance``), its prefetches
    started early and served by deadline where that is faster (NOTE [ Prefetch early, serve by
    deadline ] in ``planner.early``; then host memory is filled again), its copies kept and its
    moves of one op dropped where that is faster (NOTE [ Moves of one op ]); the fastest of them has
    weights traded with optimizer states (NOTE [ Weights on the idle SSD ] in ``planner.swap``) and
    goes through those passes again where that is faster, and gets its urgent transfers marked
    (``settle_urgency``)."""
    bound = iteration_bound(problem, hw)
    # The greedy reserves a write for every offload, as if no copy were kept: a clock paced by the
    # bound that counts every write too is the better one for some plans (Llama3-70B at batch 16
    # with host memory: 529 s against 584 s), by the bound that leaves kept copies' writes out for
    # others (at batch 1: 63.8 s against 64.8 s). Both are tried.
    bounds = [("", bound)]
    if problem.unchanged is not None and problem.unchanged.any():
        bounds.append((", every write counted", iteration_bound(replace(problem, unchanged=None), hw)))
    clocks: list[tuple[str, np.ndarray]] = [("the ops' own clock", problem.duration_us)]
    for margin in margins:
        for what, b in bounds:
            paced = paced_durations(problem, b, margin)
            if paced is not None:
                clocks.append((f"the paced clock, margin {margin:g}{what}", paced))
    bw = hw.channel_bw()

    def sim_of(moves: Sequence[Move]) -> SimResult:
        return simulate(problem, moves, bw, hw.gpu_mem_bytes, **hw.compute_costs())

    scored: list[tuple[tuple[bool, float], str, list[Move], SimResult]] = []
    for i, (name, durations) in enumerate(clocks):
        if progress is not None and len(clocks) > 1:
            progress(f"planning on {name} ({i + 1} of {len(clocks)})")
        planned = plan_greedy(replace(problem, duration_us=durations), hw, progress=progress)
        sim = sim_of(planned)
        # Scored as it will run: with its copies kept (NOTE [ Copies kept ] in planner.clean).
        kept = _with_copies_kept(problem, planned, sim, hw, sim_of)[1]
        scored.append(((kept.fits, -kept.iteration_us), name, planned, sim))
    scored.sort(key=lambda t: t[0], reverse=True)  # stable: the earlier clock first on a tie
    # The passes after the greedy change the order now and then: the best few that fit (or the
    # best, if none does) go through them.
    finishing = [t for t in scored[:finished_clocks] if t[0][0]] or scored[:1]
    best: tuple[tuple[bool, float], list[Move], SimResult, bool] | None = None
    for j, (_, name, planned, sim) in enumerate(finishing):
        if progress is not None and len(finishing) > 1:
            progress(f"finishing the plan on {name} ({j + 1} of {len(finishing)})")
        moves, sim, served_by_deadline = _after_greedy(problem, planned, sim, hw, bound, sim_of)
        score = (sim.fits, -sim.iteration_us)
        if best is None or score > best[0]:
            best = (score, moves, sim, served_by_deadline)
    assert best is not None  # the ops' own clock is always tried
    _, moves, sim, served_by_deadline = best
    # NOTE [ Weights on the idle SSD ] in planner.swap: the finished plan's weights traded with
    # optimizer states, and the passes after the greedy run again, where that is faster.
    swapped = swap_weights(problem, moves, sim, hw, bound)
    if swapped is not None:  # its copies marked again at the end: the passes may split a pair
        swapped = [replace(mv, keep_copy=False, reuse_copy=False) for mv in swapped]
        again, again_sim, again_by_deadline = _after_greedy(problem, swapped, sim_of(swapped), hw, bound, sim_of)
        if (again_sim.fits and again_sim.host_peak_bytes <= max(hw.host_mem_bytes, sim.host_peak_bytes)
                and again_sim.iteration_us < sim.iteration_us):
            moves, sim, served_by_deadline = again, again_sim, served_by_deadline or again_by_deadline
    return settle_urgency(problem, moves, bw, hw.gpu_mem_bytes, **hw.compute_costs(), sim=sim,
                          prefetches=not served_by_deadline)


def _after_greedy(problem: PlanProblem, planned: list[Move], sim: SimResult, hw: Hardware, bound: Bound,
                  sim_of: Callable[[Sequence[Move]], SimResult]) -> tuple[list[Move], SimResult, bool]:
    """The greedy's ``planned`` (simulated as ``sim``) with SSD moves sent to idle host memory, its
    prefetches started early and served by deadline (then host memory filled again), its copies kept
    and its moves of one op dropped (NOTE [ Moves of one op ]), each where faster; their simulation,
    and whether the prefetches are served by deadline."""
    moves, sim = fill_host(problem, planned, sim, hw, bound, sim_of)
    early = by_deadline(prefetch_early(problem, moves, sim, hw.gpu_mem_bytes), problem.num_ops)
    early_sim = sim_of(early)
    served_by_deadline = early_sim.fits and early_sim.iteration_us < sim.iteration_us
    if served_by_deadline:
        # Reads that start earlier leave other windows bound by the SSD: fill host memory again.
        moves, sim = fill_host(problem, early, early_sim, hw, bound, sim_of)
    moves, sim = _with_copies_kept(problem, moves, sim, hw, sim_of)
    moves, sim = _without_one_op_moves(problem, moves, sim, hw, sim_of)
    return moves, sim, served_by_deadline


def _with_copies_kept(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware,
                      sim_of: Callable[[Sequence[Move]], SimResult]) -> tuple[list[Move], SimResult]:
    """``moves`` (simulated as ``sim``) with their copies kept (``keep_copies``) and its simulation,
    where that fits and is no slower; else ``moves`` and ``sim``."""
    kept = keep_copies(problem, moves, hw.host_mem_bytes)
    if any(mv.reuse_copy for mv in kept):
        kept_sim = sim_of(kept)
        if (kept_sim.fits and kept_sim.host_peak_bytes <= max(hw.host_mem_bytes, sim.host_peak_bytes)
                and kept_sim.iteration_us <= sim.iteration_us):
            return kept, kept_sim
    return list(moves), sim


# NOTE [ Moves of one op ]: the stall fixes (NOTE [ Stall fixes ] in planner.greedy) may take a
# period two ops long: out at the op after its last use, needed at the op after that. Its bytes
# are free for that one op, and its read, which starts only then, makes the next op wait for all
# of it. The greedy takes such a period where its count of memory (each move's bytes free only
# over its window) has that op over capacity; after the passes that follow it the simulation often
# has room there. And where a weight's periods on either side of such a period are in one place
# and it in the other, they cannot share a kept copy (NOTE [ Copies kept ] in planner.clean). At Llama3-70B,
# batch 16, with host memory: 1,105 such moves, 896 MiB weights among them each making an op wait
# 38 ms; without them, copies kept again, 522.5 s against 529.1 s. So they are dropped where the
# plan without them, its copies kept again, fits and is faster.
def _without_one_op_moves(problem: PlanProblem, moves: Sequence[Move], sim: SimResult, hw: Hardware,
                          sim_of: Callable[[Sequence[Move]], SimResult]) -> tuple[list[Move], SimResult]:
    """``moves`` (simulated as ``sim``) without those of periods two ops long (NOTE [ Moves of one
    op ]), their copies kept again, and its simulation, where that fits and is faster; else ``moves``
    and ``sim``."""
    rest = [replace(mv, keep_copy=False, reuse_copy=False) for mv in moves
            if not (mv.reads_back and mv.end_op - mv.start_op <= 2)]
    if len(rest) == len(moves):
        return list(moves), sim
    rest, rest_sim = _with_copies_kept(problem, rest, sim_of(rest), hw, sim_of)
    if (rest_sim.fits and rest_sim.host_peak_bytes <= max(hw.host_mem_bytes, sim.host_peak_bytes)
            and rest_sim.iteration_us < sim.iteration_us):
        return rest, rest_sim
    return list(moves), sim


def summarize(rank_plan: RankPlan, hw: Hardware) -> dict[str, Any]:
    """The plan report's numbers (also plan.json's ``summary``)."""
    p, sim, moves = rank_plan.problem, rank_plan.sim, rank_plan.moves
    to = {"ssd": 0, "host": 0}
    for mv in moves:
        if not mv.reuse_copy:  # NOTE [ Copies kept ]: freed against its kept copy, nothing written
            to[mv.target] += mv.size_bytes
    util = sim.utilisation()
    bound = iteration_bound(p, hw)
    scratch = p.scratch
    return {
        "num_ops": p.num_ops,
        "num_inactive_periods": p.num_periods,
        "gpu_mem_bytes": hw.gpu_mem_bytes,
        "peak_before_bytes": int(p.memory_bytes.max()) if p.num_ops else 0,
        "peak_after_bytes": sim.peak_bytes,
        # the same without the ops' scratch (NOTE [ Scratch ] in torch_patch.tracer): what the
        # runtime's tracked bytes reach
        "peak_tracked_after_bytes": int((sim.resident_bytes - scratch).max()) if p.num_ops else 0,
        "max_scratch_bytes": int(scratch.max()) if p.num_ops else 0,
        "fits": sim.fits,
        "ideal_iteration_us": sim.ideal_iteration_us,
        "predicted_iteration_us": sim.iteration_us,
        "slowdown": sim.slowdown,
        # NOTE [ Transfer bound ] in planner.bound: no plan that fits is faster than bound_us.
        "bound_us": bound.iteration_us,
        "bound_peak_us": bound.peak_us,
        "bound_phases_us": bound.phases_us,
        "bound_merged_us": bound.merged_us,
        "bound_ratio": sim.iteration_us / bound.iteration_us if bound.iteration_us > 0 else 1.0,
        "stall_us": sim.stall_us,
        # NOTE [ Copies on the compute ]: what the ops took beyond their profiled time
        "copy_charge_us": sim.copy_charge_us,
        "op_overhead_us": sim.op_overhead_us,
        "refault_us": sim.refault_us,
        "num_stalled_ops": sim.num_stalls,
        "num_migrations": sum(1 + mv.reads_back for mv in moves),
        "num_offload_only": sum(not mv.reads_back for mv in moves),
        "num_urgent": sum(mv.urgent_offload + mv.urgent_prefetch for mv in moves),
        "bytes_to_ssd": to["ssd"],
        "bytes_to_host": to["host"],
        "bytes_reused": sum(mv.size_bytes for mv in moves if mv.reuse_copy),
        "num_reused": sum(mv.reuse_copy for mv in moves),
        "host_peak_bytes": sim.host_peak_bytes,
        "bandwidth_utilisation": util,
        # NOTE [ Where the time goes ] in planner.phases
        "phases": phase_report(p, sim, bound),
    }


def job_summary(rank_plans: Mapping[int, RankPlan]) -> dict[str, Any]:
    """The job's keys of a plan summary, from all ranks' simulations together (``planner.job``):
    ``job_iteration_us`` (stalls included), ``job_ideal_iteration_us`` (none), ``job_slowdown``,
    ``critical_rank`` and ``critical_us_by_rank``. Raises ``JobGraphError`` when the ranks'
    communication does not fit together."""
    job = predict_job({r: rank_ops(rp.problem, rp.sim) for r, rp in rank_plans.items()})
    ideal = predict_job({r: rank_ops(rp.problem) for r, rp in rank_plans.items()})
    return {
        "job_iteration_us": job.iteration_us,
        "job_ideal_iteration_us": ideal.iteration_us,
        "job_slowdown": job.iteration_us / ideal.iteration_us if ideal.iteration_us else 1.0,
        "critical_rank": job.critical_rank,
        "critical_us_by_rank": {str(r): us for r, us in job.critical_us_by_rank.items()},
    }


def _fold(op: int, n: int) -> int:
    return op % n if n else 0


def _when(pair: np.ndarray) -> tuple[float | None, float | None]:
    return tuple(None if math.isnan(x) else float(x) for x in pair)  # type: ignore[return-value]


def migrations_of(rank_plan: RankPlan) -> list[Migration]:
    """The plan.json migrations of one rank, sorted by trigger op then priority."""
    n = rank_plan.problem.num_ops
    sim = rank_plan.sim
    out: list[tuple[int, int, Migration]] = []
    for i, mv in enumerate(rank_plan.moves):
        wraps = mv.end_op >= n
        common: dict[str, Any] = {
            "tensor_id": mv.tensor_id, "size_bytes": mv.size_bytes, "place": mv.target,
            "wraps": wraps, "period_start_op": mv.start_op, "period_end_op": mv.end_op,
            "name": rank_plan.problem.names.get(mv.tensor_id),
        }
        off_start, off_end = _when(sim.offload_us[i])
        pre_start, pre_end = _when(sim.prefetch_us[i])
        off_deadline = mv.offload_deadline if mv.offload_deadline >= 0 else mv.prefetch_trigger
        out.append((_fold(mv.offload_trigger, n), mv.priority, Migration(
            action="offload", trigger_op=_fold(mv.offload_trigger, n),
            deadline_op=_fold(off_deadline, n), start_us=off_start, end_us=off_end,
            urgent=mv.urgent_offload, priority=mv.priority, reuse_copy=mv.reuse_copy, **common)))
        if not mv.reads_back:
            continue  # a trailing period: the storage dies out there (planner.plan)
        out.append((_fold(mv.prefetch_trigger, n), mv.read_priority, Migration(
            action="prefetch", trigger_op=_fold(mv.prefetch_trigger, n),
            deadline_op=_fold(mv.prefetch_deadline, n), start_us=pre_start, end_us=pre_end,
            urgent=mv.urgent_prefetch, priority=mv.read_priority, keep_copy=mv.keep_copy, **common)))
    out.sort(key=lambda t: (t[0], t[1]))
    return [m for _, _, m in out]


def build_plan(rank_plans: dict[int, RankPlan], hw: Hardware, signature: str,
               comparison: dict[str, Any] | None = None,
               extra_parameters: dict[str, Any] | None = None, first: Plan | None = None,
               carried_into_next: dict[int, dict[int, int]] | None = None, *,
               job: Mapping[str, Any] | None = None, world_size: int | None = None,
               signatures: Mapping[int, str] | None = None,
               kept_for_good: Mapping[int, dict[int, dict[int, int]]] | None = None) -> Plan:
    """The plan.json model of ``rank_plans``; ``summary`` is the slowest rank's, with ``job``'s
    keys (``job_summary``) when given. ``first`` is iteration 0's plan, ``carried_into_next`` its
    map of the storages it hands on (NOTE [ The first iteration's plan ] in ``planner.plan``),
    ``kept_for_good`` the profile's (NOTE [ Kept for good ] in ``torch_patch.tracer``);
    ``world_size`` and ``signatures`` (rank -> profile signature) say which job the plan is for
    (NOTE [ Plans of a job ])."""
    by_rank = {r: summarize(rp, hw) for r, rp in rank_plans.items()}
    worst = max(by_rank, key=lambda r: by_rank[r]["predicted_iteration_us"])
    parameters = {
        "gpu_mem_bytes": hw.gpu_mem_bytes,
        "ssd_bw_bytes_per_s": hw.ssd_read_bw_bytes_per_s,
        "ssd_read_bw_bytes_per_s": hw.ssd_read_bw_bytes_per_s,
        "ssd_write_bw_bytes_per_s": hw.ssd_write_bw_bytes_per_s,
        "host_bw_bytes_per_s": hw.host_bw_bytes_per_s,
        "host_mem_bytes": hw.host_mem_bytes,
        "copy_cost_s_per_byte": hw.copy_cost_s_per_byte,
        "op_overhead_s": hw.op_overhead_s,
        "refault_s_per_byte": hw.refault_s_per_byte,
        "transfer_cost_s": hw.transfer_cost_s,
        "transfer_latency_s": hw.transfer_latency_s,
        "ssd_duplex": hw.ssd_duplex,
        "host_duplex": hw.host_duplex,
        **(extra_parameters or {}),
    }
    return Plan(
        signature=signature, parameters=parameters, summary={"rank": worst, **by_rank[worst], **(job or {})},
        migrations={r: migrations_of(rp) for r, rp in rank_plans.items()},
        op_names={r: list(rp.problem.op_names) for r, rp in rank_plans.items()},
        made_bytes={r: rp.problem.made_bytes.tolist() for r, rp in rank_plans.items()},
        summary_by_rank=by_rank, comparison=comparison or {}, first=first,
        carried_into_next=carried_into_next or {}, world_size=world_size,
        signatures=dict(signatures or {}), kept_for_good=dict(kept_for_good or {}),
    )
