"""Baseline policies, run in the same simulator as the planner (DESIGN.md section 10).

Each baseline is the best faithful version of the system it stands for:

- ``ideal``: keep everything, infinite memory: the ops back to back.
- ``activation_offload`` (the SSD activation-offload work): every saved
  activation (a tensor made in forward and next used, or freed unused, in
  backward) goes to the SSD as soon as it is produced, in production order;
  backward prefetches one layer ahead (none freed unused comes back): the
  activations a layer's backward needs start coming back when the backward of
  the layer before it (in execution order) starts, in that order. Parameters,
  gradients and optimizer state stay.
- ``zero_offload`` (ZeRO-Offload/Infinity-like): optimizer state lives in host
  memory (in the SSD when parameters, gradients and optimizer state do not
  all fit the host-memory limit: ZeRO-Infinity), the optimizer step runs on the
  CPU, parameters stream in one layer ahead and leave after each use (to host,
  or the SSD under ZeRO-Infinity), gradients leave the device as they are
  finished; activations stay. The model is generous to the baseline: the
  CPU step runs at the memory-bandwidth bound of CPU-Adam (NOTE [ CPU-Adam
  throughput ] in ``planner.hardware``), overlapped with nothing; under
  ZeRO-Infinity it is also bound by reading and writing the optimizer state and
  fp32 parameters on the SSD; gradient device-to-host copies are free (a
  gradient's memory is released after its last backward use).

"Layer" is the module path up to its first numeric component
(``layers.3.attn.q`` -> ``layers.3``), separately in each phase (forward,
backward); ops with no module join the layer before them. Without module names every op is its own layer.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from planner.greedy import Move
from planner.hardware import Hardware
from planner.make import RankPlan, settle_urgency
from planner.problem import PlanProblem, problem_from_profile
from planner.simulate import simulate
from profiles import Profile

__all__ = ["BASELINES", "activation_offload", "ideal", "layer_of_ops", "run_baselines", "zero_offload"]

BASELINES = ("ideal", "activation_offload", "zero_offload")
_LAYER = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def layer_of_ops(problem: PlanProblem) -> tuple[np.ndarray, np.ndarray]:
    """``(segment of each op, first op of each segment)``: runs of ops of one layer."""
    keys: list[object] = []
    prev: object = None
    for mod, phase in zip(problem.module.tolist(), problem.phase.tolist(), strict=True):
        if isinstance(mod, str) and mod:
            m = _LAYER.match(mod)
            prev = m.group(1) if m else mod
        keys.append(None if prev is None else (phase, prev))
    n = problem.num_ops
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if all(k is None for k in keys):
        idx = np.arange(n)
        return idx, idx
    change = np.r_[True, np.array([a != b for a, b in zip(keys[1:], keys[:-1], strict=True)], bool)]
    seg = np.cumsum(change) - 1
    return seg, np.flatnonzero(change)


def _one_layer_ahead(problem: PlanProblem, end_op: np.ndarray) -> np.ndarray:
    """Unrolled op at which the layer before the one holding ``end_op`` starts."""
    n = problem.num_ops
    seg, seg_start = layer_of_ops(problem)
    base = end_op - end_op % n
    own_start = seg_start[seg[end_op % n]] + base  # first op of end_op's layer
    prev = own_start - 1
    prev_base = np.where(prev >= 0, prev - prev % n, -n)
    return seg_start[seg[prev % n]] + prev_base


def ideal(problem: PlanProblem) -> RankPlan:
    """Infinite memory: nothing moves, nothing waits."""
    bw = dict.fromkeys(("ssd_write", "ssd_read", "host_write", "host_read"), 1.0)
    return RankPlan(problem, (), simulate(problem, (), bw, float("inf")))


def _moves(problem: PlanProblem, rows: np.ndarray, target: str) -> list[Move]:
    """Out after the last use, back one layer ahead; a trailing period is never fetched back."""
    s, e, back = problem.start_op[rows], problem.end_op[rows], problem.reads_back[rows]
    fetch = np.where(back, np.clip(_one_layer_ahead(problem, e), s + 1, e), e)
    return [
        Move(period=int(i), tensor_id=int(problem.tensor_id[i]), size_bytes=int(problem.size_bytes[i]),
             target=target, start_op=int(a), end_op=int(b), offload_trigger=int(a) + 1, offload_deadline=-1,
             prefetch_trigger=int(f), prefetch_deadline=int(b), priority=int(a), prefetch_priority=int(f),
             reads_back=bool(r))
        for i, a, b, f, r in zip(rows.tolist(), s.tolist(), e.tolist(), fetch.tolist(), back.tolist(),
                                 strict=True)
    ]


def activation_offload(problem: PlanProblem, hw: Hardware) -> RankPlan:
    """Every saved activation to the SSD as produced, prefetched one layer ahead in backward."""
    n = problem.num_ops
    phase_start = problem.phase[problem.start_op % max(n, 1)] if n else problem.phase
    phase_end = problem.phase[problem.end_op % max(n, 1)] if n else problem.phase
    rows = np.flatnonzero((problem.kind == "activation") & (phase_start == "forward")
                          & (phase_end == "backward") & (problem.end_op - problem.start_op >= 2))
    moves, sim = settle_urgency(problem, _moves(problem, rows, "ssd"), hw.channel_bw(), hw.gpu_mem_bytes,
                                copy_cost_s_per_byte=hw.copy_cost_s_per_byte)  # not teraio's own costs
    return RankPlan(problem, moves, sim)


def _itemsize(dtype: object) -> int:
    return _ITEMSIZE.get(str(dtype).removeprefix("torch."), 4)


def zero_problem(profile: Profile, hw: Hardware, rank: int = 0) -> tuple[PlanProblem, str]:
    """The profile as ZeRO runs it: optimizer on the CPU, optimizer state off the device."""
    first = profile.kernels_of(rank)["iteration"].iloc[0] if len(profile.kernels) else 0
    kernels = profile.kernels_of(rank, first).copy()
    tensors = profile.tensors_of(rank).copy()
    accesses = profile.accesses_of(rank, first).copy()
    kind_of = tensors.set_index("tensor_id")["kind"]
    state_bytes = int(tensors.loc[tensors["kind"] == "optimizer_state", "size_bytes"].sum())
    params = tensors[tensors["kind"] == "param"]
    param_bytes = int(params["size_bytes"].sum())
    grad_bytes = int(tensors.loc[tensors["kind"] == "grad", "size_bytes"].sum())
    infinity = param_bytes + grad_bytes + state_bytes > hw.host_mem_bytes
    num_params = float((params["size_bytes"] / params["dtype"].map(_itemsize)).sum())
    step_us = num_params / hw.cpu_adam_params_per_s * 1e6
    if infinity:  # moments and fp32 master weights stream through the SSD each step
        step_us = max(step_us, (state_bytes + param_bytes) / hw.ssd_read_bw_bytes_per_s * 1e6,
                      (state_bytes + param_bytes) / hw.ssd_write_bw_bytes_per_s * 1e6)
    opt = (kernels["phase"] == "optimizer").to_numpy()
    if opt.any():
        d = kernels.loc[opt, "duration_us"].to_numpy(np.float64)
        share = d / d.sum() if d.sum() > 0 else np.full(len(d), 1 / len(d))
        kernels.loc[opt, "duration_us"] = step_us * share
        dur = kernels["duration_us"].to_numpy(np.float64)
        kernels["start_us"] = np.concatenate([[0.0], np.cumsum(dur)[:-1]])
    opt_ops = kernels.loc[opt, "op_index"].to_numpy()
    acc_kind = accesses["tensor_id"].map(kind_of).to_numpy()
    on_cpu = accesses["op_index"].isin(opt_ops).to_numpy()
    keep = ~(on_cpu & np.isin(acc_kind, ["param", "grad"])) & (acc_kind != "optimizer_state")
    accesses = accesses[keep]
    tensors = tensors[tensors["kind"] != "optimizer_state"].copy()
    # Gradients leave the device after their last backward use (device-to-host copy not charged).
    span = accesses.groupby("tensor_id")["op_index"].agg(["min", "max"])
    grads = (tensors["kind"] == "grad").to_numpy()
    gspan = span.reindex(tensors.loc[grads, "tensor_id"])
    used = gspan["min"].notna().to_numpy()
    tensors.loc[grads, "persistent"] = ~used
    tensors.loc[grads, "alloc_op"] = np.where(used, gspan["min"].fillna(-1).to_numpy(), -1).astype(np.int32)
    tensors.loc[grads, "free_op"] = np.where(used, gspan["max"].fillna(-2).to_numpy() + 1, -1).astype(np.int32)
    prof = replace(profile, kernels=kernels, tensors=tensors, accesses=accesses)
    return problem_from_profile(prof, rank), "zero_infinity" if infinity else "zero_offload"


def zero_offload(profile: Profile, hw: Hardware, rank: int = 0) -> tuple[str, RankPlan]:
    """ZeRO-Offload (or -Infinity when the host limit is too small): see the module docstring."""
    problem, name = zero_problem(profile, hw, rank)
    target = "ssd" if name == "zero_infinity" else "host"
    rows = np.flatnonzero((problem.kind == "param") & (problem.end_op - problem.start_op >= 2))
    moves, sim = settle_urgency(problem, _moves(problem, rows, target), hw.channel_bw(), hw.gpu_mem_bytes,
                                copy_cost_s_per_byte=hw.copy_cost_s_per_byte)  # not teraio's own costs
    return name, RankPlan(problem, moves, sim)


def run_baselines(profile: Profile, problem: PlanProblem, hw: Hardware, rank: int = 0) -> dict[str, RankPlan]:
    """Every baseline on one rank, by name."""
    out = {"ideal": ideal(problem), "activation_offload": activation_offload(problem, hw)}
    name, rp = zero_offload(profile, hw, rank)
    # Its ops differ (the optimizer runs on the CPU): compare it with the real ideal.
    out[name] = replace(rp, sim=replace(rp.sim, ideal_iteration_us=problem.ideal_iteration_us))
    return out
