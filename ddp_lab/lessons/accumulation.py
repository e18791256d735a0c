"""Gradient accumulation under DDP (notebook 05).

    acc = GradientAccumulator(model, optimizer, scaler, accumulation_steps=4)
    for x, y in loader:
        with acc.sync_context():             # no_sync() on all but the last micro-step
            loss = criterion(model(x), y)    # forward AND backward inside the context
            acc.step(loss)                   # scale(loss / K).backward(); update at the boundary

- ArticleGradientAccumulator: the engineering article's class (its section 3.3),
  as written. Correct arithmetic, but DDP all-reduces after *every* backward, so
  K-1 of every K all-reduces are wasted work.
- survey_article_loop: the survey article's accumulation loop (its section 7.3),
  as written: the same arithmetic and the same missing no_sync.
- GradientAccumulator: the engineering article's class plus no_sync.
- AllReduceCounter: a DDP communication hook that counts the all-reduces
  (and bytes) DDP launches, then performs the usual averaging all-reduce.
- Learning rate: scaling rules (none, square root, linear), the survey article's
  adjust_learning_rate, and a per-step warmup.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist


def effective_batch(per_rank_batch: int, world_size: int, accumulation_steps: int = 1) -> int:
    """Samples behind one optimizer step (the survey article's formula): batch x ranks x micro-steps."""
    return per_rank_batch * world_size * accumulation_steps


def accumulated_grads(model, x, y, accumulation_steps: int, divide: bool = True) -> list:
    """Gradients after K micro-batches (x split into K equal parts), loss divided by K or not."""
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(accumulation_steps), y.chunk(accumulation_steps)):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        (loss / accumulation_steps if divide else loss).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


class ArticleGradientAccumulator:
    """The engineering article's GradientAccumulator (its section 3.3), unchanged except
    the `=` signs its scraped text lost.

    Its comment says the gradients "are already synchronised and averaged by
    DDP", which is true, and is the problem: they were synchronised on every
    micro-step, not once per update.
    """

    def __init__(self, model, optimizer, scaler, accumulation_steps=4):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.accumulation_steps = accumulation_steps
        self._step_count = 0

    def step(self, loss):
        scaled_loss = self.scaler.scale(loss / self.accumulation_steps)
        scaled_loss.backward()
        self._step_count += 1
        if self._step_count % self.accumulation_steps == 0:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()


class GradientAccumulator(ArticleGradientAccumulator):
    """The engineering article's accumulator, fixed: all-reduce once per optimizer step.

    DDP decides at *forward* time whether the coming backward will all-reduce
    (forward under no_sync() tells the reducer not to), so forward and backward
    must both run inside sync_context(). Keep the number of micro-steps per
    epoch a multiple of K (drop_last): a half-finished window has gradients
    that were never synchronised.
    """

    def is_boundary(self) -> bool:
        """True when the next step() will update the parameters."""
        return (self._step_count + 1) % self.accumulation_steps == 0

    def sync_context(self):
        # NEW: skip the all-reduce on every micro-step except the last of each window
        if self.is_boundary() or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def step(self, loss) -> bool:
        boundary = self.is_boundary()
        super().step(loss)
        return boundary


def survey_article_loop(model, optimizer, scaler, dataloader, accumulation_steps=4,
                        criterion=torch.nn.functional.cross_entropy, device_type="cpu", dtype=None):
    """The survey article's accumulation loop (its section 7.3), as written but for the
    device: `.cuda()` becomes `.to(device)`, and its fp16 autocast is `dtype` (None: fp32,
    because fp16 on a CPU is slow and changes nothing about synchronisation).

    Like the engineering article's class it divides the loss by K and steps every K
    batches, and like it, it never uses no_sync: DDP all-reduces after every backward.
    """
    device = next(model.parameters()).device
    autocast = (lambda: torch.autocast(device_type=device_type, dtype=dtype)) if dtype \
        else contextlib.nullcontext
    optimizer.zero_grad(set_to_none=True)

    for step, (images, labels) in enumerate(dataloader):
        images = images.to(device)
        labels = labels.to(device)

        with autocast():
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss = loss / accumulation_steps

        scaler.scale(loss).backward()

        if (step + 1) % accumulation_steps == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


