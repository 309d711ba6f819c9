"""A small GPT language-model trainer in plain PyTorch: teraio's built-in example.

It builds the model from code and trains on synthetic token sequences it
generates itself (a noisy periodic pattern, so the loss falls), seeded, and
prints one line per step, ``step N loss X`` with X at full precision, so two
runs can be compared as text. Nothing here knows about teraio.

    python examples/train_gpt.py --layers 4 --hidden 256 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, h)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int,
                 checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            # Activation checkpointing per block: keep only the block's input, recompute the
            # rest in backward (non-reentrant, PyTorch's recommended form).
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.ln(x))


def batch(gen: torch.Generator, vocab: int, size: int, seq: int, device: str) -> torch.Tensor:
    """(size, seq + 1) int64 tokens: a random-offset, random-stride ramp with 10% noise."""
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    stride = torch.randint(1, 8, (size, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(size, seq + 1, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, (size, seq + 1), generator=gen), tokens)
    return tokens.to(device)


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (Linux: proc(5), /proc/pid/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float | None:
    """Peak RSS since the last reset (VmHWM), in MiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def offloading(kind: str | None, model: nn.Module) -> tuple[Callable[..., Any], Any]:
    """(the model to step, a context for its forward pass) for ``--offload``: the activation
    offloading a user would pick instead of teraio on one GPU (bench/rok_gpu.py compares them).

    - ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every tensor saved
      for backward goes to pinned host memory when saved and comes back when backward needs it,
      synchronously.
    - ``torchtune``: torchtune's ``OffloadActivations`` (pinned memory, a side stream, its
      defaults), one instance for the whole run as torchtune's recipes use it.
    - ``compiled``: torch.compile with PyTorch's compiled activation offloading
      (``torch._functorch.config.enable_activation_offloading``, its side stream, wait sinking and
      reload prefetch where this PyTorch has them); ``compiled_sync``: the same without the side
      stream (synchronous copies in the graph). Nodes are marked for offload through
      ``joint_custom_pass`` setting ``node.meta["should_offload"]``, as PyTorch's own tests do; the
      partitioner offloads those of them it saves for backward. (``CheckpointPolicy.MUST_CPU_OFFLOAD``
      exists in 2.11-2.13, but no partitioner code reads it there.)
    """
    if kind == "save_on_cpu":
        return model, torch.autograd.graph.save_on_cpu(pin_memory=True)
    if kind == "torchtune":
        from torchtune.training import OffloadActivations

        return model, OffloadActivations()
    if kind in ("compiled", "compiled_sync"):
        import torch._functorch.config as functorch_config

        def mark_all(gm: Any, _inputs: Any) -> Any:
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    node.meta["should_offload"] = True
            return gm

        side_stream = kind == "compiled"
        for name, value in [("enable_activation_offloading", True), ("joint_custom_pass", mark_all),
                            ("activation_offload_separate_stream", side_stream),
                            ("activation_offload_sink_wait", side_stream), ("activation_reload_prefetch", side_stream)]:
            if hasattr(functorch_config, name):
                setattr(functorch_config, name, value)
        return torch.compile(model), contextlib.nullcontext()
    return model, contextlib.nullcontext()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW's multi-tensor (foreach) implementation, PyTorch's default on CUDA: "
                        "one op updates every parameter at once")
    p.add_argument("--compile", action="store_true",
                   help="train the model through torch.compile (under teraio it runs eagerly)")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing per transformer block (torch.utils.checkpoint, "
                        "use_reentrant=False): the blocks' activations are recomputed in backward")
    p.add_argument("--offload", choices=["save_on_cpu", "torchtune", "compiled", "compiled_sync"],
                   help="offload activations to host memory the way a user would without teraio "
                        "(see offloading() in this file); the compiled ones imply torch.compile")
    p.add_argument("--save", help="write the final parameters here (torch.save of state_dict)")
    p.add_argument("--timing", action="store_true",
                   help="also print each step's wall time, its peak RSS (MiB, Linux) and on CUDA its "
                        "peak of allocated device memory (MiB). Under `teraio run` the peaks are "
                        "not the step's: teraio restarts both counters at each iteration boundary "
                        "(inside opt.step) and reports its own per-iteration peaks")
    args = p.parse_args()
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads,
                checkpointed=args.checkpoint).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True if args.foreach else None)
    step_model, forward_context = offloading(args.offload, model)
    if args.compile and args.offload not in ("compiled", "compiled_sync"):
        step_model = torch.compile(model)
    for step in range(args.steps):
        if args.timing:
            reset_peak_rss()
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        tokens = batch(gen, args.vocab, args.batch, args.seq, args.device)
        with forward_context:
            logits = step_model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        line = f"step {step} loss {loss.item()!r}"
        if args.timing:
            line += f" time_ms {(time.perf_counter() - t0) * 1e3:.3f}"
            rss = peak_rss_mib()
            if rss is not None:
                line += f" peak_rss_mib {rss:.1f}"
            if args.device.startswith("cuda"):
                line += f" peak_cuda_mib {torch.cuda.max_memory_allocated() / 2**20:.1f}"
        print(line, flush=True)
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
