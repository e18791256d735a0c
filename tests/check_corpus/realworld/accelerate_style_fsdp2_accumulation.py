"""Accelerate with its FSDP2 plugin: `accelerator.accumulate(model)` turns gradient sync off on
every micro-step but the last (through set_requires_gradient_sync on FSDP2 models), and the
optimizer it prepared steps only when the gradients were synced.

    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 8 accelerate_style_fsdp2_accumulation.py
"""
import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard


def build(dim=64):
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def main(loader, accum_steps=4):
    accelerator = Accelerator(gradient_accumulation_steps=accum_steps,
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if (step + 1) % accum_steps == 0:
            mean_loss = accelerator.gather(loss.detach()).mean().item()   # every rank joins the gather
            if accelerator.is_main_process:
                print(f"step {step + 1}: loss {mean_loss:.4f}")
