"""Records what the launcher set up for each rank."""
import os

import torch

from ddp_lab.engine import runtime

with runtime.distributed() as ctx:
    ctx.record(kind="env", omp=os.environ.get("OMP_NUM_THREADS"), threads=torch.get_num_threads(),
               world_size=ctx.world_size, backend=ctx.backend, launched=ctx.launched,
               master_port=os.environ.get("MASTER_PORT"))
