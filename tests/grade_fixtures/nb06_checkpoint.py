"""06.4: a right save/resume pair and the wrong ones, each with the hint it must get."""
import torch


def save(path, model, optimizer, step):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(), "step": step}, path)


def load(path, model, optimizer):
    ckpt = torch.load(path, weights_only=False)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    return ckpt["step"]


def save_without_optimizer(path, model, optimizer, step):
    torch.save({"model": model.module.state_dict(), "rng": torch.get_rng_state(), "step": step}, path)


def load_without_optimizer(path, model, optimizer):
    ckpt = torch.load(path, weights_only=False)
    model.module.load_state_dict(ckpt["model"])
    torch.set_rng_state(ckpt["rng"])
    return ckpt["step"]


def save_without_rng(path, model, optimizer, step):
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)


def load_without_rng(path, model, optimizer):
    ckpt = torch.load(path, weights_only=False)
    model.module.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["step"]


def load_forgets_step(path, model, optimizer):
    load(path, model, optimizer)
    return 0


good = (save, load)
MISTAKES = {
    "no optimizer state": ((save_without_optimizer, load_without_optimizer), "the optimizer restarted empty"),
    "no RNG state": ((save_without_rng, load_without_rng), "the random generator was not restored"),
    "returns step 0": ((save, load_forgets_step), "load_checkpoint returned 0"),
}