class AllReduceCounter:
    """Count DDP's all-reduces: `counter = AllReduceCounter(ddp_model)`, then read .calls.

    DDP hands each gradient bucket to the hook when the bucket is ready; the hook
    returns a future with the averaged bucket (what DDP does by default).
    A comm hook must be registered before the first backward.
    """

    def __init__(self, ddp_model, process_group=None):
        self.group = process_group
        self.calls = 0
        self.bytes = 0
        ddp_model.register_comm_hook(self, AllReduceCounter._hook)

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0

    @staticmethod
    def _hook(state: "AllReduceCounter", bucket):
        state.calls += 1
        buffer = bucket.buffer()
        state.bytes += buffer.numel() * buffer.element_size()
        buffer.div_(dist.get_world_size(state.group))
        work = dist.all_reduce(buffer, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


# ---------------------------------------------------------------- learning-rate scaling
RULES = {"none": lambda growth: 1.0, "sqrt": math.sqrt, "linear": lambda growth: growth}


def scaled_lr(base_lr: float, base_batch: int, per_rank_batch: int, world_size: int,
              accumulation_steps: int = 1, rule: str = "linear") -> float:
    """The learning rate for the *effective* batch (not world size alone), by a scaling rule.

    linear (Goyal et al. 2017, derived for SGD): lr x growth of the batch;
    sqrt (Malladi et al. 2022, for Adam-family optimizers): lr x sqrt(growth); none: lr.
    """
    growth = effective_batch(per_rank_batch, world_size, accumulation_steps) / base_batch
    return base_lr * RULES[rule](growth)


def lr_at(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Per-step linear warmup to peak_lr, then constant (what the survey article's per-epoch
    stairs approximate)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return peak_lr
    return peak_lr * (step + 1) / warmup_steps


def survey_adjust_learning_rate(optimizer, base_lr, epoch, warmup_epochs, world_size):
    """The survey article's adjust_learning_rate (its section 7.1), as written: linear scaling
    by world size, warmup per epoch."""
    if epoch < warmup_epochs:
        lr = base_lr * world_size * (epoch + 1) / warmup_epochs
    else:
        lr = base_lr * world_size
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr


def survey_schedule(base_lr, world_size, warmup_epochs, epochs, steps_per_epoch) -> list[float]:
    """The learning rate the survey article's function sets at every step (it is called once
    per epoch)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    out = []
    for epoch in range(epochs):
        survey_adjust_learning_rate(optimizer, base_lr, epoch, warmup_epochs, world_size)
        out += [optimizer.param_groups[0]["lr"]] * steps_per_epoch
    return out


# ---------------------------------------------------------------- AMP with accumulation
def amp_accumulation_trace(accumulation_steps: int = 4, windows: int = 4, inf_at=(2, 1),
                           micro_batch: int = 16, init_scale: float = 2.0 ** 16, seed: int = 0):
    """fp16 + GradScaler + accumulation, one record per micro-step.

    The recipe: scaler.scale(loss / K).backward() on every micro-step (all K
    gradients carry the same scale, so they add up correctly); scaler.step()
    and scaler.update() only at the boundary. `inf_at=(window, micro_step)`
    poisons one micro-step's gradient: the whole window is skipped, once.
    Also returns the first window's unscaled gradients for comparison with
    one fp32 batch of K x micro_batch samples.
    """
    from ddp_lab.lessons import amp, data, models

    X, Y = data.digits_tensors("train")
    torch.manual_seed(seed)
    model = models.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2000)
    K, b = accumulation_steps, micro_batch
    trace, first_grads = [], None
    for w in range(windows):
        before = [p.detach().clone() for p in model.parameters()]
        for m in range(K):
            i = (w * K + m) * b
            with amp.autocast("fp16"):
                loss = torch.nn.functional.cross_entropy(model(X[i:i + b]), Y[i:i + b])
            scaler.scale(loss / K).backward()           # every micro-step, same scale
            if (w, m) == tuple(inf_at):
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            boundary = m == K - 1
            scale_now = scaler.get_scale()
            if boundary:
                if w == 0:
                    scaler.unscale_(optimizer)          # to inspect the true accumulated gradient
                    first_grads = [p.grad.detach().clone() for p in model.parameters()]
                scaler.step(optimizer)                  # once per window
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            trace.append({"window": w, "micro_step": m, "boundary": boundary, "scale": scale_now,
                          "scale_after": scaler.get_scale()})
        trace[-1]["updated"] = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    torch.manual_seed(seed)
    reference = accumulated_grads(models.mlp(), X[:K * b], Y[:K * b], 1)  # one fp32 batch of K*b
    return trace, first_grads, reference
