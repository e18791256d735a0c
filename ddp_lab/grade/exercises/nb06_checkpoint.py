"""06.4: a save/resume pair that resumes exactly, on 2 real ranks.

Each rank trains a small DDP model with dropout and Adam for 6 steps (the reference, never
interrupted), then again for 3 steps, saves with the answer's save_checkpoint, builds a fresh
model and optimizer from other seeds, loads with load_checkpoint and trains the last 3 steps.
Exact resume means the same weights as the uninterrupted run, bit for bit. Each rank saves to
a file of its own, because each rank's random state is its own.
"""
import os

from ddp_lab.grade.core import Exercise, register

STEPS, SAVE_AT = 6, 3


def _fresh(seed):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    model = DDP(net)  # broadcasts rank 0's weights: every rank starts equal
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model, optimizer, steps):
    import torch
    import torch.nn.functional as F
    for _ in steps:
        x = torch.randn(8, 4)  # data and dropout masks both come from this rank's generator
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _weights(model):
    import torch
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


def on_rank(answer, rank, world):
    import torch
    save_checkpoint, load_checkpoint = answer
    path = os.path.join(os.environ.get("DDP_LAB_GRADE_TMP", "."), f"ckpt_rank{rank}.pt")
    model, optimizer = _fresh(0)
    torch.manual_seed(100 + rank)
    _train(model, optimizer, range(STEPS))
    reference = _weights(model)
    del model, optimizer

    model, optimizer = _fresh(0)
    torch.manual_seed(100 + rank)
    _train(model, optimizer, range(SAVE_AT))
    saved_weights, saved_rng = _weights(model), torch.get_rng_state()
    saved_steps = [float(s["step"]) for s in optimizer.state_dict()["state"].values()]
    save_checkpoint(path, model, optimizer, SAVE_AT)
    del model, optimizer

    model, optimizer = _fresh(7)          # another start, and a generator somewhere else
    torch.manual_seed(999 + rank)
    step = load_checkpoint(path, model, optimizer)
    loaded = {"step": step if isinstance(step, int) else repr(step),
              "weights": bool(torch.equal(_weights(model), saved_weights)),
              "optimizer": [float(s["step"]) for s in optimizer.state_dict()["state"].values()] == saved_steps,
              "rng": bool(torch.equal(torch.get_rng_state(), saved_rng))}
    _train(model, optimizer, range(step if isinstance(step, int) else SAVE_AT, STEPS))
    final = _weights(model)
    return {"loaded": loaded, "exact": bool(torch.equal(final, reference)),
            "max_diff": float((final - reference).abs().max())}


def judge(per_rank):
    problems = []
    for r, o in sorted(per_rank.items()):
        got = o["loaded"]
        if got["step"] != SAVE_AT:
            problems.append(f"rank {r}: load_checkpoint returned {got['step']}, the checkpoint was saved at "
                            f"step {SAVE_AT}: save the step and return it, so training goes on from there")
        if not got["weights"]:
            problems.append(f"rank {r}: after loading, the weights are not the saved ones: save "
                            f"model.module.state_dict() and load it into model.module")
        if not got["optimizer"]:
            problems.append(f"rank {r}: the optimizer restarted empty (Adam's moments and step count are "
                            f"lost): save optimizer.state_dict() and load it with optimizer.load_state_dict()")
        if not got["rng"]:
            problems.append(f"rank {r}: the random generator was not restored, so after resuming this rank "
                            f"draws other batches and dropout masks than the uninterrupted run: save "
                            f"torch.get_rng_state() and restore it with torch.set_rng_state()")
        if not o["exact"] and not problems:
            problems.append(f"rank {r}: the resumed run ends {o['max_diff']:.3g} away from the uninterrupted "
                            f"one (the same operations in the same order give the same bits, so nothing is tolerated): "
                            f"everything that decides the next steps must be in the checkpoint")
    return problems


register(Exercise(
    id="06.4", notebook="06_checkpointing", title="A checkpoint that resumes exactly",
    skills="model.module's state_dict, optimizer state, per-rank RNG state, the step; resumed == "
           "uninterrupted, bit for bit",
    answer="(save_checkpoint(path, model, optimizer, step), load_checkpoint(path, model, optimizer) -> step)",
    nproc=2, on_rank=on_rank, judge=judge))
