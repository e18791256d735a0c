# The survey article, section 7.2, fixed: the device-neutral torch.amp API.
scaler = torch.amp.GradScaler("cuda")

for images, labels in dataloader:
    optimizer.zero_grad(set_to_none=True)

    with torch.amp.autocast("cuda"):
        outputs = model(images)
        loss = criterion(outputs, labels)

    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
