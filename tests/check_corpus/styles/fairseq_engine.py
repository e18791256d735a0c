"""A fairseq-shaped trainer: train_step gets a list of samples and steps once after all of them."""
import torch
from torch.nn.parallel import DistributedDataParallel


class Trainer:
    def __init__(self, task, model, device):
        self.task = task
        self.model = DistributedDataParallel(model.to(device), device_ids=[device.index])
        self.solver = torch.optim.Adam(self.model.parameters(), lr=5e-4)

    def train_step(self, samples):
        self.model.train()
        logging_outputs = []
        for sample in samples:
            loss, sample_size, log = self.task.train_step(sample, self.model)
            loss.backward()
            logging_outputs.append(log)
        self.solver.step()
        self.solver.zero_grad()
        return logging_outputs
