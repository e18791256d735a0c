# The engineering article, section 3.3, fixed: DDP all-reduces once per optimizer step.
# Use it as `with acc.sync_context(): acc.step(criterion(model(x), y))`: forward included.
import contextlib


class GradientAccumulator:
    """梯度累积：用小 Batch 多次前向反向，
    等效于大 Batch 的一次更新
    """

    def __init__(self, model, optimizer, scaler,
                 accumulation_steps=4):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.accumulation_steps = accumulation_steps
        self._step_count = 0

    def sync_context(self):
        # DDP decides in forward whether backward all-reduces: skip it on all but the last micro-step
        if (self._step_count + 1) % self.accumulation_steps == 0:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def step(self, loss):
        scaled_loss = self.scaler.scale(
            loss / self.accumulation_steps)
        scaled_loss.backward()

        self._step_count += 1
        if self._step_count % self.accumulation_steps == 0:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
