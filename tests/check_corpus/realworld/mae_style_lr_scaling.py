"""MAE's main_pretrain.py shape: the batch per GPU is fixed, the effective batch grows with the
world size and the accumulation, and the lr follows it (`blr * eff_batch_size / 256`).

    torchrun --nproc_per_node=8 mae_style_lr_scaling.py --batch_size 64 --accum_iter 4
"""
import argparse
import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def get_args_parser():
    parser = argparse.ArgumentParser("MAE pre-training", add_help=False)
    parser.add_argument("--batch_size", default=64, type=int, help="batch size per GPU")
    parser.add_argument("--accum_iter", default=1, type=int)
    parser.add_argument("--blr", type=float, default=1.5e-4, help="base lr: absolute_lr = base_lr * total_batch / 256")
    parser.add_argument("--lr", type=float, default=None)
    return parser


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    num_tasks = dist.get_world_size()
    data = TensorDataset(torch.randn(2048, 16))
    sampler = DistributedSampler(data, num_replicas=num_tasks, rank=dist.get_rank(), shuffle=True)
    loader = DataLoader(data, sampler=sampler, batch_size=args.batch_size, drop_last=True)
    eff_batch_size = args.batch_size * args.accum_iter * dist.get_world_size()
    if args.lr is None:
        args.lr = args.blr * eff_batch_size / 256
    model = DDP(torch.nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (x,) in enumerate(loader):
            ctx = model.no_sync() if (step + 1) % args.accum_iter else torch.enable_grad()
            with ctx:
                (model(x) - x).pow(2).mean().div(args.accum_iter).backward()
            if (step + 1) % args.accum_iter == 0:
                optimizer.step()
                optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
