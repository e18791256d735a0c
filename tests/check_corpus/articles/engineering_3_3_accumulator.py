# The engineering article, section 3.3 "梯度累积与有效 Batch Size", as published: only the `=`,
# quotes and `+` its scraped text lost are restored.
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

    def step(self, loss):
        # 为什么需要梯度累积？单卡 Batch Size 受显存限制
        # 累积 4 步等效于 Batch Size × 4
        # 但显存占用不变
        scaled_loss = self.scaler.scale(
            loss / self.accumulation_steps)
        scaled_loss.backward()

        self._step_count += 1
        if self._step_count % self.accumulation_steps == 0:
            # 累积完成后执行一次参数更新
            # 梯度已在 DDP 中自动同步并平均
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
