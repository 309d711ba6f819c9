"""Two trainings in one script, one after the other: the first model's state dict is kept (views
of its weights; with --keep-optimizer its optimizer's too, the Adam moments) and the model and its
optimizer dropped before the second model trains. With --up-front both models are built before
the first training and trained with plain SGD (no optimizer state), and the first is kept as the
list of its parameters: no iteration differs from the others. With --keep-model the first model
itself is kept (an ensemble's), bound to a name while the second trains."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5, help="steps per training")
p.add_argument("--keep-optimizer", action="store_true")
p.add_argument("--up-front", action="store_true")
p.add_argument("--keep-model", action="store_true")
p.add_argument("--save")
args = p.parse_args()


def build(run: int) -> nn.Module:
    torch.manual_seed(run)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def train(run: int, model: nn.Module | None = None) -> dict[str, object]:
    model = model or build(run)
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=1e-2) if args.up_front else torch.optim.Adam(params, lr=1e-3)
    g = torch.Generator().manual_seed(100 + run)
    for step in range(args.steps):
        x, y = torch.randn(64, 128, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {run * args.steps + step} loss {loss.item()!r}", flush=True)
    if args.up_front:  # no op between the trainings
        return {"model": list(model.parameters())}
    if args.keep_model:
        return {"model": model}
    return {"model": model.state_dict(), "opt": opt.state_dict() if args.keep_optimizer else None}


models = [build(0), build(1)] if args.up_front else [None, None]
first = train(0, models.pop(0))
second = train(1, models.pop(0))
if args.save:
    if args.keep_model:
        first, second = ({"model": r["model"].state_dict()} for r in (first, second))
    torch.save({"first": first, "second": second}, args.save)
