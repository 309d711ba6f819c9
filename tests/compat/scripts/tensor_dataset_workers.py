"""An in-memory TensorDataset read only by DataLoader worker processes, forked again for each
epoch (no persistent workers), as a small script on the CPU does; with --thread, the epochs'
iterators are made on a background thread that feeds a queue (a prefetcher)."""
import argparse
import queue
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--thread", action="store_true")
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = torch.randn(2048, 512, generator=g)  # 4 MiB
labels = torch.randint(0, 10, (2048,), generator=g)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(data, labels), batch_size=512, shuffle=True, num_workers=args.workers,
                    generator=torch.Generator().manual_seed(2))


def epochs():
    while True:
        yield from loader


batches = epochs()
if args.thread:
    fed: queue.Queue = queue.Queue(maxsize=1)

    def feed() -> None:
        try:
            for b in epochs():
                fed.put(b)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            fed.put(e)

    threading.Thread(target=feed, daemon=True).start()
    batches = iter(fed.get, None)
for step in range(args.steps):
    b = next(batches)
    if isinstance(b, BaseException):
        raise b
    x, y = b
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save(model.state_dict(), args.save)
