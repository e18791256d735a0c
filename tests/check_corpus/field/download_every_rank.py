"""MNIST fetched by every rank: torchrun starts N processes, each downloads the same archive into
the same folder, and a rank opens a file another rank is still writing."""
import datetime
import os
import urllib.request

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

VOCAB_URL = "https://example.org/vocab.txt"


def fetch_labels(root):
    path = os.path.join(root, "labels.txt")
    if not os.path.exists(path):
        urllib.request.urlretrieve(VOCAB_URL, path)
    return open(path).read().split()


def main(root="data", epochs=2):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    train_set = datasets.MNIST(root, train=True, download=True, transform=transforms.ToTensor())
    labels = fetch_labels(root)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=64, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, len(labels))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), "mnist.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
