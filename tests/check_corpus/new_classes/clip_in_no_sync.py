"""Accumulation with no_sync and AMP, the gradient norm clipped on every micro-batch inside the
no_sync block: each rank clips its own partial sum."""
import datetime
import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(net, loader, accum_steps, max_norm=1.0):
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(minutes=10))
    local_rank = int(os.environ["LOCAL_RANK"])
    model = DDP(net.to(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cuda")
    for step, (x, y) in enumerate(loader):
        last = (step + 1) % accum_steps == 0
        if not last:
            with model.no_sync():
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x.to(local_rank), y.to(local_rank)) / accum_steps
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            continue
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x.to(local_rank), y.to(local_rank)) / accum_steps
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
