"""Rules for mistakes seen again and again in real training code: a data set downloaded by every
rank at once, the learning rate scaled by the world size while the global batch stays the same,
checkpoints holding objects that `torch.load(weights_only=True)` refuses, FSDP2 accumulation
that reduce-scatters on every micro-step, and a mid-epoch resume that starts the epoch over."""
from __future__ import annotations

import ast
import re

from . import structure
from .astutil import dotted, key, last
from .core import Hit, rule
from .pyfacts import Module
from .rules_accum import _syncs_itself, accumulating_backwards, fsdp2
from .rules_ckpt import _program
from .rules_train import _from_torch_distributed

# ------------------------------------------------------------ DDP024: a download on every rank
# Fetches with no lock around them. Hugging Face's load_dataset, hf_hub_download and snapshot_download
# take a file lock in their cache, so every rank may call them (run_clm.py does): not listed.
DOWNLOADS = {"urlretrieve", "download_url", "download_and_extract_archive", "download_file_from_google_drive"}
# `with accelerator.main_process_first():`, `with training_args.main_process_first(...)`, YOLO's
# `with torch_distributed_zero_first(LOCAL_RANK):`: rank 0 goes first, the others wait for it
FIRST = re.compile(r"main_process_first|zero_first|rank_?0_first", re.I)


def _downloads(call: ast.Call) -> bool:
    if any(kw.arg == "download" and isinstance(kw.value, ast.Constant) and kw.value.value is True
           for kw in call.keywords):
        return True
    return last(call) in DOWNLOADS


def _goes_first(m: Module, node, depth: int = 0) -> bool:
    """node runs inside a `with ...main_process_first():` block, here or around every call of its function."""
    for a in m.ancestors(node):
        if isinstance(a, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call) and FIRST.search(last(i.context_expr) or "") for i in a.items):
            return True
    func = m.function(node)
    if func is None or depth > 3:
        return False
    calls = m.callers(func)
    return bool(calls) and all(_goes_first(m, c, depth + 1) for c in calls)


@rule("DDP024", "A data set is downloaded on every rank: N processes fetch the same files into the same folder "
      "at once, and a rank reads another's half-written archive.",
      fix="download on rank 0 only (`if rank == 0: MNIST(root, download=True)`), then `dist.barrier()`, then open "
          "it on every rank with download=False (or wrap it in `with accelerator.main_process_first():`)")
def download_on_every_rank(m: Module):
    if not ((m.runs_distributed or m.is_ddp) and m.multiprocess):
        return
    for call in m.calls:
        if not _downloads(call) or _goes_first(m, call):
            continue
        guard = m.rank0_only(call)
        if guard:
            yield from _opened_without_waiting(m, call, guard[0])
            continue
        where = m.every_rank_path(call)
        what = ast.unparse(call.func)
        func = m.function(call)
        if where is call or where is not None and _program(func):   # main() itself: the check goes in it
            yield Hit(call, f"{what}(...) downloads on every rank: N processes fetch the same files into the same "
                            "folder at once, and a rank reads another's half-written archive.")
        elif where is not None:
            yield Hit(where, f"{func.name}() downloads ({what}, line {call.lineno}) and is called here on every "
                             "rank: N processes fetch the same files at once, and a rank reads another's half-written "
                             "archive.")


def _opened_without_waiting(m: Module, download, branch):
    """Rank 0 downloads under `branch`; the same data set class opened after it, on every rank, with no
    barrier (or other collective, or a function of the file that joins one) in between."""
    if not isinstance(branch, ast.If) or not any(a is branch for a in m.ancestors(download)):
        return
    after = [c for c in m.walk_scope(m.scope(download)) if isinstance(c, ast.Call) and c.lineno > branch.end_lineno]
    opens = sorted((c for c in after if last(c) == last(download) and not _downloads(c) and not m.rank0_only(c)),
                   key=lambda c: c.lineno)
    if not opens:
        return
    distributed = _from_torch_distributed(m)
    joins = lambda n: isinstance(n, ast.Call) and structure.collective(n, m.imported, distributed)  # noqa: E731
    if any(c.lineno <= opens[0].lineno and (joins(c) or m.flow.target(c) is not None and
                                            m.flow.reaches(m.flow.target(c), joins) is not None) for c in after):
        return
    yield Hit(opens[0], f"rank 0 downloads {ast.unparse(download.func)} under `if {ast.unparse(branch.test)}:` "
                        f"(line {branch.lineno}), but every rank opens it here without waiting: a rank reads the "
                        "folder before the files are there.")


