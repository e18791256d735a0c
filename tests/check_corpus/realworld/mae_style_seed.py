"""MAE-style main(): a seeding helper named by the project, called with seed + rank before the
model is built, so every rank starts from different weights (DDP repairs the wrapped model only).

    torchrun --nproc_per_node=8 mae_style_seed.py --seed 0
"""
import argparse
import datetime
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MaskedAutoencoder(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.encoder = torch.nn.Linear(dim, dim // 2)
        self.decoder = torch.nn.Linear(dim // 2, dim)

    def forward(self, x):
        return self.decoder(self.encoder(x))


def main(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    seed = args.seed + dist.get_rank()
    seed_all(seed)
    model = MaskedAutoencoder(64)
    ema = MaskedAutoencoder(64)
    ema.load_state_dict(model.state_dict())
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.5e-4)
    for step in range(args.steps):
        x = torch.randn(8, 64)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    main(parser.parse_args())
