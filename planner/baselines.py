"""Baseline policies, run in the same simulator as the planner (DESIGN.md section 10).

Each baseline is the best faithful version of the system it stands for, and
one that does not fit the device is run as its users would make it fit:

- ``ideal``: keep everything, infinite memory: the ops back to back.
- ``activation_offload`` (TBA, ``shared/papers/ssd-activation-offloading-
  tba.txt``): every saved activation (made in forward, next used, or freed
  unused, in backward) goes to the SSD as soon as it is produced, in production
  order; backward prefetches one layer ahead: the activations a layer's backward
  needs start coming back when the backward of the layer before it (in
  execution order) starts, the first layer's when backward starts ("TBA starts
  loading when it is switched to backward", its Figure 4). Parameters, gradients and optimizer state stay.
  When those alone do not fit (fp32 AdamW keeps 16 bytes a parameter), its
  users run it under DeepSpeed ZeRO, which TBA works with (the paper, section
  3): ``activation_offload+zero_offload`` or ``+zero_infinity``, the model
  states as below and the activations to the SSD as here; the gradients'
  device-to-host copies are then left free (generous to the baseline: the
  simulator has one write channel besides the SSD's, and the parameters' free
  release takes it).
- ``zero_offload`` (ZeRO-Offload, ZeRO stage 2 with the optimizer on the CPU):
  parameters stay on the device; gradients leave it as each micro-batch's
  backward finishes them (a device-to-host copy at ``host_bw``, accumulated in
  host memory, so none is read back); fp32 master parameters, gradients and
  Adam moments (16 bytes a parameter) live in host memory, and it runs only
  when they fit ``host_mem_bytes`` (for Llama3-70B they do not, as in the
  Teraio paper); the step runs on the CPU, then the updated parameters are
  copied back (``param_bytes / host_bw``), the device idle meanwhile.
- ``zero_infinity`` (ZeRO stage 3 with offload): as above, but parameters
  live off the device and stream in one layer ahead of each use (from host
  memory at ``host_bw``, or through it from the SSD at the slower of the two
  when the master copy does not fit host memory beside the gradients) and are
  dropped after it, with no write (the master copy is off the device); the
  moments (and then the master parameters) live on the SSD when the 16 bytes
  a parameter do not fit host memory, and the CPU step also reads and writes
  them there.
- ``+ckpt``: a ZeRO baseline that does not fit runs with activation
  checkpointing per transformer block, as DeepSpeed's documentation advises
  for large models: only each block's input is kept; the other activations
  saved in a block are freed after its forward and recomputed when its
  backward starts, which takes the block's forward time again.

The CPU step runs at the memory-bandwidth bound of CPU-Adam (NOTE [ CPU-Adam
throughput ] in ``planner.hardware``; on a CPU profile, whose step ran on that
CPU, at no less than its measured time), overlapped with nothing, as DeepSpeed
runs it without its delayed parameter update; with the moments on the SSD it is
also bound by reading and writing them there once (the reads and writes
overlapped).

NOTE [ Layers in backward ]: a baseline prefetches "one layer ahead", so it
needs each op's layer. Forward ops have module paths (``layers.3.attention.
wq``: layer ``layers.3``, the path up to its first numeric component); backward
ops run in the autograd engine and have none. A backward op belongs to the
layer whose forward saved the newest of the tensors it reads (a tensor idle
from a forward op until it); a backward op that reads none belongs to the layer
of the op before it. Without this, the whole backward is one "layer" and every
saved tensor is prefetched when the forward's last layer starts: on the
example trainer of ``make demo`` that brought every offloaded activation back
before the memory peak at the end of forward and left the peak where it was.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd

from planner.bound import phase_windows
from planner.greedy import Move
from planner.hardware import Hardware
from planner.make import RankPlan, settle_urgency
from planner.problem import (
    PlanProblem,
    median_durations_us,
    op_scratch_bytes,
    previous_periods,
    problem_from_profile,
)
from planner.simulate import FREE_BW, simulate
from profiles import Profile

__all__ = ["BASELINES", "activation_offload", "checkpointed", "ideal", "layer_of_ops", "run_baselines",
           "zero_offload", "zero_problem"]

BASELINES = ("ideal", "activation_offload", "zero_offload", "zero_infinity")
_LAYER = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _module_layers(problem: PlanProblem) -> np.ndarray:
    """(num_ops,) object: each op's layer from its module path, or None."""
    out = np.full(problem.num_ops, None, object)
    for k, mod in enumerate(problem.module.tolist()):
        if isinstance(mod, str) and mod:
            m = _LAYER.match(mod)
            out[k] = m.group(1) if m else mod
    return out


