"""detectron2's shape: IMS_PER_BATCH is the global batch, split among the workers, and BASE_LR is
tuned for it; auto_scale_workers() rescales both together when the number of workers changes.

    torchrun --nproc_per_node=8 detectron2_style_batch_split.py
"""
import datetime
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def default_cfg():
    solver = SimpleNamespace(IMS_PER_BATCH=16, BASE_LR=0.02, REFERENCE_WORLD_SIZE=8, MAX_ITER=100)
    return SimpleNamespace(SOLVER=solver)


def auto_scale_workers(cfg, num_workers):
    old_world_size = cfg.SOLVER.REFERENCE_WORLD_SIZE
    if old_world_size == 0 or old_world_size == num_workers:
        return cfg
    scale = num_workers / old_world_size
    cfg.SOLVER.IMS_PER_BATCH = int(round(cfg.SOLVER.IMS_PER_BATCH * scale))
    cfg.SOLVER.BASE_LR = cfg.SOLVER.BASE_LR * scale
    cfg.SOLVER.MAX_ITER = int(round(cfg.SOLVER.MAX_ITER / scale))
    cfg.SOLVER.REFERENCE_WORLD_SIZE = num_workers
    return cfg


def build_train_loader(cfg, data):
    world_size = dist.get_world_size()
    images_per_worker = cfg.SOLVER.IMS_PER_BATCH // world_size
    return DataLoader(data, batch_size=images_per_worker, sampler=DistributedSampler(data), drop_last=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    cfg = auto_scale_workers(default_cfg(), dist.get_world_size())
    loader = build_train_loader(cfg, TensorDataset(torch.randn(512, 8), torch.randn(512, 1)))
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.SOLVER.BASE_LR, momentum=0.9)
    it = 0
    while it < cfg.SOLVER.MAX_ITER:
        loader.sampler.set_epoch(it)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            it += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
