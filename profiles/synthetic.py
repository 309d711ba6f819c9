"""Synthetic profiles: transformer-shaped op streams of any size, without torch.

The planner's tests and its scale benchmark need profiles from a few ops to
hundreds of thousands, with the structure of real training: per layer, forward
ops that read that layer's parameters and save an activation for backward; a
backward pass in reverse layer order that reads the saved activations and
parameters and accumulates gradients; an optimizer op per parameter that reads
the parameter, its gradient and two state tensors (Adam's moments).

Layout of one iteration (``L`` layers, ``F`` forward ops per layer, ``P``
parameters per layer):

- forward op ``i`` of layer ``l`` (index ``l*F + i``) reads parameter
  ``i % P`` of the layer and the previous op's output (a temporary), writes its
  own output temporary and saves one activation;
- backward: 2 ops per forward op, layers in reverse; the first reads the saved
  activation and the parameter, the second accumulates into the gradient;
- optimizer: one op per parameter (reads param, grad, both moments).

Parameters, gradients and moments are persistent; each forward op's activation
lives from its forward op to its backward op. Sizes and durations are drawn
from ``seed``; ``num_extra`` adds persistent "buffer" tensors touched at random
ops, so that random profiles are not all alike.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from profiles.model import Profile
from profiles.schema import FORMAT

__all__ = ["synthetic_pipeline_profile", "synthetic_profile"]


def synthetic_profile(
    num_layers: int = 4,
    ops_per_layer: int = 8,
    params_per_layer: int = 4,
    *,
    activation_bytes: int = 64 << 20,
    param_bytes: int = 16 << 20,
    op_us: float = 500.0,
    num_extra: int = 0,
    jitter: float = 0.5,
    seed: int = 0,
) -> Profile:
    """A one-rank, one-iteration profile (iteration 1) of a transformer-shaped model.

    ``activation_bytes``, ``param_bytes`` and ``op_us`` are the means of
    per-tensor sizes and per-op forward durations; each is scaled by a random
    factor in ``[1 - jitter, 1 + jitter]``. Backward ops take as long as their
    forward op; an optimizer op takes its parameter's bytes over 2 TB/s, times 4.
    """
    if num_layers < 1 or ops_per_layer < 1 or not 1 <= params_per_layer <= ops_per_layer:
        raise ValueError("need num_layers >= 1 and 1 <= params_per_layer <= ops_per_layer")
    rng = np.random.default_rng(seed)
    L, F, P = num_layers, ops_per_layer, params_per_layer  # noqa: N806 (the docstring's names)
    num_fwd = L * F
    num_params = L * P
    num_bwd = 2 * num_fwd
    num_ops = num_fwd + num_bwd + num_params

    def scale(n: int) -> np.ndarray:
        return rng.uniform(1 - jitter, 1 + jitter, n)

    # ---- ops -----------------------------------------------------------------------
    layer_f = np.repeat(np.arange(L), F)  # (num_fwd,) layer of each forward op
    pos_f = np.tile(np.arange(F), L)  # (num_fwd,) position in the layer
    fwd_op = np.arange(num_fwd)
    bwd1_op = num_fwd + (L - 1 - layer_f) * 2 * F + 2 * (F - 1 - pos_f)  # reads activation
    bwd2_op = bwd1_op + 1  # accumulates the gradient
    param_of_f = layer_f * P + pos_f % P  # (num_fwd,) parameter index each forward op reads
    opt_op = num_fwd + num_bwd + np.arange(num_params)

    fwd_us = op_us * scale(num_fwd)
    param_size = np.maximum((param_bytes * scale(num_params)).astype(np.int64), 1)
    duration = np.empty(num_ops)
    duration[fwd_op] = fwd_us
    duration[bwd1_op] = fwd_us
    duration[bwd2_op] = fwd_us
    duration[opt_op] = 4 * param_size / 2e12 * 1e6
    phase = np.empty(num_ops, dtype=object)
    phase[:num_fwd] = "forward"
    phase[num_fwd:num_fwd + num_bwd] = "backward"
    phase[num_fwd + num_bwd:] = "optimizer"
    names = np.empty(num_ops, dtype=object)
    names[fwd_op] = np.where(pos_f % 2 == 0, "aten.mm.default", "aten.gelu.default")
    names[bwd1_op] = "aten.mm.default"
    names[bwd2_op] = "aten.add_.Tensor"
    names[opt_op] = "aten._foreach_add_.List"
    module = np.empty(num_ops, dtype=object)
    module[fwd_op] = [f"layers.{x}" for x in layer_f]
    module[bwd1_op] = module[fwd_op]
    module[bwd2_op] = module[fwd_op]
    module[opt_op] = None
    start = np.concatenate([[0.0], np.cumsum(duration)[:-1]])
    kernels = pd.DataFrame({
        "rank": np.zeros(num_ops, np.int32), "iteration": np.ones(num_ops, np.int32),
        "op_index": np.arange(num_ops, dtype=np.int32), "op_name": names, "phase": phase,
        "module": module, "start_us": start, "duration_us": duration,
    })

    # ---- tensors: params, grads, moment 1, moment 2, activations, temporaries, extras
    pid = np.arange(num_params)
    gid, m_id, v_id = pid + num_params, pid + 2 * num_params, pid + 3 * num_params
    act_id = 4 * num_params + np.arange(num_fwd)
    tmp_id = act_id + num_fwd
    extra_id = tmp_id[-1] + 1 + np.arange(num_extra)
    act_size = np.maximum((activation_bytes * scale(num_fwd)).astype(np.int64), 1)
    tmp_size = np.maximum(act_size // 4, 1)
    extra_size = np.maximum((param_bytes * scale(num_extra)).astype(np.int64), 1)
    ids = np.concatenate([pid, gid, m_id, v_id, act_id, tmp_id, extra_id])
    size = np.concatenate([param_size, param_size, param_size, param_size, act_size, tmp_size, extra_size])
    kind = np.concatenate([
        np.full(num_params, "param", object), np.full(num_params, "grad", object),
        np.full(2 * num_params, "optimizer_state", object), np.full(num_fwd, "activation", object),
        np.full(num_fwd, "temporary", object), np.full(num_extra, "buffer", object),
    ])
    persistent = np.r_[np.ones(4 * num_params, bool), np.zeros(2 * num_fwd, bool), np.ones(num_extra, bool)]
    tmp_free = np.minimum(fwd_op + 2, num_fwd)  # read by the next forward op
    alloc = np.concatenate([np.full(4 * num_params, -1), fwd_op, fwd_op, np.full(num_extra, -1)])
    free = np.concatenate([np.full(4 * num_params, -1), bwd1_op + 1, tmp_free, np.full(num_extra, -1)])
    pname = [f"layers.{i // P}.w{i % P}" for i in pid]
    tensor_name = np.concatenate([
        pname, [f"{n}.grad" for n in pname], [f"{n}.exp_avg" for n in pname],
        [f"{n}.exp_avg_sq" for n in pname], np.full(2 * num_fwd + num_extra, None, object),
    ])
    tensors = pd.DataFrame({
        "rank": np.zeros(len(ids), np.int32), "tensor_id": ids.astype(np.int64), "size_bytes": size,
        "kind": kind, "dtype": "float32", "name": tensor_name, "persistent": persistent,
        "alloc_op": alloc.astype(np.int32), "free_op": free.astype(np.int32), "resizable": True,
    })

    # ---- accesses ---------------------------------------------------------------------
    nxt = fwd_op[1:][pos_f[1:] > 0]  # forward ops that read their predecessor's output
    extra_ops = rng.integers(0, num_ops, size=(num_extra, 2))
    param_id = pid[param_of_f]
    parts = [
        (fwd_op, param_id, "read"),
        (fwd_op, act_id, "write"), (fwd_op, tmp_id, "write"), (nxt, tmp_id[nxt - 1], "read"),
        (bwd1_op, act_id, "read"), (bwd1_op, param_id, "read"), (bwd2_op, gid[param_of_f], "write"),
        (opt_op, pid, "write"), (opt_op, gid, "read"), (opt_op, m_id, "write"), (opt_op, v_id, "write"),
        (extra_ops.ravel(), np.repeat(extra_id, 2), "read"),
    ]
    op_index = np.concatenate([p[0] for p in parts]).astype(np.int32)
    accesses = pd.DataFrame({
        "rank": np.zeros(len(op_index), np.int32), "iteration": np.ones(len(op_index), np.int32),
        "op_index": op_index, "tensor_id": np.concatenate([p[1] for p in parts]).astype(np.int64),
        "access": np.concatenate([np.full(len(p[0]), p[2], object) for p in parts]),
    })
    signature = hashlib.sha256("\n".join(names.tolist()).encode() + size.tobytes()).hexdigest()
    meta = {
        "format": FORMAT, "mode": "synthetic", "device_type": "synthetic",
        "device_name": "synthetic", "device_memory_bytes": None, "world_size": 1, "ranks": [0],
        "iterations": [1], "signature": signature,
        "synthetic": {"num_layers": L, "ops_per_layer": F, "params_per_layer": P, "seed": seed},
    }
    return Profile(meta=meta, kernels=kernels, tensors=tensors, accesses=accesses)



class _Stage:
    """One pipeline rank's iteration, built op by op (``synthetic_pipeline_profile``)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, float, int]] = []  # (op_name, phase, duration_us, peer)
        self.accesses: list[tuple[int, int, str]] = []  # (op_index, tensor_id, access)
        self.rows: dict[int, list] = {}  # tensor id -> [size_bytes, kind, name, alloc_op, free_op]

    def tensor(self, size: int, kind: str, name: str | None = None, persistent: bool = False) -> int:
        """A new storage: alive all iteration if ``persistent``, else from the next op on."""
        tid = len(self.rows)
        self.rows[tid] = [size, kind, name, -1 if persistent else len(self.ops), -1]
        return tid

    def op(self, name: str, phase: str, duration_us: float, reads: tuple[int, ...] = (),
           writes: tuple[int, ...] = (), peer: int = -1) -> None:
        k = len(self.ops)
        self.accesses += [(k, t, "read") for t in reads] + [(k, t, "write") for t in writes]
        self.ops.append((name, phase, duration_us, peer))

    def free(self, tid: int) -> None:
        """``tid`` dies after the last op added."""
        self.rows[tid][4] = len(self.ops)

    def tables(self, rank: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, str]:
        names, phases, durations, peers = zip(*self.ops, strict=True)
        n, ids = len(self.ops), list(self.rows)
        kernels = pd.DataFrame({
            "rank": np.full(n, rank, np.int32), "iteration": np.ones(n, np.int32),
            "op_index": np.arange(n, dtype=np.int32), "op_name": list(names), "phase": list(phases),
            "module": [None if ph == "optimizer" else f"stages.{rank}" for ph in phases],
            "start_us": np.concatenate([[0.0], np.cumsum(durations)[:-1]]), "duration_us": np.array(durations),
            "peer": np.array(peers, np.int32),
        })
        size, kind, tname, alloc, free = (list(col) for col in zip(*self.rows.values(), strict=True))
        tensors = pd.DataFrame({
            "rank": np.full(len(ids), rank, np.int32), "tensor_id": np.array(ids, np.int64),
            "size_bytes": np.array(size, np.int64), "kind": kind, "dtype": "float32", "name": tname,
            "persistent": [a < 0 and f < 0 for a, f in zip(alloc, free, strict=True)],
            "alloc_op": np.array(alloc, np.int32), "free_op": np.array(free, np.int32), "resizable": True,
        })
        op_index, tid, access = zip(*self.accesses, strict=True)
        accesses = pd.DataFrame({
            "rank": np.full(len(op_index), rank, np.int32), "iteration": np.ones(len(op_index), np.int32),
            "op_index": np.array(op_index, np.int32), "tensor_id": np.array(tid, np.int64),
            "access": list(access),
        })
        signature = hashlib.sha256("\n".join(names).encode() + np.array(size, np.int64).tobytes()).hexdigest()
        return kernels, tensors, accesses, signature


