"""Observes a torchrun rank for `ddp-lab verify`; does nothing unless DDP_LAB_VERIFY_DIR is set.

`ddp-lab verify` puts this folder on PYTHONPATH, so Python imports this file at startup in every
process of the job, before the user's program (which stays unchanged). When the hang autopsy is on,
its own sitecustomize comes first and runs this one after it (it chains to the next one on the
path); this one chains to whatever sitecustomize it shadows in turn. In a rank (RANK is set) it
imports torch and wraps, without changing what they compute:

- DataLoader iteration: at the start of each pass, the sampler's whole order for that pass is drawn
  at once (the same random numbers a full pass draws), written down, then handed out as before,
  with what the rank can draw from (the sampler's index list, each Subset, the data set under them);
- DistributedDataParallel: a global forward pre-hook finds each DDP module at its first forward
  and registers a comm hook that counts the gradient all-reduces and their bytes, then does
  torch's default all-reduce (a user's own hook is wrapped with the same counter instead);
- every optimizer's step (torch's global step post-hook): a hash per parameter and per DDP buffer,
  the learning rates, the all-reduces since the previous step. With DDP_LAB_VERIFY_STEPS=N every
  rank stops after step N (a barrier, then exit status 0), all at the same step; before each step,
  a hash of the parameters, of the optimizer state and of the global generators, and the batch the
  step drew (for --resume);
  with DDP_LAB_VERIFY_KILL_AT=K every rank SIGKILLs itself right after step K; with
  DDP_LAB_VERIFY_FILES=1 rank 0 notes whether the script has written a file yet;
- Join (uneven inputs): each all-reduce a rank out of data shadows counts as its step (marked
  "joined", so it is not compared), keeping the ranks' step numbers aligned;
- the script's line at each of these hooks (file:line of the innermost frame outside torch, the
  standard library and installed packages): the line that started each pass, each optimizer step,
  each all-reduce round (the backward() that made it), so findings can name it;
- before step 1: each parameter tensor's gradient norm, this rank's own (in the comm hook, before
  the all-reduce) and the averaged one, and the batches the step drew; with DDP_LAB_VERIFY_FEED (a
  JSON file: loader, pass, items) that pass starts with those batches instead (verify --scaling);
- LR schedulers' steps and the script's small all-reduces: _ddp_lab_verify_world.py;
- after each of the first steps, a hash of the state the script keeps outside the optimizer (an EMA
  copy of the model, tensors named ema/shadow/average): _ddp_lab_verify_state.py;
- init_process_group: its timeout capped at DDP_LAB_VERIFY_PG_TIMEOUT seconds, so a hang fails fast;
- the working directory: a rank starts in DDP_LAB_VERIFY_WORKDIR (verify's scratch folder).
- with DDP_LAB_VERIFY_ONE_PER_NODE=1, each rank's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK and
  GROUP_WORLD_SIZE are those of a node with one rank (LOCAL_RANK 0 everywhere), set before the
  script reads them: one torchrun runs the ranks, not one per simulated node.

Records are JSON lines in $DDP_LAB_VERIFY_DIR/rank{R}.jsonl. Every wrapper falls back to the
original behaviour if its own bookkeeping fails. No wrapper of ours is on the stack while the
program waits in a collective (hooks return before it), so the hang autopsy still names the
program's own line.
"""
import os
import sys

ENV = "DDP_LAB_VERIFY_DIR"
WORKDIR = "DDP_LAB_VERIFY_WORKDIR"  # the rank's working directory (verify's scratch folder)
_OWNER = "DDP_LAB_VERIFY_PID"
ONE_PER_NODE = "DDP_LAB_VERIFY_ONE_PER_NODE"  # "1": each rank sees the variables of a 1-rank node
_HERE = os.path.dirname(os.path.abspath(__file__))
MAX_INDICES = 200_000  # per pass: larger orders are summarised, not listed
SHOW_LINES = 8  # the script's lines of the all-reduce rounds kept per step