def _op_layers(problem: PlanProblem) -> np.ndarray:
    """(num_ops,) object: each op's layer, backward ops included (NOTE [ Layers in backward ])."""
    n = problem.num_ops
    layer = _module_layers(problem)
    if n == 0:
        return layer
    s, e = problem.start_op, problem.end_op % n
    has_layer = np.array([x is not None for x in layer], bool)
    saved = (problem.phase[s % n] == "forward") & (problem.phase[e] == "backward") & has_layer[s % n]
    newest = np.full(n, -1, np.int64)
    np.maximum.at(newest, e[saved], s[saved] % n)
    fill = (layer == None) & (newest >= 0)  # noqa: E711 (elementwise on an object array)
    layer[fill] = layer[newest[fill]]
    prev: object = None
    for k in range(n):  # the rest join the layer of the op before them
        if layer[k] is None:
            layer[k] = prev
        prev = layer[k]
    return layer


def layer_of_ops(problem: PlanProblem) -> tuple[np.ndarray, np.ndarray]:
    """``(segment of each op, first op of each segment)``: runs of ops of one phase and one layer."""
    n = problem.num_ops
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    layer = _op_layers(problem)
    if all(x is None for x in layer):
        idx = np.arange(n)
        return idx, idx
    keys = list(zip(problem.phase.tolist(), layer.tolist(), strict=True))
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


def _phase_start(problem: PlanProblem, end_op: np.ndarray) -> np.ndarray:
    """Unrolled op at which the run of ops of one phase holding ``end_op`` starts."""
    n = problem.num_ops
    first = phase_windows(problem)
    return first[np.searchsorted(first, end_op % n, side="right") - 1] + (end_op - end_op % n)


def _moves(problem: PlanProblem, rows: np.ndarray, target: str, reads_back: bool = True,
           in_phase: bool = False) -> list[Move]:
    """Out after the last use, back one layer ahead (with ``in_phase``, not before the phase of the
    use starts); a trailing period (or every one, with ``reads_back`` false: the next use makes the
    tensor anew) is never fetched back."""
    s, e = problem.start_op[rows], problem.end_op[rows]
    back = problem.reads_back[rows] & reads_back
    ahead = _one_layer_ahead(problem, e)
    if in_phase:
        ahead = np.maximum(ahead, _phase_start(problem, e))
    fetch = np.where(back, np.clip(ahead, s + 1, e), e)
    return [
        Move(period=int(i), tensor_id=int(problem.tensor_id[i]), size_bytes=int(problem.size_bytes[i]),
             target=target, start_op=int(a), end_op=int(b), offload_trigger=int(a) + 1, offload_deadline=-1,
             prefetch_trigger=int(f), prefetch_deadline=int(b), priority=int(a), prefetch_priority=int(f),
             reads_back=bool(r))
        for i, a, b, f, r in zip(rows.tolist(), s.tolist(), e.tolist(), fetch.tolist(), back.tolist(),
                                 strict=True)
    ]


def _saved_activations(problem: PlanProblem) -> np.ndarray:
    """Periods of activations made in forward and next used (or freed unused) in backward."""
    n = max(problem.num_ops, 1)
    return np.flatnonzero((problem.kind == "activation") & (problem.phase[problem.start_op % n] == "forward")
                          & (problem.phase[problem.end_op % n] == "backward")
                          & (problem.end_op - problem.start_op >= 2))


