"""The example GPT of ``train_gpt.py`` trained pipeline-parallel with ``torch.distributed.pipelining``.

Run it under torchrun (gloo on a CPU, nccl on CUDA), one pipeline rank per process:

    torchrun --nproc-per-node 2 examples/train_gpt_pp.py --schedule zbv --layers 4 --steps 5

The model is cut into stages along its blocks (the embeddings go with the
first stage, the final norm and the head with the last), as evenly as the
block count allows; ``--layers`` must be at least the number of stages.
``--schedule`` picks the schedule and with it where the stages live (W ranks):

- ``1f1b``: ``Schedule1F1B``, W stages, stage r on rank r;
- ``interleaved-1f1b``: ``ScheduleInterleaved1F1B``, 2W stages (two model
  chunks per rank), rank r holds stages r and r + W (a loop);
- ``zbv``: ``ScheduleZBVZeroBubble``, 2W stages, rank r holds stages r and
  2W - 1 - r (a V: the last stage is on rank 0 beside the first).

Every step draws one seeded ``--batch`` (``train_gpt.batch``: the data of
``train_gpt.py``), which the schedule splits into ``--microbatches`` along the
batch; every rank builds the whole seeded GPT, so the stages start from the
weights ``train_gpt.py`` starts from, and keeps its own stages. Each rank steps
one AdamW over its stages' parameters after ``schedule.step()``. The rank
holding the last stage prints ``step N loss X``, X the mean of the
micro-batch losses (the schedule scales the gradients to match) at full
precision. ``--save PATH``: each rank writes its stages' final parameters to
``PATH.rank{r}``, keyed as in the ``GPT`` state dict, so the union of the
files is the whole model. Nothing here knows about teraio.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.pipelining.stage import _PipelineStageBase
from train_gpt import GPT, Block, batch
from train_gpt_ddp import add_model_args, init_distributed, step_timer

SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv")


class GPTStage(nn.Module):
    """Blocks ``lo..hi-1`` of a GPT, with its embeddings on the first stage and its final
    norm and head on the last. Submodules keep their GPT names (``blocks.2.ln1.weight``)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = gpt.tok if first else None
        self.pos = gpt.pos if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        self.ln = gpt.ln if last else None
        self.head = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:  # (b, t) tokens -> (b, t, hidden)
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        block: Block
        for block in self.blocks.values():  # type: ignore[assignment]
            x = block(x)
        if self.ln is not None and self.head is not None:  # -> (b, t, vocab) logits
            x = self.head(self.ln(x))
        return x


def stages_of(schedule: str, rank: int, world: int) -> tuple[int, list[int]]:
    """(number of stages, this rank's stage indices in the order the schedule takes them)."""
    if schedule == "1f1b":
        return world, [rank]
    if schedule == "interleaved-1f1b":
        return 2 * world, [rank, rank + world]
    if schedule == "zbv":
        return 2 * world, [rank, 2 * world - 1 - rank]
    raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--microbatches", type=int, default=4,
                   help="micro-batches per step; they split --batch, and zbv needs at least as "
                        "many as there are stages")
    p.add_argument("--timing", action="store_true",
                   help="also print each step's wall time on the printing rank (time_ms, for bench/jobs.py)")
    p.add_argument("--save", help="each rank writes its stages' final parameters to SAVE.rank{r}")
    args = p.parse_args()
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")
    if args.batch % args.microbatches:
        p.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    rank, world, device = init_distributed()
    try:
        num_stages, mine = stages_of(args.schedule, rank, world)
        if args.layers < num_stages:
            p.error(f"--layers {args.layers} is less than the {num_stages} stages of "
                    f"{args.schedule} on {world} ranks")
        torch.manual_seed(args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        gpt = GPT(args.vocab, args.seq, args.layers, args.hidden, args.heads)
        rows = args.batch // args.microbatches
        stages: list[_PipelineStageBase] = []
        for s in mine:
            first, last = s == 0, s == num_stages - 1
            module = GPTStage(gpt, s * args.layers // num_stages, (s + 1) * args.layers // num_stages,
                              first, last).to(device)
            # Shapes given up front (one micro-batch), so no stage infers them at run time; a
            # hidden state requires grad, or its stage would send no gradient back.
            hidden = torch.empty(rows, args.seq, args.hidden, device=device, requires_grad=True)
            inputs = torch.empty(rows, args.seq, dtype=torch.long, device=device) if first else hidden
            outputs = torch.empty(rows, args.seq, args.vocab, device=device) if last else hidden
            stages.append(PipelineStage(module, s, num_stages, device, input_args=inputs,
                                        output_args=outputs))
        del gpt

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

        schedule: PipelineScheduleSingle | PipelineScheduleMulti
        if args.schedule == "1f1b":
            schedule = Schedule1F1B(stages[0], args.microbatches, loss_fn=loss_fn)
        elif args.schedule == "interleaved-1f1b":
            schedule = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
        else:
            schedule = ScheduleZBVZeroBubble(stages, args.microbatches, loss_fn=loss_fn)
        has_first = 0 in mine
        has_last = num_stages - 1 in mine
        params = [q for st in stages for q in st.submod.parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr)
        took = step_timer(args.timing)
        for step in range(args.steps):
            t0 = time.perf_counter()
            tokens = batch(gen, args.vocab, args.batch, args.seq, "cpu").to(device)
            losses: list[torch.Tensor] = []
            opt.zero_grad(set_to_none=True)
            # contiguous: torch 2.11's stages check an input's strides against the first one's
            inputs_ = (tokens[:, :-1].contiguous(),) if has_first else ()
            if has_last:
                schedule.step(*inputs_, target=tokens[:, 1:].contiguous(), losses=losses)
            else:
                schedule.step(*inputs_)
            opt.step()
            if has_last:
                print(f"step {step} loss {torch.stack(losses).mean().item()!r}{took(t0)}", flush=True)
        if args.save:
            state: dict[str, torch.Tensor] = {}
            for st in stages:
                state.update(st.submod.state_dict())
            torch.save(state, f"{args.save}.rank{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
