"""A classifier trained from a map-style Dataset through a DataLoader with worker processes.

Batches arrive from the workers through shared memory (and, with --pin-memory,
through the pin-memory thread), so their storages are born outside the
training thread's ops.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Blobs(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(64, generator=g)
        return x, (x[:32].sum() > x[32:].sum()).long()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pin-memory", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Blobs(), batch_size=16, shuffle=True, num_workers=args.workers,
                        pin_memory=args.pin_memory, generator=torch.Generator().manual_seed(1))
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item()!r}", flush=True)
            step += 1
            if step == args.steps:
                break
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
