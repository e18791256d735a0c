"""MNIST with DDP, the plain-loop way a blog post or a first port of a single-GPU script writes it.

    torchrun --nproc_per_node=4 plain_loop.py --epochs 10
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout(torch.flatten(x, 1))
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)  # [correct, seen] on this rank
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            pred = model(x).argmax(dim=1)
            counts += torch.tensor([(pred == y).sum().item(), len(y)], device=device)
    dist.all_reduce(counts)
    accuracy = (counts[0] / counts[1]).item()
    if dist.get_rank() == 0:
        print(f"test accuracy {accuracy:.4f}")
    model.train()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-interval", type=int, default=50)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=timedelta(minutes=30))
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)
    model = Net().to(device)
    model = DDP(model, device_ids=[local_rank])

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST("data", train=True, download=False, transform=tf)
    test_set = datasets.MNIST("data", train=False, transform=tf)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=1000,
                             sampler=DistributedSampler(test_set, shuffle=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.nll_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.log_interval == 0 and dist.get_rank() == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
        evaluate(model, test_loader, device)
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), f"mnist_epoch{epoch}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
