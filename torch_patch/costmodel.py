"""A roofline cost model: how long one aten op takes on a named device.

``time = max(FLOPs / peak FLOP/s for the op's dtype, bytes read and written /
memory bandwidth) + launch cost``. FLOPs come from PyTorch's own formulas
(``torch.utils.flop_counter``'s registry: matmuls, convolutions, attention);
every other op counts as memory-bound. Bytes are the sizes of the op's tensor
arguments (read) plus its outputs (written); an in-place op's tensor counts
both ways. Views and allocations launch no kernel and cost nothing.

A c10d op (a collective, a send or a receive) and a functional collective move
their bytes over the device's link to their peers instead: NOTE [ Collective
time ].

What this leaves out, on purpose: achieved (not peak) rates, cache reuse,
kernel fusion, and overlap between ops. A fake profile's times are therefore
a lower bound of a real step's, with the ops in the right proportion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from torch_patch.devices import Device

__all__ = ["DEFAULT_LAUNCH_US", "RooflineCostModel"]

# NOTE [ Launch cost ]: an H100 runs an empty kernel in about 2-3 us of GPU time
# and eager PyTorch issues one every ~5 us at best; 4 us stands for both. It
# only matters for the many tiny ops (norm statistics, optimizer scalars).
DEFAULT_LAUNCH_US = 4.0

_aten = torch.ops.aten
_NO_KERNEL = {
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
    _aten._local_scalar_dense.default,
}


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else t


# FlashAttention skips the key blocks a causal mask hides: about half the work.
def _sdpa_cpu_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    is_causal: bool = False, **_: Any) -> int:
    flops = sdpa_flop_count(_shape(q), _shape(k), _shape(v))
    return int(flops // 2 if is_causal else flops)


def _sdpa_cpu_backward_flops(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: Any, lse: Any, dropout_p: float, is_causal: bool, **_: Any) -> int:
    flops = sdpa_backward_flop_count(_shape(grad), _shape(q), _shape(k), _shape(v))
    return int(flops // 2 if is_causal else flops)


# Fake tensors on the CPU take the CPU flash-attention kernels, which the registry lacks;
# they do the same math as the CUDA ones.
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
}


# NOTE [ Collective time ]: a c10d op of a group of n ranks takes the time NCCL's ring
# algorithms need at the device's link bandwidth (each way): a send or a receive moves its
# tensors once; an all-reduce 2 (n - 1) / n of its tensors' bytes; an all-gather (n - 1) / n
# of its output, a reduce-scatter of its input; a broadcast its tensors once. Waiting for the
# peers is not in it: one rank's profile cannot know when they arrive (a job's iteration comes
# from every rank's ops together). Other c10d ops (barriers) cost a launch.
_RING_SHARE: dict[str, tuple[str, Callable[[int], float]]] = {  # op -> (argument, share of its bytes)
    "send": ("tensors", lambda n: 1.0),
    "recv_": ("tensors", lambda n: 1.0),
    "broadcast_": ("tensors", lambda n: 1.0),
    "allreduce_": ("tensors", lambda n: 2 * (n - 1) / n),
    "allgather_": ("output_tensors", lambda n: (n - 1) / n),
    "_allgather_base_": ("output_tensor", lambda n: (n - 1) / n),
    "allgather_into_tensor_coalesced_": ("outputs", lambda n: (n - 1) / n),
    "reduce_scatter_": ("input_tensors", lambda n: (n - 1) / n),
    "_reduce_scatter_base_": ("input_tensor", lambda n: (n - 1) / n),
    "reduce_scatter_tensor_coalesced_": ("inputs", lambda n: (n - 1) / n),
}


# A functional collective (``_c10d_functional.all_reduce`` and the rest) moves the same bytes as
# its c10d op, counted from its input: an all-gather's output is n of its inputs.
_FUNCTIONAL_SHARE: dict[str, Callable[[int], float]] = {  # op -> share of its input's bytes
    **dict.fromkeys(("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"),
                    lambda n: 2 * (n - 1) / n),
    **dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                    lambda n: n - 1),
    **dict.fromkeys(("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
                     "all_to_all_single"), lambda n: (n - 1) / n),
    **dict.fromkeys(("broadcast", "broadcast_", "isend", "irecv"), lambda n: 1.0),
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def _functional_group_size(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    names = [a.name for a in func._schema.arguments]
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    if "group_size" in bound:
        return int(bound["group_size"])
    group = bound.get("group_name")
    try:
        if not hasattr(group, "size"):  # a name (a group object where one rank compiles for all)
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(group)  # type: ignore[arg-type]
        return int(group.size())  # type: ignore[union-attr]
    except (ImportError, RuntimeError, TypeError, ValueError):  # no such group here: as one rank
        return 1


def _all_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _tensor_bytes(value)
    if isinstance(value, (list, tuple)):
        return sum(_all_bytes(v) for v in value)
    return 0


def _group_size(func: Any, args: tuple[Any, ...]) -> int:
    names = [a.name for a in func._schema.arguments]
    if "process_group" not in names or names.index("process_group") >= len(args):
        return 1
    group = torch._C._distributed_c10d.ProcessGroup.unbox(args[names.index("process_group")])
    return int(group.size())


def _tensor_bytes(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    if n and not t.is_contiguous():  # expanded (stride 0) views read their storage once
        n = min(n, t.untyped_storage().nbytes())
    return n


@dataclass(frozen=True)
class RooflineCostModel:
    """Times ops as on ``device``; see the module docstring for the model."""

    device: Device
    launch_us: float = DEFAULT_LAUNCH_US
    """Added to every op that launches a kernel; see NOTE [ Launch cost ]."""
    tf32: bool = False
    """Whether float32 matmuls run on TF32 tensor cores (PyTorch's default is no)."""

    def describe(self) -> dict[str, Any]:
        """What profiles record as ``cost_model``."""
        return {
            "kind": "roofline",
            "device": self.device.name,
            "peak_flops_per_s": dict(self.device.peak_flops_per_s),
            "memory_bw_bytes_per_s": self.device.memory_bw_bytes_per_s,
            "launch_us": self.launch_us,
            "tf32": self.tf32,
        }

    def flops(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
        packet = func.overloadpacket
        rule = flop_registry.get(packet)
        if rule is not None:
            return int(rule(*args, **kwargs, out_val=out))
        extra = _EXTRA_FLOPS.get(packet)
        return extra(*args, **kwargs) if extra is not None else 0

    def collective_us(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        """Microseconds c10d op ``func`` takes: NOTE [ Collective time ]."""
        rule = _RING_SHARE.get(func._schema.name.removeprefix("c10d::"))
        if rule is None:
            return self.launch_us
        arg, share = rule
        names = [a.name for a in func._schema.arguments]
        value = kwargs.get(arg, args[names.index(arg)] if arg in names and names.index(arg) < len(args) else None)
        n = _group_size(func, args)
        return _all_bytes(value) * share(n) / self.device.link_bw_bytes_per_s * 1e6 + self.launch_us

    def op_us(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              inputs: list[torch.Tensor], out: Any) -> float:
        """Microseconds op ``func`` takes; ``inputs`` are its tensor arguments, ``out`` its result."""
        if func in _NO_KERNEL or func.is_view:
            return 0.0
        if func.namespace == "c10d":
            return self.collective_us(func, args, kwargs)
        if func.namespace in _FUNCTIONAL_NAMESPACES:
            name = func._schema.name.split("::")[1]
            share = _FUNCTIONAL_SHARE.get(name)
            if share is None:  # the wait and the wrapping launch no kernel; any other op one
                return 0.0 if name in ("wait_tensor", "_wrap_tensor_autograd") else self.launch_us
            n = _functional_group_size(func, args, kwargs)
            return _all_bytes(args[0]) * share(n) / self.device.link_bw_bytes_per_s * 1e6 + self.launch_us
        nbytes = 0
        dtype = None
        for t in inputs:
            nbytes += _tensor_bytes(t)
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
        if isinstance(out, torch.Tensor):
            nbytes += _tensor_bytes(out)
            if dtype is None and out.is_floating_point():
                dtype = out.dtype
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    nbytes += _tensor_bytes(o)
        dev = self.device
        t_mem = nbytes / dev.memory_bw_bytes_per_s
        flops = self.flops(func, args, kwargs, out)
        t_math = flops / dev.peak_for(str(dtype).removeprefix("torch."), self.tf32) if flops else 0.0
        return max(t_mem, t_math) * 1e6 + self.launch_us
