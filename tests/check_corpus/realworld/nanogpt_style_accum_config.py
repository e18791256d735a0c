"""nanoGPT-style configuration printed by the master process: grad_accum_steps is a setting, not a
metric. The loss it logs is averaged over ranks first.

    torchrun --standalone --nproc_per_node=8 nanogpt_style_accum_config.py
"""
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

batch_size, block_size = 12, 64
grad_accum_steps = 40
max_iters = 20

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    assert grad_accum_steps % ddp_world_size == 0
    grad_accum_steps //= ddp_world_size
else:
    master_process = True
    ddp_world_size = 1
tokens_per_iter = grad_accum_steps * ddp_world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    print(f"grad_accum_steps: {grad_accum_steps}")

torch.manual_seed(1337)
model = torch.nn.Linear(block_size, block_size)
if ddp:
    model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
for iter_num in range(max_iters):
    for micro_step in range(grad_accum_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        loss = model(torch.randn(batch_size, block_size)).pow(2).mean() / grad_accum_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if ddp:
    dist.destroy_process_group()
