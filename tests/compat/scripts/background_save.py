"""Checkpoints written by torch.save on a background thread, as async checkpointing does by hand:
after the steps of ``--save-at``, the model's and optimizer's state dicts handed to a thread that
saves them while the next step trains (``--overlap``), or joined at once."""

import argparse
import threading

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
p.add_argument("--overlap", action="store_true", help="join each saving thread a step later")
p.add_argument("--save-at", type=int, nargs="*", default=[3, 4])
p.add_argument("--checkpoint-dir", default=".")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
saving = None
for step in range(args.steps):
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
    if saving is not None:
        saving.join()
        saving = None
    if step in args.save_at:
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        saving = threading.Thread(target=torch.save, args=(state, f"{args.checkpoint_dir}/checkpoint-{step}.pt"))
        saving.start()
        if not args.overlap:
            saving.join()
            saving = None
if saving is not None:
    saving.join()
if args.save:
    torch.save(model.state_dict(), args.save)
