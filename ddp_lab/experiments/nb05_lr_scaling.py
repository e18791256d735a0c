"""Scaling the learning rate with the batch: SGD follows the linear rule, AdamW does not (notebook 05).

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.experiments.nb05_lr_scaling

Every run trains ddp_lab.lessons.models.mlp on the digits for the same number of epochs (the
same samples), under DDP, from the same initial weights, with a cosine schedule:
  base    64 per rank x 2 ranks x K=1 = 128 samples per step, at the base learning rate
  none    128 per rank x 2 ranks x K=2 = 512 per step (4x the batch), base rate, warmup
  sqrt    512 per step, base rate x sqrt(4) = x2, warmup
  linear  512 per step, base rate x 4, warmup
and `linear` again without warmup. One launch runs them all, for SGD (momentum 0.9) and
for AdamW. Rank 0 records, per run, the learning rate the optimizer held at every step
(read from its param_groups just before the step), how far the first step moved the
weights, the global mean training loss of every step, and the validation loss and
accuracy after every epoch.
"""
import argparse
import math

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddp_lab.lessons import data, models
from ddp_lab.engine import runtime
from ddp_lab.lessons.accumulation import RULES, GradientAccumulator

BASE = (64, 1)   # per-rank batch, micro-steps: 128 samples per step on 2 ranks
BIG = (128, 2)   # 512 samples per step on 2 ranks: 4x the base batch


def runs(warmup_epochs: int) -> list:
    """(rule, warmup epochs) of every run, in order."""
    return [("base", 0), ("none", warmup_epochs), ("sqrt", warmup_epochs),
            ("linear", warmup_epochs), ("linear", 0)]


def train_one(ctx, args, X, Y, Xv, Yv, optimizer_name, rule, warmup_epochs):
    b, K = BASE if rule == "base" else BIG
    growth = b * K * ctx.world_size / (BASE[0] * BASE[1] * ctx.world_size)
    base_lr = args.sgd_lr if optimizer_name == "sgd" else args.adamw_lr
    peak = base_lr * (1.0 if rule == "base" else RULES[rule](growth))
    torch.manual_seed(0)  # the same initial weights for every run
    model = DDP(models.mlp().to(ctx.device))
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=peak)
    sampler = DistributedSampler(range(len(Y)), num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=0)
    micro_per_epoch = math.ceil(sampler.num_samples / b)
    assert micro_per_epoch % K == 0, "whole accumulation windows only"
    steps_per_epoch = micro_per_epoch // K
    total, warmup = args.epochs * steps_per_epoch, warmup_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (
        (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))))
    acc = GradientAccumulator(model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                              accumulation_steps=K)
    lr_used, losses, val = [], torch.zeros(total, dtype=torch.float64), []
    step, start = 0, [p.detach().clone() for p in model.parameters()]
    first_move = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order), b):
            idx = order[i:i + b]
            if acc.is_boundary():
                lr_used.append(optimizer.param_groups[0]["lr"])  # what this step will use
            with acc.sync_context():
                loss = F.cross_entropy(model(X[idx]), Y[idx])
                stepped = acc.step(loss)
            losses[step] += loss.item() / K
            if stepped:
                scheduler.step()
                step += 1
                if first_move is None:  # |change| of every weight in the first step
                    first_move = torch.cat([(p.detach() - w).abs().flatten()
                                            for p, w in zip(model.parameters(), start)])
        if ctx.is_main:  # every rank holds the same weights: one evaluation is enough
            with torch.no_grad():
                out = model.module(Xv)
            val.append((F.cross_entropy(out, Yv).item(), (out.argmax(1) == Yv).float().mean().item()))
    dist.all_reduce(losses)  # per-step loss, averaged over the ranks
    losses /= ctx.world_size
    ctx.record(kind="run", optimizer=optimizer_name, rule=rule, warmup_epochs=warmup_epochs,
               batch=b * K * ctx.world_size, per_rank_batch=b, accum_steps=K, base_lr=base_lr,
               steps_per_epoch=steps_per_epoch, lr_used=lr_used, train_loss=losses.tolist(),
               first_move_median=first_move.median().item(), first_move_max=first_move.max().item(),
               init_weight_max=max(w.abs().max().item() for w in start),
               val_loss=[v[0] for v in val], val_acc=[v[1] for v in val])
    ctx.print0(f"{optimizer_name:>5} {rule:>6} warmup {warmup_epochs}: batch {b * K * ctx.world_size:3d}, "
               f"peak lr {max(lr_used):.3g}, final val loss {val[-1][0] if val else float('nan'):.3f}")


def run(ctx, args):
    # Models live in train_one, so they are freed before the process group is destroyed
    X, Y = data.digits_tensors("train")
    Xv, Yv = data.digits_tensors("val")
    X, Y, Xv, Yv = (t.to(ctx.device) for t in (X, Y, Xv, Yv))
    for optimizer_name in ("sgd", "adamw"):
        for rule, warmup in runs(args.warmup_epochs):
            train_one(ctx, args, X, Y, Xv, Yv, optimizer_name, rule, warmup)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--warmup-epochs", type=int, default=3, help="for the run with warmup")
    parser.add_argument("--sgd-lr", type=float, default=0.1, help="base rate for SGD at the base batch")
    parser.add_argument("--adamw-lr", type=float, default=0.05, help="base rate for AdamW at the base batch")
    args = parser.parse_args(argv)
    with runtime.distributed() as ctx:
        run(ctx, args)


if __name__ == "__main__":
    main()
