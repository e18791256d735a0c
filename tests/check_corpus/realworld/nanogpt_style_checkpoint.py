"""nanoGPT's checkpoint: the model's arguments and the run's configuration are saved as plain
dicts (the GPTConfig dataclass is rebuilt from model_args on resume), so torch.load reads the file
with weights_only=True.

    torchrun --standalone --nproc_per_node=8 nanogpt_style_checkpoint.py
"""
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

n_layer, n_embd, init_from, out_dir = 2, 32, "scratch", "out"
config = {k: v for k, v in globals().items() if k in ("n_layer", "n_embd", "init_from", "out_dir")}


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_embd: int = 768


class GPT(torch.nn.Module):
    def __init__(self, conf):
        super().__init__()
        self.config = conf
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(conf.n_embd, conf.n_embd) for _ in range(conf.n_layer)])

    def forward(self, x):
        return self.blocks(x)


dist.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
master_process = int(os.environ["RANK"]) == 0
model_args = dict(n_layer=n_layer, n_embd=n_embd)
iter_num, best_val_loss = 0, 1e9
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu")
    model_args.update(checkpoint["model_args"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
gptconf = GPTConfig(**model_args)
model = GPT(gptconf)
raw_model = model
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
for iter_num in range(iter_num, iter_num + 10):
    loss = model(torch.randn(4, n_embd)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process and iter_num % 5 == 0:
        checkpoint = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_args": model_args,
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": config,
        }
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
dist.destroy_process_group()
