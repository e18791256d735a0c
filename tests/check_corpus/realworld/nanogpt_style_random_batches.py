"""nanoGPT's loop: every step draws a random batch from the token file (get_batch), so a checkpoint
every eval_interval iterations needs only iter_num; there is no position in an epoch to lose.

    torchrun --standalone --nproc_per_node=8 nanogpt_style_random_batches.py
"""
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

block_size, batch_size, eval_interval, max_iters, init_from = 64, 12, 250, 5000, "resume"


def get_batch(data):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    master_process = int(os.environ["RANK"]) == 0
    data = np.memmap("train.bin", dtype=np.uint16, mode="r")
    raw_model = torch.nn.Embedding(50304, 50304)
    model = DDP(raw_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
    torch.manual_seed(1337 + int(os.environ["RANK"]))   # after the model: each rank draws its own batches
    iter_num = 0
    if init_from == "resume":
        checkpoint = torch.load("out/ckpt.pt", map_location="cpu", weights_only=True)
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num = checkpoint["iter_num"]
    while iter_num < max_iters:
        if iter_num % eval_interval == 0 and master_process:
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
            torch.save(checkpoint, "out/ckpt.pt")
        X, Y = get_batch(data)
        logits = model(X)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
