"""A training loop that evaluates and saves a checkpoint between steps, as real loops do.

--eval-after N and --save-after N (repeatable) run an evaluation (model.eval(),
torch.no_grad()) and a torch.save of the model's and optimizer's state dicts
after step N; the checkpoint goes to CHECKPOINT_DIR/step-N.pt.
"""

import argparse
from pathlib import Path

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--eval-after", type=int, action="append", default=[])
p.add_argument("--save-after", type=int, action="append", default=[])
p.add_argument("--checkpoint-dir", default="checkpoints")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 1024), nn.Dropout(0.1), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
held_out = torch.randn(256, 128, generator=g), torch.randint(0, 10, (256,), generator=g)
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if step in args.eval_after:
        model.eval()
        with torch.no_grad():
            logits = model(held_out[0])
            accuracy = (logits.argmax(1) == held_out[1]).float().mean()
        model.train()
        print(f"eval {step} loss {nn.functional.cross_entropy(logits, held_out[1]).item()!r} "
              f"accuracy {accuracy.item()!r}", flush=True)
    if step in args.save_after:
        Path(args.checkpoint_dir).mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                   Path(args.checkpoint_dir) / f"step-{step}.pt")
if args.save:
    torch.save(model.state_dict(), args.save)
