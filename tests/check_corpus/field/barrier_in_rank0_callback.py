"""A Lightning-style callback exports the best model on the global-zero process and waits for the
other ranks in the export helper: they never reach that barrier, and the job hangs. The Accelerate
loop does the same with wait_for_everyone() inside a helper called on the main process only."""
import torch
from accelerate import Accelerator
from lightning.pytorch.callbacks import Callback


class ExportBest(Callback):
    def __init__(self, path):
        self.path, self.best = path, float("inf")

    def _export(self, trainer, pl_module):
        torch.save(pl_module.state_dict(), self.path)
        trainer.strategy.barrier()

    def on_validation_epoch_end(self, trainer, pl_module):
        loss = trainer.callback_metrics["val_loss"].item()
        if trainer.is_global_zero and loss < self.best:
            self.best = loss
            self._export(trainer, pl_module)


def publish(accelerator, model, path):
    accelerator.save(accelerator.unwrap_model(model).state_dict(), path)
    accelerator.wait_for_everyone()


def train(model, optimizer, loader, epochs=3):
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
        if accelerator.is_main_process:
            publish(accelerator, model, f"epoch{epoch}.pt")