# ------------------------------------------------------------ DDP025: lr times world size, global batch fixed
WORLD = re.compile(r"(^|_)world_size$|^(world|num_replicas|num_processes|n_?procs)$", re.I)
LR = re.compile(r"(^|_)(lr|learning_rate)$", re.I)
BATCH = re.compile(r"batch|(^|_)bs$", re.I)


def _is_world(node, aliases=frozenset()) -> bool:
    """node reads the number of ranks: `world_size`, `args.world_size`, `dist.get_world_size()`,
    `accelerator.num_processes`, `int(os.environ["WORLD_SIZE"])`, or a name bound to one of these."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and last(n) == "get_world_size":
            return True
        if isinstance(n, (ast.Name, ast.Attribute)) and (
                WORLD.search(n.id if isinstance(n, ast.Name) else n.attr) or key(n) in aliases):
            return True
        if isinstance(n, ast.Constant) and n.value == "WORLD_SIZE":
            return True
    return False


def _world_aliases(m: Module) -> frozenset:
    """Names bound to the number of ranks: `num_tasks = misc.get_world_size()`."""
    return frozenset(key(t) for n in m.nodes if isinstance(n, ast.Assign) and _world_value(n.value)
                     for t in n.targets if key(t))


def _world_value(v) -> bool:
    """v is the number of ranks itself (not a value computed from it)."""
    if isinstance(v, ast.IfExp):   # `dist.get_world_size() if dist.is_initialized() else 1`
        return _world_value(v.body) or _world_value(v.orelse)
    if isinstance(v, ast.Call) and last(v) in ("int", "get", "getenv") and v.args:
        return _world_value(v.args[0]) or isinstance(v.args[0], ast.Constant) and v.args[0].value == "WORLD_SIZE"
    if isinstance(v, ast.Subscript):   # os.environ["WORLD_SIZE"]
        return isinstance(v.slice, ast.Constant) and v.slice.value == "WORLD_SIZE"
    return isinstance(v, ast.Call) and last(v) == "get_world_size" or \
        isinstance(v, (ast.Name, ast.Attribute)) and bool(WORLD.search(_name(v)))


def _name(node) -> str:
    return (dotted(node) or "").rsplit(".", 1)[-1]


def _lr_scalings(m: Module, world: frozenset):
    """(node to report, the product) where a learning rate is multiplied by the world size."""
    for n in m.nodes:
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Mult) \
                and any(LR.search(_name(t)) for t in n.targets) and _is_world(n.value, world):
            yield n, n.value
        elif isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Mult) and LR.search(_name(n.target)) \
                and _is_world(n.value, world):
            yield n, n
        elif isinstance(n, ast.keyword) and n.arg == "lr" and isinstance(n.value, ast.BinOp) \
                and isinstance(n.value.op, ast.Mult) and _is_world(n.value, world):
            yield n.value, n.value


def _batch_splits(m: Module, world: frozenset):
    """Where the per-rank batch is the global batch divided by the world size."""
    for n in m.nodes:
        split = isinstance(n, ast.BinOp) and isinstance(n.op, (ast.FloorDiv, ast.Div)) and _is_world(n.right, world)
        if not split:
            continue
        if any(isinstance(x, (ast.Name, ast.Attribute)) and BATCH.search(_name(x)) for x in ast.walk(n.left)):
            yield n   # `cfg.SOLVER.IMS_PER_BATCH // world_size`, `args.global_batch // num_tasks`
            continue
        holder = m.parent.get(n)
        if isinstance(holder, ast.Call) and last(holder) == "int":   # int(global_batch / world_size)
            holder = m.parent.get(holder)
        if isinstance(holder, ast.keyword) and holder.arg == "batch_size" or \
                isinstance(holder, ast.Assign) and any(BATCH.search(_name(t)) for t in holder.targets) or \
                isinstance(holder, ast.AugAssign) and BATCH.search(_name(holder.target)):
            yield n


@rule("DDP025", "The learning rate is multiplied by the world size, but the per-rank batch is the global batch "
      "divided by it: the global batch is the same for any N, so the lr is N times too large.",
      fix="keep the lr tuned for the global batch (drop `* world_size`); scale the lr only when the per-rank "
          "batch is fixed and the global batch grows with N")
def lr_scaled_fixed_global_batch(m: Module):
    if not (m.is_ddp and m.multiprocess):
        return
    world = _world_aliases(m)
    splits = list(_batch_splits(m, world))
    if not splits:
        return
    split = splits[0]
    for node, product in _lr_scalings(m, world):
        yield Hit(node, f"`{ast.unparse(product)}` multiplies the learning rate by the world size, but "
                        f"`{ast.unparse(split)}` (line {split.lineno}) divides the global batch among the ranks: the "
                        "global batch is the same for any N, so the lr is N times too large.")


# ------------------------------------------------------------ DDP026: objects weights_only refuses
MODEL_NAME = re.compile(r"^(model|net|network|module)$|_(model|net)$", re.I)


def _dataclasses(m: Module) -> set:
    return {n.name for n in m.nodes if isinstance(n, ast.ClassDef) and any(
        "dataclass" in (dotted(d.func if isinstance(d, ast.Call) else d) or "") for d in n.decorator_list)}


def _modules(m: Module) -> set:
    names, changed = {"Module"}, True
    classes = [n for n in m.nodes if isinstance(n, ast.ClassDef)]
    while changed:
        changed = False
        for c in classes:
            if c.name not in names and any(_name(b) in names for b in c.bases):
                names.add(c.name)
                changed = True
    return names


def _kind(v, dcs: set, mods: set) -> str | None:
    """What object the value v builds, when torch.load(weights_only=True) would refuse it."""
    if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Call) and last(v.value) == "parse_known_args":
        v = v.value
    if not isinstance(v, ast.Call):
        return None
    name, full = last(v), dotted(v.func) or ""
    if name in ("parse_args", "parse_known_args", "Namespace", "SimpleNamespace"):
        return "an argparse.Namespace"
    if name in dcs:
        return f"a dataclass ({name})"
    if full.startswith("OmegaConf.") and name in ("load", "create", "merge"):
        return "an OmegaConf DictConfig"
    if name in mods - {"Module"} or name in ("DDP", "DistributedDataParallel") or \
            full.startswith(("torchvision.models.", "models.")):
        return "a whole model (nn.Module)"
    return None


class _Objects:
    """What a name holds where it is saved: its last binding before the save in that scope, or, for a
    name the scope does not bind (a parameter), any binding in the file, including the arguments the
    file's calls pass (`main(get_args_parser().parse_args())` makes main's `args` a Namespace)."""

    def __init__(self, m: Module):
        self.m, self.dcs, self.mods, self.anywhere = m, _dataclasses(m), _modules(m), {}
        bound = [(key(n.targets[0]), n.value) for n in m.nodes
                 if isinstance(n, ast.Assign) and len(n.targets) == 1 and key(n.targets[0])]
        for func in (n for n in m.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            params = [a.arg for a in [*func.args.posonlyargs, *func.args.args]]
            for call in m.callers(func):
                if isinstance(call, ast.Call):
                    bound += list(zip(params, call.args))
        for k, v in bound:
            kind = _kind(v, self.dcs, self.mods)
            if kind:
                self.anywhere[k] = kind

    def local(self, k: str, at) -> list:
        return [v for line, v, _ in self.m.assignments(self.m.scope(at), k) if line < at.lineno]

    def of(self, k: str | None, at) -> str | None:
        if k is None:
            return None
        here = self.local(k, at)
        return _kind(here[-1], self.dcs, self.mods) if here else self.anywhere.get(k)


def _saves(m: Module):
    for call in m.calls:
        if (dotted(call.func) == "torch.save" or last(call) == "save_on_master") and call.args:
            yield call


def _entries(m: Module, obj, at):
    """The values a saved object holds: a dict literal's values, or those of the dict literal the name
    was last bound to before `at`, and `ckpt["k"] = v` stores into it."""
    if isinstance(obj, ast.Dict):
        yield from obj.values
        return
    k = key(obj)
    if k is None:
        return
    scope = m.scope(at)
    bound = [v for line, v, _ in m.assignments(scope, k) if line < at.lineno and v is not None]
    if bound and isinstance(bound[-1], ast.Dict):
        yield from bound[-1].values
    for n in m.walk_scope(scope):
        if isinstance(n, ast.Assign) and n.lineno < at.lineno and any(
                isinstance(t, ast.Subscript) and key(t.value) == k for t in n.targets):
            yield n.value


@rule("DDP026", "The checkpoint holds a Python object that torch.load refuses with weights_only=True, the default "
      "since torch 2.6: the file cannot be read back without weights_only=False, which runs pickled code.",
      fix="save plain data: `vars(args)`, `dataclasses.asdict(cfg)`, `model.state_dict()`; rebuild the objects "
          "after loading")
def checkpoint_objects(m: Module):
    if not m.is_ddp or "add_safe_globals" in m.text or any(
            kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is False
            for c in m.calls if last(c) == "load" for kw in c.keywords):
        return   # the program reads its own pickles back on purpose, or allows these classes
    objects = _Objects(m)
    for call in _saves(m):
        obj = call.args[0]
        k, kind = key(obj), objects.of(key(obj), call)
        if kind and kind.startswith("a whole model") or kind is None and k and not objects.local(k, call) and \
                k not in objects.anywhere and MODEL_NAME.search(k.rsplit(".", 1)[-1]):
            name = ast.unparse(obj)
            yield Hit(call, f"torch.save({name}) pickles a whole model (nn.Module): torch.load refuses it with "
                            f"weights_only=True, the default since torch 2.6; save {name}.state_dict() instead.")
            continue
        for v in _entries(m, obj, call):
            kind = objects.of(key(v), call)
            if kind:
                yield Hit(v, f"`{ast.unparse(v)}` is {kind}: torch.load refuses it with weights_only=True, the "
                             "default since torch 2.6, so this checkpoint cannot be read back without "
                             "weights_only=False.")


# ------------------------------------------------------------ DDP027: FSDP2 accumulation that syncs every micro-step
@rule("DDP027", "Gradient accumulation on a fully_shard (FSDP2) model without set_requires_gradient_sync(False): "
      "every backward reduce-scatters the gradients, but the optimizer steps every k, so k-1 of every k "
      "reduce-scatters are wasted.",
      fix="call `model.set_requires_gradient_sync(is_last)` before each micro-step's backward, where is_last is "
          "true on the last micro-step of each window (FSDP2 has no no_sync()); if the unsharded gradients this "
          "keeps do not fit in memory, reduce-scattering every micro-step is the price: say so with "
          "`# ddp-lab: ignore[DDP027]`")
def fsdp2_accumulation_without_sync_off(m: Module):
    if not (fsdp2(m) and m.multiprocess) or _syncs_itself(m):
        return
    for first, via in accumulating_backwards(m):
        yield Hit(first) if via is None else Hit(via, (
            f"Gradient accumulation on a fully_shard (FSDP2) model without set_requires_gradient_sync(False): "
            f"{ast.unparse(via.func)}() runs backward() ({m.where(first)}) on every micro-step, and each "
            "reduce-scatters the gradients, but the optimizer steps every k, so k-1 of every k reduce-scatters "
            "are wasted."))


# ------------------------------------------------------------ DDP028: a mid-epoch resume that restarts the epoch
LOADER = re.compile(r"loader|(^|_)dl$", re.I)
STEP_KEY = re.compile(r"step|iter", re.I)
LOADS = ("torch.load", "dcp.load", "torch.distributed.checkpoint.load")
# what a program that resumes mid-epoch keeps: a batch or sample position, a skip, a sampler that
# starts late, a loader with a state_dict
POSITION = re.compile(r"islice|skip|start_(index|batch|sample|step)|set_start|StatefulDataLoader|fast_forward|"
                      r"(batch|sample)(es|s)?_(idx|index|offset|seen|in_epoch|done)|offset|position", re.I)


def _loader_loop(m: Module, node):
    """The `for ... in loader:` / `for i, b in enumerate(loader):` around node, in its function."""
    for a in m.ancestors(node):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return None
        if isinstance(a, (ast.For, ast.AsyncFor)) and any(
                isinstance(n, (ast.Name, ast.Attribute)) and LOADER.search(_name(n)) for n in ast.walk(a.iter)):
            return a
    return None


def _saved_keys(m: Module, obj, at) -> set:
    """The string keys of the saved dict: a dict literal, the one its name was last bound to, and
    `ckpt["k"] = v` stores into it."""
    if isinstance(obj, ast.Dict):
        return {k.value for k in obj.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    k = key(obj)
    if k is None:
        return set()
    scope, out = m.scope(at), set()
    bound = [v for line, v, _ in m.assignments(scope, k) if line < at.lineno and v is not None]
    if bound and isinstance(bound[-1], ast.Dict):
        out |= _saved_keys(m, bound[-1], at)
    for n in m.walk_scope(scope):
        if isinstance(n, ast.Assign) and n.lineno < at.lineno:
            out |= {t.slice.value for t in n.targets if isinstance(t, ast.Subscript) and key(t.value) == k
                    and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)}
    return out


def _keeps_position(m: Module) -> bool:
    """The file saves or restores where in the epoch it was (see POSITION), or a loader's or sampler's
    state, or a sampler told where to start (`sampler.start = ...`)."""
    for n in m.nodes:
        words = [n.id] if isinstance(n, ast.Name) else [n.attr] if isinstance(n, ast.Attribute) else \
            [n.value] if isinstance(n, ast.Constant) and isinstance(n.value, str) else \
            [n.name] if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else []
        if any(POSITION.search(w) for w in words):
            return True
        if isinstance(n, ast.Attribute) and n.attr == "start" and isinstance(n.ctx, ast.Store):
            return True
        if isinstance(n, ast.Call) and last(n) in ("state_dict", "load_state_dict") and \
                isinstance(n.func, ast.Attribute) and re.search(r"loader|sampler", _name(n.func.value), re.I):
            return True
    return False


def _called_in_loop(m: Module, node, depth: int = 0):
    """The loader loop around node, or around a call of its function (helpers three deep)."""
    loop, func = _loader_loop(m, node), m.function(node)
    if loop is not None or func is None or depth > 2:
        return loop
    return next((lp for c in m.callers(func) if (lp := _called_in_loop(m, c, depth + 1)) is not None), None)


def _mid_epoch_saves(m: Module):
    """(save, loop): a torch.save / dcp.save inside a loader loop, or in a function called there."""
    for call in m.calls:
        name = dotted(call.func) or ""
        if not (name == "torch.save" or last(call) == "save_on_master" or
                name.endswith(".save") and name.split(".")[0] in ("dcp", "torch")) or not call.args:
            continue
        loop = _called_in_loop(m, call)
        if loop is not None:
            yield call, loop


@rule("DDP028", "A checkpoint saved inside the batch loop holds the step but not the position in the epoch: the "
      "resumed run starts the epoch's loader from its first batch, trains those batches twice and never sees "
      "the epoch's last ones.",
      fix="save the position in the epoch with the step (`'batch': i + 1`) and skip that many batches on resume "
          "(`itertools.islice(loader, start, None)`), or use torchdata's StatefulDataLoader and save its "
          "state_dict()")
def mid_epoch_resume(m: Module):
    if not m.is_ddp or _keeps_position(m):
        return
    loads = [c for c in m.calls if dotted(c.func) in LOADS]
    if not loads:
        return   # no resume: the checkpoints are only read by someone else
    for save, loop in _mid_epoch_saves(m):
        keys = _saved_keys(m, save.args[0], save)
        if not any(STEP_KEY.search(k) for k in keys):
            continue
        yield Hit(save, f"{ast.unparse(save.func)}(...) saves the step inside `for ... in "
                        f"{ast.unparse(loop.iter)}:` (line {loop.lineno}) but not the position in the epoch: the "
                        f"resume ({ast.unparse(loads[0].func)}, line {loads[0].lineno}) starts the epoch's loader "
                        "from its first batch, trains those batches twice and never sees the last ones.")
