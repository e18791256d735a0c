"""Notebook 02's probe: honest validation, global loss, and per-rank step times.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb02_metrics CHECKPOINT

CHECKPOINT is a state_dict of models.mlp() (the notebook trains and saves one),
so the ranks evaluate exactly the model the notebook evaluates in one process.
Records (run.select(kind=...)):
  eval     accuracy/loss through DistributedSampler (padded) and exactly once
  loss     uneven shards: this rank's mean, the mean of means, all_reduce([sum, count])
  steps    variable-length batches (sampling.sequence_lengths(), sampling.SEQ_BATCH per rank):
           per-step compute and wait seconds per rank, with DistributedSampler and with
           sampling.LengthBalancedSampler
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from ddp_lab.lessons import models, sampling
from ddp_lab.engine import runtime
from ddp_lab.lessons.data import digits_tensors

FEATURES = 16   # per token, for the straggler part


def honest_eval(ctx, model) -> None:
    X, y = digits_tensors("val")                              # 297 samples: odd on purpose
    padded = list(DistributedSampler(range(len(y)), shuffle=False))  # the usual train-style sampler
    sums = sampling.local_sums(model, X, y, padded)
    dist.all_reduce(sums)
    exact = sampling.evaluate_distributed(model, X, y)       # NEW: every sample counted once
    ctx.record(kind="eval", padded_count=int(sums[2]), padded_accuracy=(sums[1] / sums[2]).item(),
               padded_loss=(sums[0] / sums[2]).item(), exact_count=exact["count"],
               exact_accuracy=exact["accuracy"], exact_loss=exact["loss"])


def global_loss(ctx, model) -> None:
    X, y = digits_tensors("val")
    cut = len(y) // 3                                         # uneven shards: 99 and 198 samples
    mine = range(0, cut) if ctx.rank == 0 else range(cut, len(y))
    loss_sum, _, count = sampling.local_sums(model, X, y, mine).tolist()
    my_mean = loss_sum / count
    means = torch.tensor([my_mean], dtype=torch.float64)
    dist.all_reduce(means)
    ctx.record(kind="loss", count=int(count), my_mean=my_mean,
               mean_of_means=means.item() / ctx.world_size,
               sum_over_count=runtime.all_reduce_mean([loss_sum, count]))


def per_token_net() -> nn.Module:
    torch.manual_seed(0)  # cost grows with padded tokens: batch x longest sequence
    return nn.Sequential(nn.Linear(FEATURES, 2048), nn.ReLU(), nn.Linear(2048, FEATURES))


def straggler(ctx) -> None:
    lengths, B = sampling.sequence_lengths(), sampling.SEQ_BATCH
    net = per_token_net()
    naive = DistributedSampler(range(len(lengths)), shuffle=True, seed=0)
    idx = list(naive)
    plans = {"DistributedSampler": [idx[i:i + B] for i in range(0, len(idx), B)],
             "LengthBalancedSampler": list(sampling.LengthBalancedSampler(lengths, B))}
    for name, batches in plans.items():
        dist.barrier()
        for step, batch in enumerate(batches):
            longest = int(lengths[batch].max())
            x = torch.randn(len(batch), longest, FEATURES)       # padded to the longest sequence
            t0 = time.perf_counter()
            net(x).pow(2).mean().backward()                      # this rank's own work
            t1 = time.perf_counter()
            grads = torch.cat([p.grad.flatten() for p in net.parameters()])
            dist.all_reduce(grads)                               # what DDP does: fast ranks wait here
            t2 = time.perf_counter()
            net.zero_grad()
            ctx.record(kind="steps", sampler=name, step=step, tokens=len(batch) * longest,
                       compute_s=t1 - t0, wait_s=t2 - t1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a state_dict of models.mlp(), saved with torch.save")
    args = parser.parse_args(argv)
    with runtime.distributed() as ctx:
        model = models.mlp()
        model.load_state_dict(torch.load(args.checkpoint, map_location="cpu"))
        honest_eval(ctx, model)
        global_loss(ctx, model)
        straggler(ctx)
        ctx.print0("nb02 probes done")


if __name__ == "__main__":
    main()
