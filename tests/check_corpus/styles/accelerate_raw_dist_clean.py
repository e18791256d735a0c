"""Accelerate prepares the model and loader; every process meets at the barrier after the save."""
import torch
import torch.distributed as dist
from accelerate import Accelerator


def train(model, loader, epochs=3):
    accelerator = Accelerator(gradient_accumulation_steps=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        if accelerator.is_main_process:
            accelerator.save(accelerator.unwrap_model(model).state_dict(), f"epoch{epoch}.pt")
        dist.barrier()