def activation_offload(problem: PlanProblem, hw: Hardware) -> RankPlan:
    """Every saved activation to the SSD as produced, prefetched one layer ahead in backward."""
    planned = _moves(problem, _saved_activations(problem), "ssd", in_phase=True)
    return settle_urgency(problem, planned, hw.channel_bw(), hw.gpu_mem_bytes,
                          copy_cost_s_per_byte=hw.copy_cost_s_per_byte,  # not teraio's own costs
                          ssd_duplex=hw.ssd_duplex, host_duplex=hw.host_duplex)  # the devices' own


def _itemsize(dtype: object) -> int:
    return _ITEMSIZE.get(str(dtype).removeprefix("torch."), 4)


def checkpointed(problem: PlanProblem, profile: Profile, rank: int = 0) -> PlanProblem:
    """``problem`` under activation checkpointing per transformer block (see the module docstring).

    A saved activation whose forward accesses all fall in one numbered layer (a block) is recomputed:
    it is not alive from its last forward use to the first op of its backward layer, and that op
    takes the block's forward time again. A block's input (made in the layer before) is kept.
    """
    n = problem.num_ops
    layer = _op_layers(problem)
    seg, seg_start = layer_of_ops(problem)
    acc = profile.accesses_of(rank, None)
    fwd = problem.phase[acc["op_index"].to_numpy()] == "forward"
    acc_layer = pd.Series(layer[acc["op_index"].to_numpy()[fwd]], index=acc["tensor_id"].to_numpy()[fwd])
    numbered = acc_layer.map(lambda x: isinstance(x, str) and _LAYER.match(x) is not None)
    per_tensor = acc_layer.groupby(level=0).nunique()
    inside = set(per_tensor.index[per_tensor.to_numpy() == 1]) & set(numbered.index[numbered.to_numpy()])
    rows = _saved_activations(problem)
    rows = rows[np.isin(problem.tensor_id[rows], np.fromiter(inside, np.int64, len(inside)))]
    memory = problem.memory_bytes.copy()
    duration = problem.duration_us.copy()
    fwd_time = np.bincount(seg, weights=problem.duration_us)
    recompute: dict[int, int] = {}  # first op of a backward layer -> the forward segment it recomputes
    for i in rows.tolist():
        s, e = int(problem.start_op[i]), int(problem.end_op[i])
        r = int(seg_start[seg[e % n]]) + (e - e % n)  # the backward layer's first op, unrolled
        if r <= s + 1:
            continue
        lo, hi = s + 1, r
        for a, b in ((lo, min(hi, n)), (max(lo, n) - n, max(hi, n) - n)):
            memory[a:b] -= problem.size_bytes[i]
        recompute[r % n] = max(recompute.get(r % n, -1), int(seg[s % n]))
    for r, fseg in recompute.items():
        duration[r] += fwd_time[fseg]
    keep = np.ones(problem.num_periods, bool)
    keep[rows] = False
    return replace(problem, memory_bytes=memory, duration_us=duration, tensor_id=problem.tensor_id[keep],
                   size_bytes=problem.size_bytes[keep], kind=problem.kind[keep], start_op=problem.start_op[keep],
                   end_op=problem.end_op[keep], reads_back=problem.reads_back[keep],
                   unchanged=_unchanged_kept(problem, keep))


def _unchanged_kept(problem: PlanProblem, keep: np.ndarray) -> np.ndarray | None:
    """``problem.unchanged`` of the periods ``keep`` keeps, false where the previous one is dropped
    (the one before that, now its previous, may not hold the same bytes)."""
    if problem.unchanged is None:
        return None
    prev = previous_periods(problem.tensor_id, problem.start_op)
    return (problem.unchanged & keep[prev])[keep]


def zero_problem(profile: Profile, hw: Hardware, rank: int = 0) -> tuple[PlanProblem, str]:
    """The profile as ZeRO runs it: optimizer on the CPU, optimizer state off the device; and which
    ZeRO: ``zero_offload`` when the model states fit host memory, else ``zero_infinity``."""
    problem, info = _zero(profile, hw, rank, stage=2)
    if not info["host_fits"]:
        problem, info = _zero(profile, hw, rank, stage=3)
    return problem, str(info["name"])


