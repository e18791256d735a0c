"""A Lightning callback in the shape of ModelCheckpoint: the global-zero process writes the summary
and the file, and every rank meets at the strategy's barrier in `_sync()`, called outside the
rank check, so that no rank reads the file before it exists.

    python train.py --trainer.devices 8 --trainer.strategy ddp
"""
import json

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only


class SaveBest(Callback):
    def __init__(self, path):
        self.path, self.best = path, float("inf")

    @rank_zero_only
    def _log(self, text):
        print(text)

    def _write(self, trainer, pl_module, loss):
        torch.save(pl_module.state_dict(), self.path)
        with open(self.path + ".json", "w") as f:
            json.dump({"epoch": trainer.current_epoch, "val_loss": loss}, f)

    def _sync(self, trainer):
        trainer.strategy.barrier("save_best")

    def on_validation_epoch_end(self, trainer, pl_module):
        loss = trainer.callback_metrics["val_loss"].item()
        improved = loss < self.best
        self.best = min(self.best, loss)
        if trainer.is_global_zero and improved:
            self._write(trainer, pl_module, loss)
            self._log(f"new best {loss:.4f} at epoch {trainer.current_epoch}")
        self._sync(trainer)
