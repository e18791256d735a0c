"""A torchelastic entry point under @record: errors reach torchrun's summary; the backend is fixed."""
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    dist.init_process_group(backend="nccl")
    rank = int(os.environ["SLURM_PROCID"])
    torch.cuda.set_device(rank)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
