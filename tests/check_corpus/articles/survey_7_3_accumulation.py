# The survey article, section 7.3 "使用梯度累积", as published, below the imports of the article's
# DDP program (section 3.4), whose model it accumulates over.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

accumulation_steps = 4

optimizer.zero_grad(set_to_none=True)

for step, (images, labels) in enumerate(dataloader):
    images = images.cuda()
    labels = labels.cuda()

    with torch.autocast(
        device_type="cuda",
        dtype=torch.float16
    ):
        outputs = model(images)
        loss = criterion(outputs, labels)
        loss = loss / accumulation_steps

    scaler.scale(loss).backward()

    if (step + 1) % accumulation_steps == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
