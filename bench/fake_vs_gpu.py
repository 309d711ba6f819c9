"""Fake-mode predictions against a real GPU run of the same built-in training step.

Traces a Llama3-8B-shaped decoder with fewer layers (--layers) twice on a CUDA
machine: for real (CUDA-event timing per op) and in fake mode with the
roofline of --gpu. Reports the iteration time (measured, predicted), time by
op kind, the profiled peak against ``torch.cuda.max_memory_allocated``, and
whether op sequences and tensor sizes agree. Needs a CUDA GPU.

    python3 bench/fake_vs_gpu.py --gpu h100 --layers 4 --seq 4096 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiles import memory_curve  # noqa: E402
from torch_patch import ProfileComplete, Tracer  # noqa: E402
from torch_patch.builtin_train import TrainConfig, train  # noqa: E402
from torch_patch.costmodel import RooflineCostModel  # noqa: E402
from torch_patch.devices import get_device  # noqa: E402
from torch_patch.fake import FakeTracer  # noqa: E402
from torch_patch.models import CONFIGS, DecoderConfig  # noqa: E402


def kind_of(op: str) -> str:
    if "attention" in op:
        return "attention"
    if op.split(".")[1] in ("mm", "addmm", "bmm"):
        return "matmul"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    base = CONFIGS["llama3-8b"]
    assert isinstance(base, DecoderConfig)
    model_cfg = dataclasses.replace(base, num_layers=args.layers)
    cfg = TrainConfig(model="llama3-8b", batch=1, micro_batch=1, seq=args.seq, precision=args.precision)
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32

    real_tracer = Tracer(warmup=2, iters=2, cuda_timing=True)
    torch.set_default_device("cuda")
    try:
        with real_tracer:
            train(cfg, steps=10, model_config=model_cfg)
    except ProfileComplete:
        pass
    torch.cuda.synchronize()
    max_alloc = max(torch.cuda.max_memory_allocated(), real_tracer.cuda_peak_bytes)  # NOTE [ Scratch ]
    real = real_tracer.profile({})
    torch.set_default_device("cpu")
    torch.cuda.empty_cache()

    fake_tracer = FakeTracer(RooflineCostModel(get_device(args.gpu), tf32=cfg.tf32))
    try:
        with fake_tracer:
            train(cfg, steps=5, model_config=model_cfg)
    except ProfileComplete:
        pass
    fake = fake_tracer.profile({})

    kr, kf = real.kernels_of(real.iterations[-1]), fake.kernels_of()
    names_r, names_f = kr["op_name"].tolist(), kf["op_name"].tolist()
    by_kind = {}
    for label, k in (("measured", kr), ("predicted", kf)):
        k = k.assign(kind=k["op_name"].map(kind_of))
        by_kind[label] = {str(a): float(b) / 1e3 for a, b in k.groupby("kind")["duration_us"].sum().items()}
        by_kind[label]["iteration"] = float((k["start_us"] + k["duration_us"]).max()) / 1e3
        by_kind[label]["sum_of_ops"] = float(k["duration_us"].sum()) / 1e3
    result = {
        "device": torch.cuda.get_device_name(), "total_memory": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__, "layers": args.layers, "seq": args.seq, "precision": args.precision,
        "num_ops_real": len(names_r), "num_ops_fake": len(names_f),
        "same_op_names_except_attention": [n for n in names_r if "attention" not in n]
        == [n for n in names_f if "attention" not in n],
        "attention_ops_real": sorted({n for n in names_r if "attention" in n}),
        "attention_ops_fake": sorted({n for n in names_f if "attention" in n}),
        "same_tensor_sizes": sorted(real.tensors["size_bytes"].tolist()) == sorted(fake.tensors["size_bytes"].tolist()),
        "profile_peak_real_gib": int(memory_curve(real).max()) / 2**30,
        "profile_peak_fake_gib": int(memory_curve(fake).max()) / 2**30,
        "cuda_max_memory_allocated_gib": max_alloc / 2**30,
        "ms": by_kind,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
