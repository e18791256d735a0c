"""A torchelastic entry point under @record: the backend follows the device, the node-local id picks the GPU."""
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    local = int(os.environ["SLURM_LOCALID"])
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
