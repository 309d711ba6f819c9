"""A background thread fills reused batch buffers with the next batch (``--buffers 2``: double
buffered, the thread writing one while the step reads the other; ``--buffers 1``: the thread
writes while the step waits for it). Its ``copy_`` ops run on its own thread, where teraio's
dispatch mode does not see them."""

import argparse
import queue
import threading

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--buffers", type=int, default=2, choices=[1, 2])
p.add_argument("--save")
args = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
inputs = [torch.empty(256, 128) for _ in range(args.buffers)]
labels = [torch.empty(256, dtype=torch.long) for _ in range(args.buffers)]
free: queue.Queue[int] = queue.Queue()
ready: queue.Queue[int] = queue.Queue()


def produce() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        i = free.get()
        inputs[i].copy_(torch.randn(256, 128, generator=g))
        labels[i].copy_(torch.randint(0, 10, (256,), generator=g))
        ready.put(i)


for i in range(args.buffers):
    free.put(i)
producer = threading.Thread(target=produce, daemon=True)
producer.start()
for step in range(args.steps):
    i = ready.get()
    loss = nn.functional.cross_entropy(model(inputs[i]), labels[i])
    opt.zero_grad()
    loss.backward()
    opt.step()
    free.put(i)
    print(f"step {step} loss {loss.item()!r}", flush=True)
producer.join()
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
