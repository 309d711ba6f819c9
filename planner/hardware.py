"""The machine a plan is made for: device capacity and the bandwidth of each channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

__all__ = ["DEFAULT_CPU_ADAM_PARAMS_PER_S", "ComputeCosts", "Hardware"]

# NOTE [ CPU-Adam throughput ]: fp32 Adam on the CPU is bound by host memory
# bandwidth: per parameter it reads param, grad and both moments and writes
# param and both moments, 28 bytes. At 100 GB/s of sustained host memory
# bandwidth (a two-socket server) that is 3.6e9 parameters/s, an upper bound
# for DeepSpeedCPUAdam (which DeepSpeed reports as 5-7x faster than PyTorch's
# CPU Adam: https://www.deepspeed.ai/tutorials/zero-offload). Using the bound
# favours the ZeRO-Offload baseline, never the planner.
DEFAULT_CPU_ADAM_PARAMS_PER_S = 100e9 / 28


class ComputeCosts(TypedDict, total=False):
    """``Hardware``'s costs of the compute, its transfers' latency and its devices' duplex, as the
    simulator takes them (keyword arguments)."""

    copy_cost_s_per_byte: float
    op_overhead_s: float
    refault_s_per_byte: float
    transfer_cost_s: float
    transfer_latency_s: float
    ssd_duplex: float
    host_duplex: float


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Capacities and bandwidths; bandwidths are bytes per second, sizes bytes."""

    gpu_mem_bytes: int
    """Device memory the plan must fit in (the memory curve's bound)."""
    ssd_read_bw_bytes_per_s: float
    """SSD to device (prefetch) bandwidth."""
    ssd_write_bw_bytes_per_s: float
    """Device to SSD (offload) bandwidth."""
    host_bw_bytes_per_s: float = 25e9
    """Host link bandwidth, each way (PCIe is full duplex): one write and one read channel."""
    host_mem_bytes: int = 0
    """Host memory the plan may use for offloaded tensors; 0 keeps everything on the SSD."""
    cpu_adam_params_per_s: float = DEFAULT_CPU_ADAM_PARAMS_PER_S
    """CPU optimizer throughput of the ZeRO-Offload baseline; see NOTE [ CPU-Adam throughput ]."""
    copy_cost_s_per_byte: float = 0.0
    """Compute time each byte moved (either way) takes from the ops, seconds per byte: 0 where
    copies run beside the compute (a GPU's copy engines); on a CPU, where the cores that train
    also copy, a figure measured on the machine (NOTE [ Copies on the compute ] in
    ``planner.simulate``; ``runtime.calibrate`` measures it)."""
    op_overhead_s: float = 0.0
    """Time the runtime adds to every op, seconds (its dispatch mode; the profiled op times leave
    it out): 0 where it hides behind asynchronous kernels (a GPU); measured on a CPU."""
    refault_s_per_byte: float = 0.0
    """Time to fault memory in again, seconds per byte: on a CPU the runtime gives the memory an
    iteration freed back to the OS at its end, and the next iteration faults it in again up to
    its peak (NOTE [ Copies on the compute ]); 0 on a GPU, measured on a CPU."""
    transfer_cost_s: float = 0.0
    """Compute time each transfer (out or back) takes beyond its bytes' copy cost, seconds: the
    runtime's own work for it (NOTE [ Copies on the compute ]); measured on a CPU, and on a GPU for a
    CUDA profile planned there (NOTE [ Small transfers on a GPU ] in teraio/cmd_plan.py)."""
    transfer_latency_s: float = 0.0
    """SSD channel time each transfer to or from the SSD takes before its bytes move, seconds (NOTE [
    Transfer latency ] in ``planner.simulate``): 0 on a GPU, measured on a CPU."""
    ssd_duplex: float = 1.0
    """The share of each direction's bandwidth the SSD keeps while both move bytes (NOTE [ Duplex ]
    in ``planner.simulate``): 1 where they do not slow each other; measured on a CPU."""
    host_duplex: float = 1.0
    """The same for host memory's link (an H200's pinned link measured 0.86-0.91)."""

    def __post_init__(self) -> None:
        if self.gpu_mem_bytes <= 0:
            raise ValueError(f"gpu_mem_bytes must be positive, not {self.gpu_mem_bytes}")
        if self.host_mem_bytes < 0:
            raise ValueError(f"host_mem_bytes must be >= 0, not {self.host_mem_bytes}")
        for name in ("ssd_read_bw_bytes_per_s", "ssd_write_bw_bytes_per_s", "host_bw_bytes_per_s",
                     "cpu_adam_params_per_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a positive finite number, not {value}")
        for name in ("copy_cost_s_per_byte", "op_overhead_s", "refault_s_per_byte", "transfer_cost_s",
                     "transfer_latency_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, not {value}")
        for name in ("ssd_duplex", "host_duplex"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], not {getattr(self, name)}")

    def compute_costs(self) -> ComputeCosts:
        """The costs of the compute, as ``planner.simulate.simulate`` takes them."""
        return {"copy_cost_s_per_byte": self.copy_cost_s_per_byte, "op_overhead_s": self.op_overhead_s,
                "refault_s_per_byte": self.refault_s_per_byte, "transfer_cost_s": self.transfer_cost_s,
                "transfer_latency_s": self.transfer_latency_s, "ssd_duplex": self.ssd_duplex,
                "host_duplex": self.host_duplex}

    def latency_bytes(self) -> dict[str, float]:
        """Per channel, the bytes it could have moved in a transfer's latency (the SSD's channels:
        NOTE [ Transfer latency ] in ``planner.simulate``)."""
        return {c: self.transfer_latency_s * bw if c.startswith("ssd") else 0.0 for c, bw in self.channel_bw().items()}

    def channel_bw(self) -> dict[str, float]:
        """Bytes per second of each channel, by the names the simulator uses."""
        return {
            "ssd_write": self.ssd_write_bw_bytes_per_s, "ssd_read": self.ssd_read_bw_bytes_per_s,
            "host_write": self.host_bw_bytes_per_s, "host_read": self.host_bw_bytes_per_s,
        }
