"""An LSTM or GRU language model over padded batches, packed with pack_padded_sequence (the same
lengths every step, or other ones with --vary; in the model, or in a DataLoader's collate_fn with
--collate, on a producer thread of the script's own with --thread too) and unpacked with
pad_packed_sequence."""

import argparse
import queue
import threading

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save")
p.add_argument("--cell", choices=["lstm", "gru"], default="lstm")
p.add_argument("--vary", action="store_true", help="other lengths every step")
p.add_argument("--collate", action="store_true", help="pack in the DataLoader's collate_fn")
p.add_argument("--thread", action="store_true", help="make the batches on a producer thread")
args = p.parse_args()
torch.manual_seed(0)
V, E, H, T, B = 500, 64, 128, 24, 16


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.rnn = (nn.LSTM if args.cell == "lstm" else nn.GRU)(E, H, num_layers=2, batch_first=True)
        self.out = nn.Linear(H, V)

    def forward(self, x: torch.Tensor | PackedSequence, lengths: torch.Tensor) -> torch.Tensor:
        if isinstance(x, PackedSequence):
            packed = x._replace(data=self.emb(x.data))
        else:
            packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        y, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=T)
        return self.out(y)


g = torch.Generator().manual_seed(1)
fixed = torch.randint(T // 2, T + 1, (B,), generator=g)
fixed[0] = T
batches = []
for _ in range(args.steps):
    lengths = torch.randint(4, T + 1, (B,), generator=g) if args.vary else fixed
    x = torch.randint(1, V, (B, T + 1), generator=g) * (torch.arange(T + 1)[None, :] < lengths[:, None] + 1)
    batches.append((x, lengths))


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[object, torch.Tensor, torch.Tensor]:
    x, lengths = items[0]
    if args.collate:
        return pack_padded_sequence(x[:, :-1], lengths, batch_first=True, enforce_sorted=False), x[:, 1:], lengths
    return x[:, :-1], x[:, 1:], lengths


model = LM()
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
loader = torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=collate)
if args.thread:
    ready: queue.Queue = queue.Queue(maxsize=1)
    threading.Thread(target=lambda: [ready.put(collate([b])) for b in batches], daemon=True).start()
    loader = (ready.get() for _ in batches)  # type: ignore[assignment]
for step, (inputs, target, lengths) in enumerate(loader):
    logits = model(inputs, lengths)
    loss = nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item()!r}", flush=True)
if args.save:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
