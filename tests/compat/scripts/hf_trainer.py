"""A GPT-2-shaped causal LM (config built in code) trained by the transformers Trainer;
with --save-steps N, the Trainer saves a checkpoint every N steps (model.safetensors,
optimizer.pt, ...) under --out."""

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Ramps(Dataset):
    """Token ramps with a random start and stride: an easy, deterministic language."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossPrinter(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        print(f"step {self.state.global_step} loss {loss.item()!r}", flush=True)
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save")
    p.add_argument("--out", default="trainer-out")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    args = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8,
                              learning_rate=1e-3, logging_steps=1000, report_to=[],
                              save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
                              use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = LossPrinter(model=model, args=targs, train_dataset=Ramps(64, 32, 256))
    trainer.train()
    if args.save:
        torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
