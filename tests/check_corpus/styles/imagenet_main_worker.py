"""The ImageNet example's main_worker: one process per GPU started by mp.spawn, ranks computed by hand."""
import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    args.rank = args.rank * ngpus_per_node + gpu
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank,
                            timeout=datetime.timedelta(minutes=5))
    torch.cuda.set_device(args.rank)
    model = torch.nn.Linear(512, 1000).cuda(args.gpu)
    model = DDP(model, device_ids=[args.gpu])
    return model


def main(args):
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.world_size
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