def _zero(profile: Profile, hw: Hardware, rank: int, stage: int) -> tuple[PlanProblem, dict[str, object]]:
    """The ZeRO problem of ``stage`` (2: ZeRO-Offload, 3: ZeRO-Infinity) and its placement."""
    first = profile.kernels_of(rank)["iteration"].iloc[0] if len(profile.kernels) else 0
    kernels = profile.kernels_of(rank, first).copy()
    kernels["duration_us"] = median_durations_us(profile, rank, kernels)  # the planner's op times
    if "scratch_bytes" in kernels:  # and its scratch: the most of the recorded iterations
        kernels["scratch_bytes"] = op_scratch_bytes(profile, rank, kernels)
    tensors = profile.tensors_of(rank).copy()
    accesses = profile.accesses_of(rank, first).copy()
    kind_of = tensors.set_index("tensor_id")["kind"]
    state_bytes = int(tensors.loc[tensors["kind"] == "optimizer_state", "size_bytes"].sum())
    params = tensors[tensors["kind"] == "param"]
    param_bytes = int(params["size_bytes"].sum())
    grads = tensors[tensors["kind"] == "grad"]
    grad_bytes = int(grads.loc[grads["tensor_id"].isin(accesses["tensor_id"]), "size_bytes"].sum())
    on_ssd = param_bytes + grad_bytes + state_bytes > hw.host_mem_bytes  # moments (and masters) on the SSD
    # Under ZeRO-Infinity the master parameters stay in host memory if they fit beside the gradients.
    params_on_ssd = on_ssd and param_bytes + grad_bytes > hw.host_mem_bytes
    num_params = float((params["size_bytes"] / params["dtype"].map(_itemsize)).sum())
    step_us = num_params / hw.cpu_adam_params_per_s * 1e6
    opt = (kernels["phase"] == "optimizer").to_numpy()
    if profile.meta.get("device_type") == "cpu":
        # The profile's step already ran on this CPU: a server's CPU-Adam bound is no figure for it
        # (on a CPU profile of 1.3M parameters it made ZeRO's step 200 times shorter than the
        # step measured, and the baseline faster than keeping everything)
        step_us = max(step_us, float(kernels.loc[opt, "duration_us"].sum()))
    if on_ssd:
        moved = state_bytes + (param_bytes if params_on_ssd else 0)
        step_us = max(step_us, moved / hw.ssd_read_bw_bytes_per_s * 1e6, moved / hw.ssd_write_bw_bytes_per_s * 1e6)
    if stage == 2:
        step_us += param_bytes / hw.host_bw_bytes_per_s * 1e6  # the updated parameters back to the device
    if "scratch_bytes" in kernels:
        kernels.loc[opt, "scratch_bytes"] = 0  # the step runs on the CPU
    if opt.any():
        d = kernels.loc[opt, "duration_us"].to_numpy(np.float64)
        share = d / d.sum() if d.sum() > 0 else np.full(len(d), 1 / len(d))
        kernels.loc[opt, "duration_us"] = step_us * share
        dur = kernels["duration_us"].to_numpy(np.float64)
        kernels["start_us"] = np.concatenate([[0.0], np.cumsum(dur)[:-1]])
    opt_ops = kernels.loc[opt, "op_index"].to_numpy()
    acc_kind = accesses["tensor_id"].map(kind_of).to_numpy()
    on_cpu = accesses["op_index"].isin(opt_ops).to_numpy()
    accesses = accesses[~(on_cpu & np.isin(acc_kind, ["param", "grad"])) & (acc_kind != "optimizer_state")]
    tensors = tensors[tensors["kind"] != "optimizer_state"]
    prof = replace(profile, kernels=kernels, tensors=tensors, accesses=accesses)
    fetch_bw = min(hw.ssd_read_bw_bytes_per_s, hw.host_bw_bytes_per_s) if params_on_ssd else hw.host_bw_bytes_per_s
    name = ("zero_offload" if stage == 2 else "zero_infinity")
    return problem_from_profile(prof, rank), {"name": name, "fetch_bw": fetch_bw,
                                              "host_fits": not on_ssd}


