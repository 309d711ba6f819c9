"""A built-in model's job of tiny shapes with real tensors, on the process group torchrun
makes (gloo): ``builtin_job_script.py pipeline|fsdp SCHEDULE``. The real run whose ranks
tests/torch_patch/test_fake_jobs.py compares the fake ranks of the same job with."""

from __future__ import annotations

import sys

import torch.distributed as dist

from torch_patch.builtin_train import JobConfig, TrainConfig, train
from torch_patch.models import DecoderConfig

TINY = DecoderConfig(vocab_size=96, hidden=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden=48)
JOB_TRAIN = TrainConfig(model="llama3-8b", batch=4, micro_batch=1, seq=8)  # TINY's shapes replace the model's

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        job = JobConfig(parallelism=sys.argv[1], world_size=dist.get_world_size(), rank=dist.get_rank(),
                        schedule=sys.argv[2])
        train(JOB_TRAIN, steps=6, model_config=TINY, job=job)
    finally:
        dist.destroy_process_group()
