"""A LightningModule-shaped model whose epoch-end hook reaches for raw torch.distributed."""
import torch
import torch.distributed as dist
from torch import nn


class LitClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.correct = torch.zeros(1)
        self.total = torch.zeros(1)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.correct += (self(x).argmax(1) == y).sum()
        self.total += y.numel()

    def on_validation_epoch_end(self):
        if self.global_rank == 0:
            dist.all_reduce(self.correct)
            dist.all_reduce(self.total)
            print(f"val accuracy {(self.correct / self.total).item():.3f}")
        self.correct.zero_()
        self.total.zero_()
