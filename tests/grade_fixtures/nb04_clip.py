"""04.4: a right fp16 step under a GradScaler and the wrong ones, each with the hint it must get."""
import torch
import torch.nn.functional as F


def _backward(model, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()


def good(model, optimizer, scaler, x, y, max_norm):
    _backward(model, scaler, x, y)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def clip_scaled(model, optimizer, scaler, x, y, max_norm):
    _backward(model, scaler, x, y)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


def no_clip(model, optimizer, scaler, x, y, max_norm):
    _backward(model, scaler, x, y)
    scaler.step(optimizer)
    scaler.update()


def optimizer_step(model, optimizer, scaler, x, y, max_norm):
    _backward(model, scaler, x, y)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def no_update(model, optimizer, scaler, x, y, max_norm):
    _backward(model, scaler, x, y)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)


def in_float64(model, optimizer, scaler, x, y, max_norm):  # the loss in float64 (autocast leaves float64 alone)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    scaler.scale(F.cross_entropy(logits.double(), y)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()


PRECISIONS = {"float32": good, "float64": in_float64}


MISTAKES = {
    "clips the scaled gradients": (clip_scaled, "scaler.unscale_(optimizer) before clipping"),
    "no clipping": (no_clip, "clip the unscaled gradients"),
    "optimizer.step on scaled gradients": (optimizer_step, "call scaler.step(optimizer)"),
    "no scaler.update": (no_update, "call scaler.update() after every step"),
}
