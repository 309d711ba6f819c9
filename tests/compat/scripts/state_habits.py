"""Habits that touch tensors outside the training ops: ``--habit share`` puts the model in shared
memory first (``share_memory()``, as for Hogwild or a DataLoader worker that reads it); ``copies``
evaluates under ``torch.inference_mode()`` after each step and, mid-step, keeps a deep copy of
the optimizer's state, a pickle of it and a ``torch.save`` of a weight's legacy ``storage()``;
``best-state`` keeps a deep copy of the model's state after each forward pass."""

import argparse
import copy
import io
import pickle
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--habit", choices=["share", "copies", "best-state"], default="copies")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 10))
if args.habit == "share":
    model.share_memory()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
held = torch.randn(256, 128, generator=g)
kept: list[object] = []
for step in range(args.steps):
    x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    if args.habit == "best-state":  # the model's state kept aside, as for the best checkpoint
        kept.append(copy.deepcopy(model.state_dict()))
    if args.habit == "copies" and step:
        kept.append(copy.deepcopy(opt.state_dict()))
        kept.append(pickle.loads(pickle.dumps(opt.state_dict()["state"][2])))
        blob = io.BytesIO()
        torch.save(opt.state[model[3].weight]["exp_avg"].storage(), blob)
        loaded = torch.load(io.BytesIO(blob.getvalue()), weights_only=False)
        kept.append(torch.empty(0).set_(loaded).clone())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.habit == "copies":
        with torch.inference_mode():
            kept.append(model(held).argmax(-1).float().mean().item())
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "kept": kept}, args.save)
