"""Sharded checkpoints with torch.distributed.checkpoint, and per-rank statistics gathered as
objects: every rank takes part in both; rank 0 alone prints."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import distributed as comm
from torch.nn.parallel import DistributedDataParallel as DDP


def save(model, opt, step, is_main):
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
    dcp.save(state, checkpoint_id=f"ckpt/step{step}")   # every rank writes its shard


def report(seen, is_main):
    counts = [None] * dist.get_world_size()
    comm.all_gather_object(counts, seen)
    if is_main:
        print(f"samples per rank: {counts}")


def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    is_main = dist.get_rank() == 0
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = 0
    for step in range(10):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(x)
    save(model, opt, 10, is_main)
    report(seen, is_main)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
