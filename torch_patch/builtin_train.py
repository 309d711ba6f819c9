"""The training loop of ``teraio profile --fake --model NAME``.

One iteration is the paper's (and TorchTitan's): ``batch // micro_batch``
forward/backward passes of ``micro_batch`` sequences each, their gradients
accumulated (each loss divided by the number of passes), then one optimizer
step and ``zero_grad(set_to_none=True)``. Data are random token ids. Meant to
run inside a ``FakeTracer`` (it allocates the whole model otherwise); it runs
``steps`` iterations or until the tracer stops it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torch_patch.models import CONFIGS, DecoderConfig, EncoderDecoderConfig, build_model

__all__ = ["OPTIMIZERS", "PRECISIONS", "TrainConfig", "train"]

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


def train(cfg: TrainConfig, steps: int,
          model_config: DecoderConfig | EncoderDecoderConfig | None = None) -> None:
    """Build the model and optimizer and train for ``steps`` iterations (see module docstring).

    ``model_config`` replaces the shapes of ``cfg.model`` (small models for tests)."""
    model_cfg = model_config if model_config is not None else CONFIGS[cfg.model]
    dtype = PRECISIONS[cfg.precision][0]
    model = build_model(model_cfg, cfg.seq).to(dtype)
    params = list(model.parameters())
    opt: torch.optim.Optimizer | None = None
    if cfg.optimizer == "adamw-in-backward":
        per_param: dict[torch.Tensor, torch.optim.Optimizer] = {
            p: torch.optim.AdamW([p], lr=cfg.lr, foreach=False) for p in params}

        def step_in_backward(p: torch.Tensor) -> None:
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(step_in_backward)
    elif cfg.optimizer.startswith("adamw"):
        opt = torch.optim.AdamW(params, lr=cfg.lr, foreach=cfg.optimizer == "adamw-foreach")
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, foreach=False)
    vocab = model_cfg.vocab_size
    n = cfg.num_micro_batches
    for _ in range(steps):
        for _ in range(n):
            if isinstance(model_cfg, DecoderConfig):
                tokens = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq + 1))
                logits = model(tokens[:, :-1])
                labels = tokens[:, 1:]
            else:
                inputs = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq))
                targets = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq + 1))
                logits = model(inputs, targets[:, :-1])
                labels = targets[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)) / n
            del logits
            loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
