# The survey article, section 7.2 "使用混合精度", as published.
scaler = torch.cuda.amp.GradScaler()

for images, labels in dataloader:
    optimizer.zero_grad(set_to_none=True)

    with torch.cuda.amp.autocast():
        outputs = model(images)
        loss = criterion(outputs, labels)

    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
