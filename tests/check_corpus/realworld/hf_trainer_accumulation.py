"""A Trainer in the shape of Hugging Face's: training_step() runs backward, train() decides every
k micro-steps to call optimizer_step(), and optimizer_step() steps. No no_sync anywhere.

    torchrun --nproc_per_node=4 hf_trainer_accumulation.py
"""
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@dataclass
class TrainingArguments:
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 4
    learning_rate: float = 5e-5
    max_grad_norm: float = 1.0
    num_train_epochs: int = 3


class Trainer:
    def __init__(self, model, args, train_dataset):
        self.args = args
        self.model = DDP(model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate)
        self.lr_scheduler = torch.optim.lr_scheduler.LinearLR(self.optimizer)
        self.sampler = DistributedSampler(train_dataset)
        self.loader = DataLoader(train_dataset, batch_size=args.per_device_train_batch_size, sampler=self.sampler)

    def compute_loss(self, model, inputs):
        x, y = inputs
        return torch.nn.functional.cross_entropy(model(x), y)

    def training_step(self, model, inputs):
        model.train()
        loss = self.compute_loss(model, inputs) / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()

    def optimizer_step(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()

    def train(self):
        tr_loss = torch.zeros(())
        for epoch in range(self.args.num_train_epochs):
            self.sampler.set_epoch(epoch)
            for step, inputs in enumerate(self.loader):
                tr_loss += self.training_step(self.model, inputs)
                if (step + 1) % self.args.gradient_accumulation_steps == 0:
                    self.optimizer_step()
        return tr_loss


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    Trainer(torch.nn.Linear(16, 4), TrainingArguments(), data).train()
    dist.destroy_process_group()