def _schedule(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The stage's (F|B, micro-batch) actions in order."""
    M = num_microbatches  # noqa: N806
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warm = min(num_stages - 1 - stage, M)
    actions = [("F", m) for m in range(warm)]
    for i in range(M - warm):
        actions += [("F", warm + i), ("B", i)]
    return actions + [("B", m) for m in range(M - warm, M)]


def synthetic_pipeline_profile(
    num_stages: int = 2,
    num_microbatches: int = 4,
    ops_per_stage: int = 4,
    params_per_stage: int = 2,
    *,
    schedule: str = "1f1b",
    activation_bytes: int = 16 << 20,
    param_bytes: int = 8 << 20,
    op_us: float = 200.0,
    transfer_us: float = 20.0,
    jitter: float = 0.5,
    seed: int = 0,
) -> Profile:
    """A job profile of a pipeline: one rank per stage, with ``c10d.send``/``c10d.recv_`` ops
    whose ``peer`` is the neighbouring stage (iteration 1 of every rank).

    Stage ``s`` runs ``ops_per_stage`` forward ops per micro-batch, each reading one of its
    parameters and the previous op's output (the first: the activation received from stage
    ``s - 1`` into a receive buffer, or on stage 0 the micro-batch's input) and saving its own
    output (an activation, alive until its backward op); the last forward op's output is sent
    to stage ``s + 1``. Backward, per micro-batch: receive the output's gradient (but on the
    last stage), one backward op per forward op in reverse (reads its activation, its
    parameter and the gradient flowing back; accumulates the parameter's gradient), send the
    input's gradient to ``s - 1``; then one optimizer op per parameter. Receive buffers are
    persistent (allocated once and reused every step, as ``torch.distributed.pipelining``
    does). ``schedule`` orders the micro-batches: ``gpipe`` (all forwards, then all
    backwards) or ``1f1b`` (``num_stages - 1 - s`` forwards first, then one forward and one
    backward in turn), which holds fewer activations on later stages. Forward ops take
    ``op_us`` (times a random factor in ``[1 - jitter, 1 + jitter]``), backward ops twice
    their forward op, sends and receives ``transfer_us``; each rank's ops run back to back
    (``start_us``), as if no rank ever waited for another.
    """
    if num_stages < 1 or num_microbatches < 1 or not 1 <= params_per_stage <= ops_per_stage:
        raise ValueError("need num_stages >= 1, num_microbatches >= 1 and 1 <= params_per_stage <= ops_per_stage")
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule {schedule!r}: expected gpipe or 1f1b")
    rng = np.random.default_rng(seed)
    S, M, F, P = num_stages, num_microbatches, ops_per_stage, params_per_stage  # noqa: N806
    act_bytes = max(int(activation_bytes), 1)
    parts, signatures = [], {}
    for s in range(S):
        st = _Stage()
        fwd_us = op_us * rng.uniform(1 - jitter, 1 + jitter, (M, F))
        sizes = np.maximum((param_bytes * rng.uniform(1 - jitter, 1 + jitter, P)).astype(np.int64), 1)
        param, grad, exp_avg, exp_avg_sq = (
            [st.tensor(int(sizes[p]), kind, f"stages.{s}.w{p}{label}", persistent=True) for p in range(P)]
            for kind, label in (("param", ""), ("grad", ".grad"), ("optimizer_state", ".exp_avg"),
                                ("optimizer_state", ".exp_avg_sq")))
        recv_act = [st.tensor(act_bytes, "buffer", persistent=True) for _ in range(M)] if s > 0 else []
        recv_grad = [st.tensor(act_bytes, "buffer", persistent=True) for _ in range(M)] if s < S - 1 else []
        act: dict[tuple[int, int], int] = {}
        for phase, m in _schedule(schedule, s, S, M):
            if phase == "F":
                if s > 0:
                    st.op("c10d.recv_.default", "forward", transfer_us, writes=(recv_act[m],), peer=s - 1)
                    src = recv_act[m]
                else:
                    src = st.tensor(act_bytes, "input")
                for j in range(F):
                    act[(m, j)] = st.tensor(act_bytes, "activation")
                    st.op("aten.mm.default", "forward", float(fwd_us[m, j]), reads=(param[j % P], src),
                          writes=(act[(m, j)],))
                    if s == 0 and j == 0:
                        st.free(src)
                    src = act[(m, j)]
                if s < S - 1:
                    st.op("c10d.send.default", "forward", transfer_us, reads=(src,), peer=s + 1)
                continue
            if s < S - 1:
                st.op("c10d.recv_.default", "backward", transfer_us, writes=(recv_grad[m],), peer=s + 1)
                grad_in = recv_grad[m]
            else:
                grad_in = act[(m, F - 1)]
            for j in reversed(range(F)):
                grad_out = st.tensor(act_bytes, "temporary")
                st.op("aten.mm.default", "backward", 2 * float(fwd_us[m, j]),
                      reads=(act[(m, j)], param[j % P], grad_in), writes=(grad[j % P], grad_out))
                st.free(act[(m, j)])
                if st.rows[grad_in][1] == "temporary":
                    st.free(grad_in)
                grad_in = grad_out
            if s > 0:
                st.op("c10d.send.default", "backward", transfer_us, reads=(grad_in,), peer=s - 1)
            st.free(grad_in)
        for p in range(P):
            st.op("aten._foreach_add_.List", "optimizer", 4 * float(sizes[p]) / 2e12 * 1e6,
                  reads=(grad[p],), writes=(param[p], exp_avg[p], exp_avg_sq[p]))
        *tables, signatures[str(s)] = st.tables(s)
        parts.append(tables)
    meta = {
        "format": FORMAT, "mode": "synthetic", "device_type": "synthetic",
        "device_name": "synthetic", "device_memory_bytes": None, "world_size": S, "ranks": list(range(S)),
        "iterations": [1], "signature": signatures["0"], "signatures": signatures,
        "synthetic": {"pipeline": schedule, "num_stages": S, "num_microbatches": M, "ops_per_stage": F,
                      "params_per_stage": P, "seed": seed},
    }
    kernels, tensors, accesses = (pd.concat(list(col), ignore_index=True) for col in zip(*parts, strict=True))
    return Profile(meta=meta, kernels=kernels, tensors=tensors, accesses=accesses)
