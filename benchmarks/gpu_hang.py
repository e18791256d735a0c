"""A DDP-style hang on NCCL, for `make gpu-check` on two or more GPUs: rank 0 alone all-reduces the loss
to log it (notebook 07's bug), so it waits in a collective rank 1 never calls. With the Flight Recorder
on (TORCH_FR_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT=1, TORCH_FR_DUMP_TEMP_FILE=DIR/nccl_trace_rank_),
NCCL's watchdog dumps every rank's recent collectives when the timeout fires; `ddp-lab autopsy DIR`
and `torchfrtrace DIR` read them back.

    TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE=$DIR/nccl_trace_rank_ \\
        torchrun --standalone --nproc_per_node=2 benchmarks/gpu_hang.py --timeout 20
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=20, help="seconds before NCCL's watchdog gives up")
    args = p.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1).to(device), device_ids=[local_rank])
    for step in range(3):
        loss = model(torch.randn(32, 64, device=device)).pow(2).mean()
        loss.backward()                           # every rank joins DDP's all-reduce
        if rank == 0:                             # the bug: only rank 0 reduces the loss to log it
            dist.all_reduce(loss.detach())        # ddp-lab: ignore[DDP009] (the bug, on purpose)
        torch.cuda.synchronize()                  # NCCL calls return at launch: wait here, as a log line would
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
