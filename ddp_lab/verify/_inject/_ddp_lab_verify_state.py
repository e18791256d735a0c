"""The part of `ddp-lab verify`'s observer that fingerprints state kept outside the optimizer
(imported by sitecustomize.py in a rank; see it for the rest). After each of the first STEPS
optimizer steps it hashes, reading only:

- every nn.Module reachable from the script's frames (its functions' variables, its module-level
  names, one level into objects of its own classes, such as a trainer's `self.ema`) other than a
  DistributedDataParallel model and the modules inside it: an EMA copy of the model, a teacher;
  their parameters and buffers;
- tensors in a dict, list or tuple (or a bare tensor) whose name says it is a copy of the weights
  (ema, shadow, average, swa), other than the DDP model's own tensors;
- plain tensor attributes (not parameters, not buffers) named like that, or `running...`, of any
  of these modules, the DDP model's inner modules included.

Records {name: {"class", "hash", "tensors"}} per step, so the ranks can be compared. Around each of
the same steps it also hashes the global generators (torch's, Python's `random`, numpy's), before
the step and after it: a generator that moved between two steps, from the same state on every
rank, drew the same noise in the training loop on every rank.
"""
import re
import sys

STEPS = 4  # the first optimizer steps after which the state is hashed
NAMED = re.compile(r"ema|shadow|averag|swa", re.I)
ATTR = re.compile(r"ema|shadow|averag|swa|running", re.I)
MAX_OBJECTS = 32


def fingerprint(digest, library, ddp_class, ddps=()):
    """{name: {"class", "hash", "tensors"}} of the state the script's frames hold outside the DDP model."""
    import torch
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not name.startswith(tuple(library)):
            frames.append(frame)
        frame = frame.f_back
    found = []  # (name, object), outermost frame first: a module-level name wins
    for frame in reversed(frames):
        for key, value in list(frame.f_locals.items()):
            found.append((key, value))
            if _own_object(value) and not isinstance(value, torch.nn.Module):
                found.extend((f"{key}.{a}", v) for a, v in list(vars(value).items()))
    skip, ddp_inner = set(), []
    for value in (*ddps, *(v for _, v in found if isinstance(v, ddp_class))):
        if id(value) not in skip:
            skip.update(id(m) for m in (value, *value.module.modules()))
            skip.update(id(t) for t in (*value.module.parameters(), *value.module.buffers()))
            ddp_inner.append(value.module)
    out, seen = {}, set()
    for name, value in found:
        if id(value) in seen or id(value) in skip or len(out) >= MAX_OBJECTS:
            continue
        tensors = None
        if isinstance(value, torch.nn.Module):
            tensors = [t for t in (*value.parameters(), *value.buffers(), *_attributes(torch, value))
                       if id(t) not in skip]  # a wrapper around the DDP model: only what is its own
        elif NAMED.search(name.rsplit(".", 1)[-1]):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            tensors = [t for t in items if torch.is_tensor(t) and id(t) not in skip]
        if tensors:
            seen.add(id(value))
            out[name] = {"class": type(value).__name__, "tensors": len(tensors),
                         "hash": _combined(digest, torch, tensors)}
    for inner in ddp_inner:  # running statistics kept as plain attributes of the trained model
        tensors = _attributes(torch, inner)
        if tensors and len(out) < MAX_OBJECTS:
            out[f"model.{type(inner).__name__}"] = {"class": type(inner).__name__, "tensors": len(tensors),
                                                    "hash": _combined(digest, torch, tensors)}
    return out


def _own_object(value) -> bool:
    """An instance of a class the script defines (a trainer): its attributes are looked into."""
    return getattr(type(value), "__module__", None) == "__main__" and hasattr(value, "__dict__") \
        and not isinstance(value, type)


def _attributes(torch, module) -> list:
    """Plain tensor attributes (not registered) named like a running value, of every submodule."""
    return [v for m in module.modules() for k, v in vars(m).items()
            if torch.is_tensor(v) and not k.startswith("_") and ATTR.search(k) and v.numel() > 1]


def _combined(digest, torch, tensors) -> str:
    import hashlib
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(digest(hashlib, torch, t).encode())
    return h.hexdigest()


def generators() -> dict:
    """Hashes of the global generators the training loop may draw from: torch's (and the current CUDA
    device's), Python's `random`, numpy's (where the script imported numpy)."""
    import hashlib
    import random

    import torch

    def h(data):
        return hashlib.blake2b(data, digest_size=8).hexdigest()
    state = torch.random.get_rng_state().numpy().tobytes()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state().numpy().tobytes()
    out = {"torch": h(state), "random": h(repr(random.getstate()).encode())}
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        s = np.random.get_state()
        out["numpy"] = h(s[1].tobytes() + repr(s[2:]).encode())
    return out
