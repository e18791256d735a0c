# The survey article, section 7.3, fixed: forward and backward under no_sync() on every
# micro-step but the last of each window, so DDP all-reduces once per optimizer step.
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

accumulation_steps = 4

optimizer.zero_grad(set_to_none=True)

for step, (images, labels) in enumerate(dataloader):
    images = images.cuda()
    labels = labels.cuda()

    last_micro_step = (step + 1) % accumulation_steps == 0
    with contextlib.nullcontext() if last_micro_step else model.no_sync():
        with torch.autocast(
            device_type="cuda",
            dtype=torch.float16
        ):
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss = loss / accumulation_steps

        scaler.scale(loss).backward()

    if last_micro_step:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
