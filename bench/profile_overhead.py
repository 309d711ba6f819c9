"""Cost of the profiling tracer, measured side by side in one run.

1. Per-op cost: a loop of small element-wise ops with and without the tracer
   recording; (traced - plain) / number of ops.
2. Iteration time of the example GPT trainer under the recording tracer over
   its plain iteration time (medians, plain and traced blocks alternated).

    python bench/profile_overhead.py [--rounds 3] [-- example args]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPT, batch  # noqa: E402

from torch_patch import Tracer  # noqa: E402


def recording_tracer() -> Tracer:
    tracer = Tracer(warmup=1, iters=10**9)
    tracer.__enter__()
    tracer.explicit_boundary()  # end the warm-up at once: record from here on
    return tracer


def per_op_us(num_ops: int = 20_000) -> tuple[float, float]:
    x = torch.ones(16)

    def loop() -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(num_ops):
            y = y + 1.0
        return time.perf_counter() - t0

    loop()
    plain = min(loop() for _ in range(3))
    tracer = recording_tracer()
    try:
        traced = min(loop() for _ in range(3))
    finally:
        tracer.__exit__(None, None, None)
    return plain / num_ops * 1e6, (traced - plain) / num_ops * 1e6


def gpt_step_times(args: argparse.Namespace, steps: int, traced: bool) -> list[float]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    tracer = recording_tracer() if traced else None
    try:
        model = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            tokens = batch(gen, args.vocab, args.batch, args.seq, "cpu")
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i:  # step 0 creates the optimizer state
                times.append(time.perf_counter() - t0)
    finally:
        if tracer is not None:
            tracer.__exit__(None, None, None)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args()

    plain_op, extra_op = per_op_us()
    plain, traced = [], []
    for _ in range(args.rounds):
        plain += gpt_step_times(args, args.steps, traced=False)
        traced += gpt_step_times(args, args.steps, traced=True)
    mp, mt = statistics.median(plain), statistics.median(traced)
    print(f"tracer cost per op      {extra_op:8.2f} us (plain op {plain_op:.2f} us)")
    print(f"example iteration       plain {mp * 1e3:8.2f} ms   profiled {mt * 1e3:8.2f} ms")
    print(f"profiled / plain        {mt / mp:8.3f}x   (goal: at most 1.5x)")


if __name__ == "__main__":
    main()
