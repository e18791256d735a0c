"""A training script in the style of nanoGPT's train.py: one file, single process or DDP depending
on RANK, accumulation through require_backward_grad_sync, the master process logs and saves.

    python nanogpt_style.py
    torchrun --standalone --nproc_per_node=8 nanogpt_style.py
"""
import math
import os
import time

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig

out_dir = "out"
eval_interval, log_interval, eval_iters = 2000, 1, 200
gradient_accumulation_steps = 5 * 8
batch_size, block_size = 12, 1024
learning_rate, max_iters, grad_clip = 6e-4, 600000, 1.0
backend = "nccl"
device = "cuda"
dtype = "bfloat16"
init_from = "scratch"

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1

if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype)


def get_batch(split):
    data = np.memmap(os.path.join("data", f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


iter_num, best_val_loss = 0, 1e9
if init_from == "scratch":
    model = GPT(GPTConfig())
elif init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device)
    model = GPT(GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
model.to(device)
scaler = torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), "cuda")
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    return learning_rate * min(1.0, (it + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * it / max_iters))


X, Y = get_batch("train")
t0 = time.time()
raw_model = model.module if ddp else model
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                          "iter_num": iter_num, "best_val_loss": best_val_loss}
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
