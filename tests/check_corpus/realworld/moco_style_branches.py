"""The ImageNet/MoCo example's main_worker shape: one of three exclusive set-ups (DDP, one GPU,
DataParallel), and a resume that maps the checkpoint to this process's GPU when it has one.

    python moco_style_branches.py --multiprocessing-distributed --world-size 1 --rank 0 data/
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main_worker(gpu, ngpus_per_node, args):
    assert torch.cuda.is_available(), "this example trains on GPUs"
    args.gpu = gpu
    if args.distributed:
        args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(backend="nccl", init_method=args.dist_url, world_size=args.world_size,
                                rank=args.rank, timeout=datetime.timedelta(minutes=10))
    model = torch.nn.Linear(128, 10)
    if args.distributed:
        torch.cuda.set_device(args.gpu)
        model.cuda(args.gpu)
        model = DDP(model, device_ids=[args.gpu])
    elif args.gpu is not None:
        torch.cuda.set_device(args.gpu)
        model = model.cuda(args.gpu)
    else:
        model = torch.nn.DataParallel(model).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    if args.resume:
        if args.gpu is None:
            checkpoint = torch.load(args.resume)
        else:
            loc = "cuda:{}".format(args.gpu)
            checkpoint = torch.load(args.resume, map_location=loc)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    dataset = TensorDataset(torch.randn(512, 128), torch.randint(0, 10, (512,)))
    sampler = DistributedSampler(dataset) if args.distributed else None
    loader = DataLoader(dataset, batch_size=32, shuffle=sampler is None, sampler=sampler)
    for epoch in range(args.epochs):
        if args.distributed:
            sampler.set_epoch(epoch)
        for images, target in loader:
            loss = torch.nn.functional.cross_entropy(model(images.cuda(args.gpu)), target.cuda(args.gpu))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default="")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--dist-url", default="tcp://localhost:10001")
    parser.add_argument("--multiprocessing-distributed", action="store_true")
    args = parser.parse_args()
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus = torch.cuda.device_count()
    args.world_size = ngpus * args.world_size
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
