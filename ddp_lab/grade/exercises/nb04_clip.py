"""04.4: an fp16 step with GradScaler that clips the true gradients; graded in the kernel.

The reference is the lesson's clip_demo "reference" way: the same model, batch and fp16 autocast
with no scaler at all, so clip_grad_norm_ sees the true gradients. A second case starts the scale
at 2^40, so the scaled gradients overflow fp16: a right step is then skipped and the scale halved.
"""
from ddp_lab.grade.core import Exercise, register

MAX_NORM, LR, SCALE, OVERFLOW_SCALE = 0.1, 0.1, 2.0 ** 16, 2.0 ** 40
FP16_RTOL = 0.02  # fp16 rounds to 2**-11 (5e-4) a step; clipping the scaled gradients is 65,536x off


def _step(answer, init_scale):
    import torch
    from ddp_lab.lessons import data, models
    X, Y = data.digits_tensors("train")
    torch.manual_seed(0)
    model = models.mlp()
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=answer is not None)
    if answer is None:  # the reference: no scaler, clip the true gradients
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(X[:64]), Y[:64])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    else:
        answer(model, optimizer, scaler, X[:64], Y[:64], MAX_NORM)
    update = torch.cat([p.detach().flatten() for p in model.parameters()]) - start
    return {"update": update.tolist(), "scale_after": scaler.get_scale() if answer else None}


def on_rank(answer, rank, world):
    return {"normal": _step(answer, SCALE), "overflow": _step(answer, OVERFLOW_SCALE),
            "reference": _step(None, SCALE)}


def judge(per_rank):
    import numpy as np
    o = per_rank[0]
    got, ref = np.array(o["normal"]["update"]), np.array(o["reference"]["update"])
    g, r = np.linalg.norm(got), np.linalg.norm(ref)
    problems = []
    if not np.all(np.isfinite(got)) or not np.allclose(got, ref, rtol=FP16_RTOL, atol=1e-5):
        if not np.all(np.isfinite(got)) or g > 1e3 * r:
            why = ("the step used the scaled gradients: call scaler.step(optimizer), which unscales "
                   "and skips a step whose gradients hold inf/NaN, not optimizer.step()")
        elif abs(g * SCALE / r - 1) < 0.05:
            why = (f"clip_grad_norm_ saw the gradients multiplied by the scale ({SCALE:.0f}): call "
                   f"scaler.unscale_(optimizer) before clipping")
        elif g > 1.5 * r:
            why = (f"the update is larger than a clipped one: clip the unscaled gradients to max_norm "
                   f"({MAX_NORM}) with clip_grad_norm_ before the step")
        else:
            why = "backward on scaler.scale(loss), unscale_, clip, scaler.step, scaler.update: in that order"
        problems.append(f"with scale 2^16 your update has norm {g:.4g}, the fp16 step clipped without a "
                        f"scaler has {r:.4g} (compared within {FP16_RTOL:.0%}, above fp16's rounding): {why}")
    over = o["overflow"]
    if not problems:
        if any(v != 0 for v in over["update"]):
            problems.append("with scale 2^40 the scaled gradients overflow fp16, yet your step changed the "
                            "parameters: call scaler.step(optimizer), which skips a step whose gradients "
                            "hold inf/NaN, instead of optimizer.step()")
        elif over["scale_after"] != OVERFLOW_SCALE / 2:
            problems.append(f"after an overflow the scale should halve to 2^39; it is "
                            f"{over['scale_after']:.4g}: call scaler.update() after every step")
    return problems


register(Exercise(
    id="04.4", notebook="04_mixed_precision", title="Clip under a GradScaler",
    skills="scale the loss, unscale_ before clip_grad_norm_, scaler.step skips overflowed steps, "
           "scaler.update halves the scale",
    answer="amp_step(model, optimizer, scaler, x, y, max_norm): one fp16 training step",
    nproc=0, on_rank=on_rank, judge=judge))