def _chain_next_sitecustomize():
    """Run the sitecustomize this file shadows (the next one down sys.path), if there is one.

    Only the entries after this folder: one before it (the autopsy's) has run already and ran us."""
    import importlib.machinery
    import importlib.util
    here = [i for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) == _HERE]
    rest = sys.path[here[0] + 1:] if here else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.dirname(os.path.abspath(spec.origin or "")) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


class _Observer:
    def __init__(self, folder, rank):
        import json
        self.json = json
        self.rank = rank
        self.path = os.path.join(folder, f"rank{rank}.jsonl")
        self.stop_at = int(os.environ.get("DDP_LAB_VERIFY_STEPS") or 0)
        self.kill_at = int(os.environ.get("DDP_LAB_VERIFY_KILL_AT") or 0)
        self.files = os.environ.get("DDP_LAB_VERIFY_FILES") == "1" and rank == 0
        self.current = None      # (weakref to the loader iterator of the latest pass, its order)
        self.current_pass = None  # (loader number, pass number) of the latest pass
        self.local = {}          # id(param) -> norm of this rank's own gradient before step 1
        feed = os.environ.get("DDP_LAB_VERIFY_FEED")  # the batches step 1 draws (verify --scaling)
        self.feed = json.load(open(feed)) if feed else None
        self.pre = {}
        self.steps = 0
        self.rounds = 0          # gradient all-reduce rounds (last bucket seen) since the last step
        self.buckets = 0
        self.bytes = 0
        self.round_lines = []    # the script's line of each all-reduce round since the last step
        self.loaders = {}        # id(dataset) -> [number, passes, dataset]: a new DataLoader per
                                 # epoch over the same data set is the same loader
        self.ddp = []            # the DDP modules (strong refs: verify runs are short)
        self.hooked = set()

    def write(self, record):
        record["rank"] = self.rank
        with open(self.path, "a") as f:
            f.write(self.json.dumps(record) + "\n")

    # -- data ---------------------------------------------------------------------------------
    def loader_pass(self, it, loader):
        """Draw the pass's whole order now, record it, hand it out unchanged."""
        import torch.utils.data as tud
        if isinstance(loader.dataset, tud.IterableDataset):
            return
        import weakref
        entry = self.loaders.setdefault(id(loader.dataset), [len(self.loaders), 0, loader.dataset])
        number, passes = entry[0], entry[1]
        entry[1] += 1
        order = list(it._sampler_iter)
        feed = self.feed
        if feed and (feed["loader"], feed["pass"]) == (number, passes):  # --scaling's 1-rank run:
            order = feed["items"] + order[len(feed["items"]):]           # step 1 on rank 0's batches
        it._sampler_iter = iter(order)
        self.current = (weakref.ref(it), order)
        self.current_pass = (number, passes)
        it._ddp_lab_pass = (number, passes)
        flat = []
        for item in order:
            flat.extend(item if isinstance(item, (list, tuple)) else [item])
        dataset, mapped = _to_base(tud, loader.dataset, flat)
        sampler = loader.sampler
        info = {"type": type(sampler).__name__}
        if isinstance(sampler, tud.DistributedSampler):
            info.update(distributed=True, rank=sampler.rank, num_replicas=sampler.num_replicas, epoch=sampler.epoch,
                        shuffle=sampler.shuffle, drop_last=sampler.drop_last, seed=sampler.seed,
                        total_size=sampler.total_size, length=len(sampler.dataset))
        try:
            size = len(dataset)
        except TypeError:
            size = None
        self.write({"kind": "pass", "loader": number, "pass": passes, "step": self.steps,
                    "dataset_len": size, "subset": dataset is not loader.dataset, "sampler": info,
                    "batch_size": loader.batch_size, "drop_last": loader.drop_last, "count": len(mapped),
                    "indices": [int(i) for i in mapped] if len(mapped) <= MAX_INDICES else None,
                    "universes": _universes(tud, loader), "at": _user_line()})

    # -- gradients ----------------------------------------------------------------------------
    def counting(self, hook):
        def counted(state, bucket):
            try:
                self.buckets += 1
                buf = bucket.buffer()
                if self.steps == 0:  # this rank's own gradient of step 1, before it is averaged
                    for p, g in zip(bucket.parameters(), bucket.gradients()):
                        self.local[id(p)] = float(g.detach().norm())
                self.bytes += buf.numel() * buf.element_size()
                if bucket.is_last():
                    self.rounds += 1
                    if len(self.round_lines) < SHOW_LINES:  # the backward() call that all-reduced
                        self.round_lines.append(_user_line())
            except Exception:  # noqa: BLE001
                pass
            return hook(state, bucket)
        return counted

    def first_forward(self, ddp):
        if id(ddp) in self.hooked:
            return
        self.hooked.add(id(ddp))
        self.ddp.append(ddp)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        _register_comm_hook(ddp, ddp.process_group, self.counting(allreduce_hook))

    # -- steps --------------------------------------------------------------------------------
    def before_step(self, optimizer):
        import hashlib
        import torch
        params = hashlib.blake2b(digest_size=8)
        state = hashlib.blake2b(digest_size=8)
        for group in optimizer.param_groups:
            for p in group["params"]:
                params.update(_digest(hashlib, torch, p).encode())
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    state.update(f"{key}={_digest(hashlib, torch, value) if torch.is_tensor(value) else value}".encode())
        self.pre = {"pre_params": params.hexdigest(), "pre_opt": state.hexdigest(), "at": _user_line()}
        import _ddp_lab_verify_state
        self.pre["rng_before"] = _ddp_lab_verify_state.generators()  # loop draws; what a resume restored
        if self.steps == 0:
            self.first_step(optimizer)
        if self.current is not None:  # the batch this step was computed on: the latest one drawn
            it, order = self.current[0](), self.current[1]
            done = getattr(it, "_num_yielded", 0) if it is not None else 0
            if 0 < done <= len(order):
                batch = order[done - 1]
                batch = [int(i) for i in (batch if isinstance(batch, (list, tuple)) else [batch])]
                self.pre["batch"] = hashlib.blake2b(str(batch).encode(), digest_size=8).hexdigest()
                self.pre["batch_head"] = batch[:3]

    def first_step(self, optimizer):
        """Before step 1: the gradient norm of each parameter tensor (what the optimizer sees, and
        this rank's own before the all-reduce) and the batches the step drew (verify --scaling)."""
        names = {}
        for ddp in self.ddp:
            names.update({id(p): n for n, p in ddp.module.named_parameters()})
        grad = {}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    grad[names.get(id(p), f"param_groups[{g}][{i}]")] = float(p.grad.detach().norm())
        self.pre["grad"] = grad
        self.pre["grad_local"] = {names[k]: v for k, v in self.local.items() if k in names}
        if self.current is not None and self.current_pass is not None:
            it, order = self.current[0](), self.current[1]
            done = getattr(it, "_num_yielded", 0) if it is not None else 0
            drawn = sum(len(x) if isinstance(x, (list, tuple)) else 1 for x in order[:done])
            if 0 < done <= len(order) and drawn <= MAX_INDICES:
                items = [[int(i) for i in x] if isinstance(x, (list, tuple)) else int(x) for x in order[:done]]
                self.pre["drawn"] = {"loader": self.current_pass[0], "pass": self.current_pass[1], "items": items}

    def wrote_files(self):
        for _, _, names in os.walk(os.environ.get(WORKDIR) or os.getcwd()):
            if names:
                return True
        return False

    def after_step(self, optimizer):
        import hashlib
        import torch
        names = {}
        for ddp in self.ddp:
            names.update({id(p): n for n, p in ddp.module.named_parameters()})
        params, buffers = {}, {}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                params[names.get(id(p), f"param_groups[{g}][{i}]")] = _digest(hashlib, torch, p)
        broadcast = None
        for ddp in self.ddp:
            broadcast = bool(getattr(ddp, "broadcast_buffers", True))
            for n, b in ddp.module.named_buffers():
                buffers[n] = _digest(hashlib, torch, b)
        import _ddp_lab_verify_state
        state = {}
        if self.steps < _ddp_lab_verify_state.STEPS:  # what the script keeps outside the optimizer
            from torch.nn.parallel import DistributedDataParallel
            _user_line()  # (fills _LIBRARY)
            state = {"state": _ddp_lab_verify_state.fingerprint(_digest, _LIBRARY, DistributedDataParallel, self.ddp),
                     "rng_after": _ddp_lab_verify_state.generators()}
        self.step_done({"broadcast_buffers": broadcast, "params": params, "buffers": buffers, **state,
                        "lr": [g.get("lr") if isinstance(g.get("lr"), (int, float)) else None
                               for g in optimizer.param_groups], **self.pre})

    def joined_step(self, ddp):
        """Under Join (uneven inputs), a rank out of data shadows each step's gradient all-reduce
        instead of stepping: counted as its step, so the ranks' step numbers stay aligned; its
        parameters wait for Join's final sync, so they are not compared at this step."""
        import hashlib
        import torch
        self.step_done({"joined": True, "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", True)),
                        "lr": [], "buffers": {},
                        "params": {n: _digest(hashlib, torch, p) for n, p in ddp.module.named_parameters()}})

    def step_done(self, fields):
        """Record one step (what every step's record holds, then `fields`); kill or stop at it."""
        self.steps += 1
        self.write({"kind": "step", "step": self.steps, "rounds": self.rounds, "buckets": self.buckets,
                    "bytes": self.bytes, "ddp": len(self.ddp), "round_lines": self.round_lines, **fields,
                    **({"files": self.wrote_files()} if self.files else {})})
        self.pre = {}
        if self.kill_at and self.steps == self.kill_at:
            import signal
            os.kill(os.getpid(), signal.SIGKILL)  # as a lost node would: no cleanup, no last save
        self.rounds = self.buckets = self.bytes = 0
        self.round_lines = []
        if self.stop_at and self.steps >= self.stop_at:
            self.stop()

    def stop(self):
        """Every rank stops at the same step: nothing is left waiting in a collective."""
        self.write({"kind": "stopped", "step": self.steps})
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.barrier()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _to_base(tud, dataset, indices):
    """(the data set under every Subset, `indices` mapped into it)."""
    while isinstance(dataset, tud.Subset):
        indices = [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    return dataset, indices


def _universes(tud, loader):
    """What a rank can draw from, innermost first, each as indices into the data set under every
    Subset: the sampler's own index list (SubsetRandomSampler, a list), each Subset from the loader's
    data set down; last the data set under them all ("indices": None: all of its `len`)."""
    out = []
    sampler = loader.sampler
    own = getattr(sampler, "indices", None) if isinstance(sampler, tud.SubsetRandomSampler) else \
        sampler if isinstance(sampler, (list, tuple, range)) else None
    if own is not None:
        out.append(("sampler", _to_base(tud, loader.dataset, [int(i) for i in own])[1]))
    dataset = loader.dataset
    while isinstance(dataset, tud.Subset):
        out.append(("Subset", _to_base(tud, dataset, range(len(dataset)))[1]))
        dataset = dataset.dataset
    levels = [{"what": what, "len": len(ix), "indices": sorted(set(ix)) if len(ix) <= MAX_INDICES else None}
              for what, ix in out]
    try:
        size = len(dataset)
    except TypeError:
        size = None
    return levels + [{"what": type(dataset).__name__, "len": size, "indices": None}]


_LIBRARY = []  # folders whose frames are not the script's: torch, this folder, the standard library


def _user_line():
    """file:line of the innermost frame of the program itself on the calling stack (the script's
    line that led to this hook), or None when there is none (a hook on another thread)."""
    if not _LIBRARY:
        import sysconfig
        import torch
        _LIBRARY.extend(os.path.dirname(p) + os.sep for p in (torch.__file__, __file__))
        _LIBRARY.extend(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not name.startswith(tuple(_LIBRARY)):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _digest(hashlib, torch, t):
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return "empty"
    return hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


def _register_comm_hook(ddp, state, hook):
    return _ORIGINAL["register_comm_hook"](ddp, state, hook)


_ORIGINAL = {}


def _patch(obs):
    import datetime
    import functools
    import torch
    import torch.distributed as dist
    import torch.utils.data.dataloader as dl
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def safe(fn, *a):
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - observing must never change the run
            obs.write({"kind": "observer-error", "where": getattr(fn, "__name__", "?"), "error": repr(e)})

    reset = dl._BaseDataLoaderIter._reset

    @functools.wraps(reset)
    def _reset(self, loader, first_iter=False):
        reset(self, loader, first_iter)
        safe(obs.loader_pass, self, loader)
    dl._BaseDataLoaderIter._reset = _reset  # a multi-process loader's passes, persistent workers too

    single = dl._SingleProcessDataLoaderIter.__init__

    @functools.wraps(single)
    def single_init(self, loader):  # a single-process loader makes its order here, not in _reset
        single(self, loader)
        safe(obs.loader_pass, self, loader)
    dl._SingleProcessDataLoaderIter.__init__ = single_init

    def find_ddp(module, inputs):
        if isinstance(module, DDP) and torch.is_grad_enabled():
            safe(obs.first_forward, module)
    torch.nn.modules.module.register_module_forward_pre_hook(find_ddp)

    _ORIGINAL["register_comm_hook"] = DDP.register_comm_hook

    @functools.wraps(DDP.register_comm_hook)
    def register_comm_hook(self, state, hook):
        if id(self) not in obs.hooked:
            obs.hooked.add(id(self))
            obs.ddp.append(self)
        return _ORIGINAL["register_comm_hook"](self, state, obs.counting(hook))
    DDP.register_comm_hook = register_comm_hook

    match = DDP._match_all_reduce_for_bwd_pass  # Join's shadow of one backward's all-reduces

    @functools.wraps(match)
    def _match_all_reduce_for_bwd_pass(self):
        match(self)
        safe(obs.joined_step, self)
    DDP._match_all_reduce_for_bwd_pass = _match_all_reduce_for_bwd_pass

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: safe(obs.before_step, opt))
    import _ddp_lab_verify_world  # what must not depend on the world size: schedulers, small all-reduces
    _ddp_lab_verify_world.patch(obs, safe, _user_line)
    register_optimizer_step_post_hook(lambda opt, args, kwargs: safe(obs.after_step, opt))

    cap = float(os.environ.get("DDP_LAB_VERIFY_PG_TIMEOUT") or 0)
    if cap > 0:
        init_pg = dist.init_process_group

        @functools.wraps(init_pg)
        def init_process_group(*a, **k):
            limit = datetime.timedelta(seconds=cap)
            if k.get("timeout") is None or k["timeout"] > limit:
                k["timeout"] = limit
            return init_pg(*a, **k)
        dist.init_process_group = init_process_group


def _main():
    folder, rank = os.environ.get(ENV), os.environ.get("RANK")
    if not folder or rank is None or not os.path.isdir(folder):
        return
    if os.environ.get(_OWNER):
        return  # a child of a rank (a DataLoader worker), or this rank is observed already
    os.environ[_OWNER] = str(os.getpid())
    if os.environ.get(ONE_PER_NODE) == "1":  # as if each rank were alone on a node of its own
        os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": rank,
                           "GROUP_WORLD_SIZE": os.environ.get("WORLD_SIZE", "1")})
    obs = _Observer(folder, int(rank))
    work = os.environ.get(WORKDIR)
    if work:  # the scratch folder: the parent never changes its own working directory
        try:
            os.chdir(work)
        except OSError as e:
            obs.write({"kind": "observer-error", "where": "chdir", "error": repr(e)})
    try:
        _patch(obs)
    except Exception as e:  # noqa: BLE001
        obs.write({"kind": "observer-error", "where": "patch", "error": repr(e)})


try:
    _main()
except Exception:  # noqa: BLE001 - never break the program
    pass
try:
    _chain_next_sitecustomize()
finally:
    del _chain_next_sitecustomize
