"""The training loop of ``teraio profile --fake --model NAME``.

One iteration is the paper's (and TorchTitan's): ``batch // micro_batch``
forward/backward passes of ``micro_batch`` sequences each, their gradients
accumulated (each loss divided by the number of passes), then one optimizer
step and ``zero_grad(set_to_none=True)``. Data are random token ids. Meant to
run inside a ``FakeTracer`` (it allocates the whole model otherwise); it runs
``steps`` iterations or until the tracer stops it.

With a ``JobConfig`` the process plays one rank of a job of several, through a
fake process group (NOTE [ One rank of a fake job ]):

* ``pipeline``: the decoder cut into stages (blocks split evenly, the embeddings
  on the first stage, the final norm, output projection and loss on the last),
  trained by a ``torch.distributed.pipelining`` schedule over the batch's
  micro-batches: ``1f1b`` (stage r on rank r), ``interleaved-1f1b`` (stages r
  and r + W on rank r of W) or ``zbv`` (stages r and 2W - 1 - r), as
  ``examples/train_gpt_pp.py`` places them; one AdamW per rank over its stages;
* ``fsdp``: FSDP2, ``fully_shard`` on every block and then the whole model; the
  global batch is split evenly between the ranks, each accumulating its share
  in micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_patch.models import (
    CONFIGS,
    Decoder,
    DecoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    build_model,
)

__all__ = ["OPTIMIZERS", "PARALLELISMS", "PRECISIONS", "SCHEDULES", "JobConfig", "TrainConfig", "train"]

# Precision -> (parameter/activation dtype, float32 matmuls on TF32 tensor cores).
# bf16 is pure bf16 training: parameters, gradients and optimizer state in bf16.
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "fp32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bf16": (torch.bfloat16, False),
}
# NOTE [ Per-parameter optimizer ]: "adamw" is torch.optim.AdamW's for-loop
# implementation, whose ops each touch one parameter's tensors, as the fused and
# foreach CUDA kernels do per chunk. "adamw-foreach" issues each foreach op over
# every parameter at once: one op then needs all parameters, gradients and states
# resident together (16 bytes per parameter in fp32), which no offload plan can
# satisfy for a model larger than a quarter of device memory. "adamw-in-backward"
# is PyTorch's "optimizer step in backward" recipe (one AdamW per parameter, stepped
# from a post-accumulate-grad hook, its gradient freed at once): no full set of
# gradients ever exists, but gradients cannot be accumulated over micro-batches.
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-in-backward", "sgd")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str
    """A name in ``torch_patch.models.CONFIGS``."""
    batch: int
    """Global batch: sequences per iteration (optimizer step)."""
    micro_batch: int
    """Sequences per forward/backward pass; ``batch`` must be a multiple of it."""
    seq: int
    """Tokens per sequence (encoder and decoder length for encoder-decoders)."""
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if self.model not in CONFIGS:
            raise ValueError(f"unknown model {self.model!r}; known: {', '.join(CONFIGS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        for name in ("batch", "micro_batch", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.batch % self.micro_batch:
            raise ValueError(f"batch {self.batch} is not a multiple of micro-batch {self.micro_batch}")
        if self.optimizer == "adamw-in-backward" and self.batch != self.micro_batch:
            raise ValueError("adamw-in-backward steps during backward and cannot accumulate "
                             "gradients: give a batch equal to the micro-batch")

    @property
    def num_micro_batches(self) -> int:
        return self.batch // self.micro_batch

    @property
    def tf32(self) -> bool:
        return PRECISIONS[self.precision][1]


PARALLELISMS = ("pipeline", "fsdp")
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The job one fake rank belongs to (see the module docstring)."""

    parallelism: str
    """``pipeline`` or ``fsdp`` (FSDP2)."""
    world_size: int
    """Ranks in the job (pipeline ranks, or FSDP2 shards)."""
    rank: int
    """The rank this process plays, in ``[0, world_size)``."""
    schedule: str = "1f1b"
    """Pipeline only: the ``torch.distributed.pipelining`` schedule, one of ``SCHEDULES``."""

    def __post_init__(self) -> None:
        if self.parallelism not in PARALLELISMS:
            raise ValueError(f"unknown parallelism {self.parallelism!r}; known: {', '.join(PARALLELISMS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.world_size < 1:
            raise ValueError(f"a job has at least 1 rank, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not a rank of a job of {self.world_size} "
                             f"(0 to {self.world_size - 1})")

    @property
    def num_stages(self) -> int:
        """Pipeline stages: one per rank for 1F1B, two per rank for the others."""
        return self.world_size if self.schedule == "1f1b" else 2 * self.world_size

    def stages_of(self, rank: int) -> list[int]:
        """The pipeline stages ``rank`` holds, in the order the schedule takes them."""
        w = self.world_size
        if self.schedule == "1f1b":
            return [rank]
        if self.schedule == "interleaved-1f1b":
            return [rank, rank + w]
        return [rank, 2 * w - 1 - rank]

    def stage_layers(self, stage: int, num_layers: int) -> range:
        """The decoder blocks of ``stage``: an even split, the remainder on the later stages."""
        n = self.num_stages
        return range(stage * num_layers // n, (stage + 1) * num_layers // n)

    def check(self, cfg: TrainConfig, model_cfg: DecoderConfig | EncoderDecoderConfig) -> None:
        """Raise ValueError if ``cfg`` cannot run as this job."""
        if cfg.optimizer == "adamw-in-backward":
            raise ValueError("adamw-in-backward is for one process; a job steps after its "
                             "schedule or its gradient reduction")
        if self.parallelism == "pipeline":
            if not isinstance(model_cfg, DecoderConfig):
                raise ValueError(f"{cfg.model} is an encoder-decoder; pipelines of built-in models "
                                 "cut decoders only")
            if model_cfg.tie_embeddings:
                raise ValueError(f"{cfg.model} ties its input and output embeddings, which a pipeline "
                                 "would need on its first and last stage at once; not supported")
            if model_cfg.num_layers < self.num_stages:
                raise ValueError(f"{cfg.model} has {model_cfg.num_layers} blocks, fewer than the "
                                 f"{self.num_stages} stages of {self.schedule} on {self.world_size} ranks")
            if cfg.num_micro_batches < self.num_stages:
                raise ValueError(f"{cfg.num_micro_batches} micro-batches (batch / micro-batch) are fewer "
                                 f"than the {self.num_stages} stages of {self.schedule} on "
                                 f"{self.world_size} ranks: raise the batch")
        elif cfg.batch % (self.world_size * cfg.micro_batch):
            raise ValueError(f"batch {cfg.batch} cannot be split evenly into micro-batches of "
                             f"{cfg.micro_batch} between {self.world_size} FSDP ranks")

    def micro_batches_per_rank(self, cfg: TrainConfig) -> int:
        """Forward/backward passes of one rank per iteration (and stage, for a pipeline)."""
        if self.parallelism == "pipeline":
            return cfg.num_micro_batches
        return cfg.batch // (self.world_size * cfg.micro_batch)

    def describe(self, model_cfg: DecoderConfig | EncoderDecoderConfig) -> dict[str, Any]:
        """What profiles record as ``builtin_model.job``."""
        out: dict[str, Any] = {"parallelism": self.parallelism, "world_size": self.world_size}
        if self.parallelism == "pipeline":
            assert isinstance(model_cfg, DecoderConfig)
            out.update(schedule=self.schedule, num_stages=self.num_stages,
                       stages_of_rank=[self.stages_of(r) for r in range(self.world_size)],
                       stage_layers=[[r.start, r.stop] for r in (
                           self.stage_layers(s, model_cfg.num_layers) for s in range(self.num_stages))])
        return out


def train(cfg: TrainConfig, steps: int,
          model_config: DecoderConfig | EncoderDecoderConfig | None = None,
          job: JobConfig | None = None) -> None:
    """Build the model and optimizer and train for ``steps`` iterations (see module docstring),
    as rank ``job.rank`` of ``job`` if given.

    ``model_config`` replaces the shapes of ``cfg.model`` (small models for tests)."""
    model_cfg = model_config if model_config is not None else CONFIGS[cfg.model]
    if job is None:
        model = build_model(model_cfg, cfg.seq).to(PRECISIONS[cfg.precision][0])
        _train_data_parallel(cfg, steps, model_cfg, model, cfg.num_micro_batches)
        return
    job.check(cfg, model_cfg)
    with _process_group(job):
        if job.parallelism == "pipeline":
            assert isinstance(model_cfg, DecoderConfig)  # job.check
            _train_pipeline(cfg, steps, model_cfg, job)
        else:
            _train_fsdp(cfg, steps, model_cfg, job)


def _optimizer(cfg: TrainConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The optimizer of ``cfg`` over ``params``; None for adamw-in-backward, whose
    per-parameter optimizers step from gradient hooks."""
    if cfg.optimizer == "adamw-in-backward":
        per_param: dict[torch.Tensor, torch.optim.Optimizer] = {
            p: torch.optim.AdamW([p], lr=cfg.lr, foreach=False) for p in params}

        def step_in_backward(p: torch.Tensor) -> None:
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(step_in_backward)
        return None
    if cfg.optimizer.startswith("adamw"):
        return torch.optim.AdamW(params, lr=cfg.lr, foreach=cfg.optimizer == "adamw-foreach")
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, foreach=False)


def _train_data_parallel(cfg: TrainConfig, steps: int, model_cfg: DecoderConfig | EncoderDecoderConfig,
                         model: nn.Module, num_passes: int) -> None:
    """``num_passes`` forward/backward passes of ``cfg.micro_batch`` sequences, then a step."""
    opt = _optimizer(cfg, list(model.parameters()))
    vocab = model_cfg.vocab_size
    for _ in range(steps):
        for _ in range(num_passes):
            if isinstance(model_cfg, DecoderConfig):
                tokens = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq + 1))
                logits = model(tokens[:, :-1])
                labels = tokens[:, 1:]
            else:
                inputs = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq))
                targets = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq + 1))
                logits = model(inputs, targets[:, :-1])
                labels = targets[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)) / num_passes
            del logits
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)


# NOTE [ One rank of a fake job ]: one process plays rank r of a world of W through PyTorch's
# fake process group (``torch.testing._internal.distributed.fake_pg``): every collective and
# point-to-point op returns at once without moving data, and the tracer sees the same c10d ops
# as with a real backend (docs/distributed-notes.md, section d). What needs values a fake
# group does not carry is avoided: the pipeline stages get their shapes up front (no shape
# inference by messages; the schedule's vote on static shapes reads ``.item()``, which the
# fake tracer answers 1: static), and FSDP2's DeviceMesh is built with the fake mode off
# (it computes its coordinates with ``nonzero``). DDP is not offered: its C++ reducer reads
# tensor data, which fake tensors do not have.
@contextmanager
def _process_group(job: JobConfig) -> Iterator[None]:
    """A fake process group for ``job`` while inside; the caller's own group (a real job's,
    under torchrun) if it made one, which must then be ``job``'s."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        place = dist.get_rank(), dist.get_world_size()
        if place != (job.rank, job.world_size):
            raise ValueError(f"this process is rank {place[0]} of {place[1]}, not rank {job.rank} "
                             f"of {job.world_size} as the job says")
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=job.rank, world_size=job.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _pipeline_stage(cfg: TrainConfig, model_cfg: DecoderConfig, job: JobConfig, stage: int) -> Any:
    from torch.distributed.pipelining import PipelineStage

    dtype = PRECISIONS[cfg.precision][0]
    first, last = stage == 0, stage == job.num_stages - 1
    module = Decoder(model_cfg, cfg.seq, job.stage_layers(stage, model_cfg.num_layers), first, last).to(dtype)
    # One micro-batch's shapes, given up front (NOTE [ One rank of a fake job ]). A hidden
    # state requires grad, or its stage would send no gradient back.
    mb, t = cfg.micro_batch, cfg.seq
    hidden = torch.empty(mb, t, model_cfg.hidden, dtype=dtype, requires_grad=True)
    inputs = torch.empty(mb, t, dtype=torch.long) if first else hidden
    outputs = torch.empty(mb, t, model_cfg.vocab_size, dtype=dtype) if last else hidden
    return PipelineStage(module, stage, job.num_stages, torch.device("cpu"), input_args=inputs,
                         output_args=outputs)


def _train_pipeline(cfg: TrainConfig, steps: int, model_cfg: DecoderConfig, job: JobConfig) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    mine = job.stages_of(job.rank)
    stages = [_pipeline_stage(cfg, model_cfg, job, s) for s in mine]
    vocab = model_cfg.vocab_size

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    n = cfg.num_micro_batches
    schedule: Any
    if job.schedule == "1f1b":
        schedule = Schedule1F1B(stages[0], n, loss_fn=loss_fn)
    elif job.schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
    else:
        schedule = ScheduleZBVZeroBubble(stages, n, loss_fn=loss_fn)
    opt = _optimizer(cfg, [p for st in stages for p in st.submod.parameters()])
    assert opt is not None  # job.check refuses adamw-in-backward
    has_first, has_last = 0 in mine, job.num_stages - 1 in mine
    for _ in range(steps):
        # the whole batch; the schedule splits it into micro-batches along the batch
        tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq + 1)) if has_first or has_last else None
        # contiguous: PyTorch 2.11 checks the stage input's strides against the (mb, seq) it was built with
        inputs = (tokens[:, :-1].contiguous(),) if tokens is not None and has_first else ()
        if tokens is not None and has_last:
            schedule.step(*inputs, target=tokens[:, 1:], losses=[])
        else:
            schedule.step(*inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _train_fsdp(cfg: TrainConfig, steps: int, model_cfg: DecoderConfig | EncoderDecoderConfig,
                job: JobConfig) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with unset_fake_temporarily():  # NOTE [ One rank of a fake job ]
        mesh = init_device_mesh("cpu", (job.world_size,))
    model = build_model(model_cfg, cfg.seq).to(PRECISIONS[cfg.precision][0])
    if isinstance(model, Decoder):
        blocks = list(model.layers.values())
    else:  # a stack's first block holds the position bias the stack computes outside its
        # blocks: it stays with the root, which is unsharded around the whole forward
        assert isinstance(model, EncoderDecoder)
        blocks = [b for b in (*model.encoder, *model.decoder)
                  if b.self_attention.relative_attention_bias is None]  # type: ignore[union-attr]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_data_parallel(cfg, steps, model_cfg, model, job.micro_batches_per_rank(cfg))
