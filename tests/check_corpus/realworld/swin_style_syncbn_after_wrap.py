"""An engine class in the style of Swin/timm-era projects: the model lives in self.model, is
wrapped in __init__, and an option converts it to SyncBatchNorm later, in its own method.

    torchrun --nproc_per_node=8 swin_style_syncbn_after_wrap.py --sync-bn
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))


class Engine:
    def __init__(self, model, local_rank):
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.model = DDP(model.to(self.device), device_ids=[local_rank] if torch.cuda.is_available() else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def use_sync_bn(self):
        self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)

    def train_step(self, images, target):
        loss = F.cross_entropy(self.model(images.to(self.device)), target.to(self.device))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def main(args):
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(minutes=5))
    engine = Engine(build_model(), int(os.environ["LOCAL_RANK"]))
    if args.sync_bn:
        engine.use_sync_bn()
    for step in range(args.steps):
        engine.train_step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    main(parser.parse_args())
