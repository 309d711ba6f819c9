"""The accelerators fake mode can time ops for: published peak rates and memory.

Peak FLOP/s are the *dense* figures (NVIDIA's datasheets quote tensor-core
rates "with sparsity", twice the dense rate; we halve them). ``fp32`` is the
CUDA-core rate that PyTorch's fp32 matmuls get by default
(``torch.backends.cuda.matmul.allow_tf32`` is False); ``tf32`` is the
tensor-core rate when TF32 is allowed. Memory capacity is the total CUDA
reports (``nvidia-smi`` "Total" in MiB), not the marketing round number.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device", "get_device"]

_T = 1e12


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator's published figures. Rates are per second, sizes bytes."""

    name: str
    """Full product name, as recorded in profiles (``device_name``)."""
    peak_flops_per_s: dict[str, float]
    """Dense peak FLOP/s per precision: ``fp32`` (CUDA cores), ``tf32``, ``bf16``, ``fp16``."""
    memory_bw_bytes_per_s: float
    """Peak device-memory (HBM) bandwidth."""
    memory_bytes: int
    """Device memory capacity."""
    link_bw_bytes_per_s: float
    """Peak bandwidth to the other devices of the node, each way (NVLink: half the
    datasheet's bidirectional figure). Times collectives and sends in fake jobs."""

    def peak_for(self, dtype: str, tf32: bool = False) -> float:
        """Peak FLOP/s for math in ``dtype`` (``float32``, ``bfloat16``, ...)."""
        if dtype in ("bfloat16",):
            return self.peak_flops_per_s["bf16"]
        if dtype in ("float16",):
            return self.peak_flops_per_s["fp16"]
        if dtype == "float32" and tf32:
            return self.peak_flops_per_s["tf32"]
        return self.peak_flops_per_s["fp32"]  # float32, float64 (generous) and integers


DEVICES: dict[str, Device] = {
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/
    # a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM 80GB column: FP32
    # 19.5 TFLOPS, TF32 156 TFLOPS, BF16/FP16 312 TFLOPS (dense; 312/624 with sparsity),
    # HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s. nvidia-smi reports 81920 MiB.
    "a100": Device(
        name="NVIDIA A100-SXM4-80GB",
        peak_flops_per_s={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        memory_bw_bytes_per_s=2039e9,
        memory_bytes=81920 * 2**20,
        link_bw_bytes_per_s=300e9,  # NVLink 3: 600 GB/s bidirectional
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (resources.nvidia.com/en-us-tensor-core/
    # nvidia-tensor-core-gpu-datasheet), H100 SXM column: FP32 67 TFLOPS, TF32 989 TFLOPS,
    # BF16/FP16 1,979 TFLOPS (both "with sparsity": dense is half), 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s. nvidia-smi reports 81559 MiB.
    "h100": Device(
        name="NVIDIA H100 80GB HBM3",
        peak_flops_per_s={"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T,
                          "fp16": 989.5 * _T},
        memory_bw_bytes_per_s=3.35e12,
        memory_bytes=81559 * 2**20,
        link_bw_bytes_per_s=450e9,  # NVLink 4: 900 GB/s bidirectional
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/), H200 SXM
    # column: the same compute as H100 SXM (FP32 67, TF32 989 and BF16/FP16 1,979 TFLOPS with
    # sparsity), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s. nvidia-smi reports 143771 MiB.
    "h200": Device(
        name="NVIDIA H200",
        peak_flops_per_s={"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T,
                          "fp16": 989.5 * _T},
        memory_bw_bytes_per_s=4.8e12,
        memory_bytes=143771 * 2**20,
        link_bw_bytes_per_s=450e9,  # NVLink 4: 900 GB/s bidirectional
    ),
}


def get_device(name: str) -> Device:
    """The device called ``name`` (case-insensitive; ``h100-sxm`` and the like also match)."""
    key = name.strip().lower()
    for short, dev in DEVICES.items():
        if key == short or key.startswith(short + "-") or key == dev.name.lower():
            return dev
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(DEVICES)}")