def _zero_plan(problem: PlanProblem, hw: Hardware, info: dict[str, object], stage: int,
               activations_to_ssd: bool) -> RankPlan:
    """Simulate ZeRO on its problem. Channels: ``host`` carries parameters (released for free,
    fetched at ``fetch_bw``); ``ssd`` carries the gradients' device-to-host copies at ``host_bw``,
    or, with ``activations_to_ssd``, the saved activations at the SSD's bandwidth."""
    grads = np.flatnonzero((problem.kind == "grad") & (problem.end_op - problem.start_op >= 2))
    moves: list[Move] = []
    if stage == 3:
        params = np.flatnonzero((problem.kind == "param") & (problem.end_op - problem.start_op >= 2))
        moves += _moves(problem, params, "host")
    bw = {"host_write": FREE_BW, "host_read": float(info["fetch_bw"])}  # type: ignore[arg-type]
    if activations_to_ssd:
        moves += _moves(problem, _saved_activations(problem), "ssd", in_phase=True)
        bw |= {"ssd_write": hw.ssd_write_bw_bytes_per_s, "ssd_read": hw.ssd_read_bw_bytes_per_s}
        # The gradients' copies: free (see the module docstring), on the parameters' free channel.
        moves += _moves(problem, grads, "host", reads_back=False)
    else:
        bw |= {"ssd_write": hw.host_bw_bytes_per_s, "ssd_read": hw.host_bw_bytes_per_s}
        moves += _moves(problem, grads, "ssd", reads_back=False)
    return settle_urgency(problem, moves, bw, hw.gpu_mem_bytes,
                          copy_cost_s_per_byte=hw.copy_cost_s_per_byte,  # not teraio's own costs
                          ssd_duplex=hw.ssd_duplex, host_duplex=hw.host_duplex)  # the devices' own


def zero_offload(profile: Profile, hw: Hardware, rank: int = 0) -> tuple[str, RankPlan]:
    """ZeRO-Offload where the model states fit host memory, else ZeRO-Infinity; each with activation
    checkpointing when it does not fit the device otherwise (see the module docstring)."""
    out = _zero_family(profile, hw, rank, activations_to_ssd=False)
    name = next(iter(out))
    return name, out[name]


def _zero_family(profile: Profile, hw: Hardware, rank: int, activations_to_ssd: bool) -> dict[str, RankPlan]:
    """The ZeRO baselines users would run, by name: ZeRO-Offload (when the model states fit host
    memory) and ZeRO-Infinity, each as is if it fits the device, else with checkpointing (or, with
    ``activations_to_ssd``, with the saved activations to the SSD instead)."""
    out: dict[str, RankPlan] = {}
    for stage in (2, 3):
        problem, info = _zero(profile, hw, rank, stage)
        if stage == 2 and not info["host_fits"]:
            continue
        name = str(info["name"])
        if activations_to_ssd:
            out[f"activation_offload+{name}"] = _zero_plan(problem, hw, info, stage, True)
            continue
        rp = _zero_plan(problem, hw, info, stage, False)
        if not rp.sim.fits:
            name, rp = f"{name}+ckpt", _zero_plan(checkpointed(problem, profile, rank), hw, info, stage, False)
        out[name] = rp
    return out


def run_baselines(profile: Profile, problem: PlanProblem, hw: Hardware, rank: int = 0) -> dict[str, RankPlan]:
    """Every baseline on one rank, by name, each as its users would run it (see the module docstring)."""
    out = {"ideal": ideal(problem)}
    ao = activation_offload(problem, hw)
    if ao.sim.fits:
        out["activation_offload"] = ao
    else:
        with_zero = _zero_family(profile, hw, rank, activations_to_ssd=True)
        fitting = {k: v for k, v in with_zero.items() if v.sim.fits}
        pick = fitting or with_zero or {"activation_offload": ao}
        name = min(pick, key=lambda k: pick[k].sim.iteration_us)
        out[name] = pick[name]
    out |= _zero_family(profile, hw, rank, activations_to_ssd=False)
    # The ZeRO problems' ops differ (the optimizer runs on the CPU): compare them with the real ideal.
    for name, rp in out.items():
        if rp.problem is not problem:
            out[name] = replace(rp, sim=replace(rp.sim, ideal_iteration_us=problem.ideal_iteration_us))
    return out
