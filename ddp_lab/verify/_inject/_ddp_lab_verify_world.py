"""The part of `ddp-lab verify`'s observer that watches what must not depend on the world size
(imported by sitecustomize.py in a rank; see it for the rest). It wraps, without changing what they
compute:

- LRScheduler.step (and ReduceLROnPlateau's): each call the script makes, not those a scheduler
  makes inside its own constructor or inside another scheduler (SequentialLR), recorded with the
  steps its optimizer had made so far and the learning rates after it;
- torch.distributed.all_reduce, called by the script (not async, SUM, at most MAX_NUMEL elements,
  after a loader pass began): the values before the reduction and the latest loader pass, so a
  count that includes DistributedSampler's padding can be recognised;
- a single-process DataLoader's fetch of the first DRAWS batches of each pass: a hash of torch's
  global generator and of Python's `random` before and after, so random numbers drawn in the data
  path (augmentation) from a generator in the same state on every rank can be recognised;
- the first FORWARDS training forwards of each DDP model: the same hash of torch's global generator
  (and the current CUDA device's) before and after, so dropout masks drawn from a generator in the
  same state on every rank can be recognised.
"""
import functools
import itertools

MAX_REDUCES = 200  # small all-reduces recorded per rank
MAX_NUMEL = 16
DRAWS = 2  # batches per pass whose loading is watched for random numbers
FORWARDS = 2  # training forwards of each DDP model watched for random numbers (dropout)


def patch(obs, safe, user_line):
    import torch
    import torch.distributed as dist
    from torch.optim import lr_scheduler
    from torch.optim.optimizer import register_optimizer_step_post_hook

    # Each optimizer carries its step count, each scheduler its number: not in dicts keyed by id(),
    # which a script that makes a new optimizer and scheduler per run (and frees the old) reuses
    numbers, depth = itertools.count(), [0]

    def count(opt, args, kwargs):
        opt._ddp_lab_steps = getattr(opt, "_ddp_lab_steps", 0) + 1
    register_optimizer_step_post_hook(count)

    def record(scheduler):
        opt = getattr(scheduler, "optimizer", None)
        if not hasattr(scheduler, "_ddp_lab_number"):
            scheduler._ddp_lab_number = next(numbers)
        obs.write({"kind": "sched", "sched": scheduler._ddp_lab_number, "type": type(scheduler).__name__,
                   "opt_steps": getattr(opt, "_ddp_lab_steps", 0), "step": obs.steps,
                   "lr": [g.get("lr") if isinstance(g.get("lr"), (int, float)) else None
                          for g in getattr(opt, "param_groups", [])], "at": user_line()})

    def wrap(cls, name):
        fn = cls.__dict__[name]

        @functools.wraps(fn)
        def wrapper(self, *a, **k):
            outer = depth[0] == 0
            depth[0] += 1
            try:
                out = fn(self, *a, **k)
            finally:
                depth[0] -= 1
            if outer and name == "step":
                safe(record, self)
            return out
        setattr(cls, name, wrapper)

    for cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
        for name in ("__init__", "step"):
            if name in cls.__dict__:
                wrap(cls, name)

    import hashlib
    import random
    import torch.utils.data.dataloader as dl

    def generators():
        return (hashlib.blake2b(torch.random.get_rng_state().numpy().tobytes(), digest_size=8).hexdigest(),
                hashlib.blake2b(repr(random.getstate()).encode(), digest_size=8).hexdigest())

    def note_draw(it, before, batch):
        after = generators()
        number, passes = it._ddp_lab_pass
        obs.write({"kind": "draw", "loader": number, "pass": passes, "batch": batch, "step": obs.steps,
                   "torch": [before[0], after[0]], "random": [before[1], after[1]], "at": user_line()})

    fetch = dl._SingleProcessDataLoaderIter._next_data

    @functools.wraps(fetch)
    def _next_data(self):
        batch = self._num_yielded
        if batch >= DRAWS or not hasattr(self, "_ddp_lab_pass"):
            return fetch(self)
        before = []
        safe(lambda: before.extend(generators()))
        data = fetch(self)
        if before:
            safe(note_draw, self, before, batch)
        return data
    dl._SingleProcessDataLoaderIter._next_data = _next_data

    from torch.nn.parallel import DistributedDataParallel as DDP

    def forward_state():
        state = torch.random.get_rng_state().numpy().tobytes()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state += torch.cuda.get_rng_state().numpy().tobytes()
        return hashlib.blake2b(state, digest_size=8).hexdigest()

    def before_forward(module, inputs):
        if isinstance(module, DDP) and module.training and torch.is_grad_enabled():
            if module.__dict__.get("_ddp_lab_forwards", 0) < FORWARDS:
                module.__dict__["_ddp_lab_rng"] = forward_state()

    def after_forward(module, inputs, output):
        before = module.__dict__.pop("_ddp_lab_rng", None) if isinstance(module, DDP) else None
        if before is None:
            return
        n = module.__dict__.get("_ddp_lab_forwards", 0)
        module.__dict__["_ddp_lab_forwards"] = n + 1
        number = next((i for i, m in enumerate(obs.ddp) if m is module), 0)  # the observer found it first
        obs.write({"kind": "forward", "ddp": number, "forward": n,
                   "step": obs.steps, "torch": [before, forward_state()], "at": user_line()})

    hooks = torch.nn.modules.module
    hooks.register_module_forward_pre_hook(lambda m, i: safe(before_forward, m, i))
    hooks.register_module_forward_hook(lambda m, i, o: safe(after_forward, m, i, o))

    original = dist.all_reduce
    seen = [0]

    def note_reduce(tensor, op, async_op):
        if async_op or seen[0] >= MAX_REDUCES or obs.current_pass is None or not torch.is_tensor(tensor):
            return
        if tensor.numel() > MAX_NUMEL or op != dist.ReduceOp.SUM:
            return
        seen[0] += 1
        loader, number = obs.current_pass
        obs.write({"kind": "reduce", "values": [float(v) for v in tensor.detach().cpu().reshape(-1).tolist()],
                   "loader": loader, "pass": number, "step": obs.steps, "at": user_line()})

    @functools.wraps(original)
    def all_reduce(tensor, *a, **k):
        op = k.get("op", a[0] if a else dist.ReduceOp.SUM)
        async_op = k.get("async_op", a[2] if len(a) > 2 else False)
        safe(note_reduce, tensor, op, async_op)
        return original(tensor, *a, **k)
    dist.all_reduce = all_reduce
