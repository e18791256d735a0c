"""Notebook 10, section 2: an elastic training job that survives losing a node and grows back.

    torchrun --nnodes 1:2 --nproc_per_node 1 --max_restarts 3 --rdzv_backend c10d \
        --rdzv_endpoint HEAD:29400 --rdzv_id demo \
        -m ddp_lab.experiments.nb10_elastic --ckpt /shared/elastic.pt --steps 120

Run the same command on every machine (here: twice on one machine, as two agents). Each
agent joins the rendezvous; the job starts with as many nodes as have come (1 to 2). When
a node is lost, or a new one arrives, torchrun stops every worker and starts them again in
a new, larger or smaller world. So a worker's life is short and may end at any step; what
makes that safe is the checkpoint:

- NEW: every start loads the last checkpoint (model, optimizer, step) if there is one;
- NEW: rank 0 saves one every --save-every steps, atomically (write, then rename);
- the global batch is the same whatever the world size: each rank takes its share of it, so
  the trajectory does not depend on how many nodes happened to be present (and a step takes
  longer on fewer ranks: --sample-ms of stand-in compute per sample of a rank's share).

Each step is recorded (kind="step": step, world_size, loss, restart count, time);
each start is recorded (kind="start": resumed_from).
"""
import argparse
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime

GLOBAL_BATCH, FEATURES = 48, 16


def global_batch(step: int):
    """The step's whole batch, the same on every rank and at every world size."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    w = torch.linspace(-1, 1, FEATURES)                       # the target the model must learn
    return x, x @ w + 0.01 * torch.randn(GLOBAL_BATCH, generator=g)


def my_share(step: int, rank: int, world_size: int):
    x, y = global_batch(step)
    return x[rank::world_size], y[rank::world_size]


def new_model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference(steps: int) -> nn.Module:
    """The same training in one process without interruptions: what the elastic job should end near."""
    model, optimizer = new_model_and_optimizer()
    for step in range(steps):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def save(model, optimizer, step: int, world_size: int, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "world_size": world_size}, tmp)
    os.replace(tmp, path)                                    # readers see the old or the new file


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint path, shared by every node")
    p.add_argument("--steps", type=int, default=120, help="train until this global step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--sample-ms", type=float, default=6.0,
                   help="stand-in compute per sample: a rank with a bigger share of the batch takes longer")
    p.add_argument("--timeout", type=float, default=runtime.timeout_s(),
                   help="seconds a collective waits for a silent peer before it fails")
    args = p.parse_args()

    # Plain env:// init: torchrun gives every new world a fresh MASTER_PORT when the agents
    # do not share their rendezvous store with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    set_timeout = runtime._timeout_setter()   # dist.set_timeout, public since torch 2.14; older: its private name
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(args.timeout, 60) if set_timeout else args.timeout))
    if set_timeout:
        set_timeout(datetime.timedelta(seconds=args.timeout))  # NEW: a lost peer fails us after this
    rank, world_size = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    ctx = runtime.Context(rank, world_size, 0, 1, torch.device("cpu"), "gloo", True)
    step = 0
    try:
        model, optimizer = new_model_and_optimizer()
        if os.path.exists(args.ckpt):                        # NEW: every start resumes
            state = torch.load(args.ckpt, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
        ctx.record(kind="start", resumed_from=step, world_size=world_size, restart=restart,
                   agent=os.environ.get("DDP_LAB_AGENT", "?"), pid=os.getpid())
        ctx.print0(f"world_size={world_size} restart={restart}: resuming at step {step}")
        ddp = DDP(model)
        while step < args.steps:
            t0 = time.time()
            x, y = my_share(step, rank, world_size)
            # Mean over the GLOBAL batch: DDP averages over ranks, so scale by the share's size.
            loss = nn.functional.mse_loss(ddp(x).squeeze(1), y, reduction="sum") * world_size / GLOBAL_BATCH
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            total = loss.detach().clone() / world_size
            dist.all_reduce(total)                           # the global batch's loss
            ctx.record(kind="step", step=step, world_size=world_size, loss=total.item(), restart=restart,
                       agent=os.environ.get("DDP_LAB_AGENT", "?"))
            if rank == 0 and (step % args.save_every == 0 or step == args.steps):
                save(model, optimizer, step, world_size, args.ckpt)
            time.sleep(max(0.0, args.sample_ms / 1e3 * len(y) - (time.time() - t0)))
        dist.barrier()                                       # the final checkpoint exists for all
        ctx.print0(f"done: step {step}")
        del ddp, model, optimizer
    except Exception as e:                                   # NEW: say how this worker ended
        ctx.record(kind="failed", step=step, world_size=world_size, error=str(e).splitlines()[0][:200],
                   agent=os.environ.get("DDP_LAB_AGENT", "?"))
        raise
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
