"""Hugging Face Accelerate: the library handles no_sync, the device and the rank-0 checks.
The checker must report nothing here.

    accelerate launch --multi_gpu --num_processes 4 accelerate_style.py
"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    accelerator = Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")
    model = torch.nn.Linear(32, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(3):
        for step, (x, y) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if step % 10 == 0:
                mean_loss = accelerator.gather(loss.detach()).mean()
                if accelerator.is_main_process:
                    print(f"epoch {epoch} step {step} loss {mean_loss.item():.4f}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), "model.pt")


if __name__ == "__main__":
    main()
