"""Notebook 11: DDP's performance options, compression hooks and torch.compile, on CPU ranks.

    torchrun --standalone --nproc_per_node=4 -m ddp_lab.experiments.nb11_gpu_paths

What a GPU changes is speed; what these options do to memory, bytes and graphs is the same on
gloo ranks, so each is counted here (one launch: starting processes is the slow part):
  views     gradient_as_bucket_view False / True: where each .grad lives after backward (its own
            storage, or a view into the bucket the comm hook is handed), the bytes of gradient
            storage outside the buckets, and the gradients themselves (equal either way)
  static    static_graph False / True: median step time, gradients equal
  compress  plain all-reduce, fp16, bf16 and PowerSGD (rank 1) hooks: bytes each rank hands to
            all_reduce per step (counted as they are called), and the global loss of every step;
            --powersgd-ranks 1,2,4 runs only PowerSGD, at each of those ranks
  compile   a backend that counts the graphs it is given, for torch.compile(DDP(model)) and for
            DDP(model.compile()), each with DDPOptimizer (optimize_ddp=True) and without, on a model
            class with its own forward and on the same layers in a bare nn.Sequential; the
            gradients against eager DDP; and whether a no_sync() step compiles again
  hybrid    (an even number of ranks) DDP, composable replicate, FSDP2 over every rank and FSDP2 on
            a (world/2, 2) mesh (HSDP), on notebook 09's MLP: parameter bytes per rank, losses
Records: kind = "views" | "static" | "compress" | "compile" | "hybrid", one per setting, from every rank.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_lab.engine import runtime
from ddp_lab.lessons import buckets, data, models

WIDTH, DEPTH = 512, 4            # five Linear layers, three of them 1 MiB: bucket caps bite
BATCH = 32                       # per rank
CAP_MB = 1.0                     # bucket cap for the views and compile probes: several buckets
STEPS = 40                       # training steps of the compression runs
POWERSGD_START = 10              # plain all-reduce before this step (PowerSGD's warm-up)
LR = 1e-3                        # Adam, for the compression runs
ONE_BUCKET_MB = 25.0             # the compression runs: the whole model in one bucket
COUNT = {"on": False, "bytes": 0, "calls": 0}


def install_counter():
    """The Python hooks call torch.distributed.all_reduce by attribute: wrapping it counts each call."""
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        if COUNT["on"]:
            COUNT["bytes"] += tensor.numel() * tensor.element_size()
            COUNT["calls"] += 1
        return real(tensor, *args, **kwargs)
    dist.all_reduce = counted


def build_model(seed=0):
    torch.manual_seed(seed)
    return buckets.deep_mlp(width=WIDTH, depth=DEPTH)


def model_and_batches(ctx):
    model = build_model()
    X, Y = data.digits_tensors("train")
    def batch(step):
        start = (step * ctx.world_size + ctx.rank) * BATCH % (len(X) - BATCH)
        return X[start:start + BATCH], Y[start:start + BATCH]
    return model, batch


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def views(ctx):
    """Where .grad lives, with and without gradient_as_bucket_view."""
    out = {}
    for as_view in (False, True):
        model, batch = model_and_batches(ctx)
        ddp = DDP(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
        seen = []   # each bucket's flat buffer, as the comm hook is handed it

        def hook(state, bucket):
            buf = bucket.buffer()
            seen.append((buf.untyped_storage().data_ptr(), buf.numel() * buf.element_size()))
            return default_hooks.allreduce_hook(state, bucket)
        ddp.register_comm_hook(None, hook)
        for step in range(2):    # DDP may rebuild its buckets after the first step: read the second
            seen.clear()
            x, y = batch(step)
            ddp.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
        bucket_ptrs = {p for p, _ in seen}
        storages = {}
        for p in model.parameters():
            s = p.grad.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        outside = sum(n for ptr, n in storages.items() if ptr not in bucket_ptrs)
        out[as_view] = grads(model)
        ctx.record(kind="views", as_view=as_view, buckets=len(seen), bucket_bytes=sum(n for _, n in seen),
                   grad_bytes=sum(p.grad.nbytes for p in model.parameters()),
                   grad_storages=len(storages), outside_bytes=outside,
                   in_buckets=sum(ptr in bucket_ptrs for ptr in storages))
        del ddp, model
    ctx.record(kind="views_equal", equal=all(torch.equal(a, b) for a, b in zip(out[False], out[True])))


def static(ctx, steps=12):
    out = {}
    for static_graph in (False, True):
        model, batch = model_and_batches(ctx)
        ddp = DDP(model, static_graph=static_graph)
        times = []
        for step in range(steps):
            x, y = batch(step)
            t0 = time.perf_counter()
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            times.append(time.perf_counter() - t0)
        out[static_graph] = grads(model)
        ctx.record(kind="static", static_graph=static_graph, median_s=statistics.median(times[2:]))
        del ddp, model
    ctx.record(kind="static_equal", equal=all(torch.equal(a, b) for a, b in zip(out[False], out[True])))


def compress(ctx, hooks=("plain", "fp16", "bf16"), powersgd_ranks=(1,)):
    runs = [(name, None) for name in hooks] + [("powersgd", r) for r in powersgd_ranks]
    for name, rank in runs:
        model, batch = model_and_batches(ctx)
        # One bucket (an explicit cap sets the first bucket's cap too): with several buckets on gloo,
        # torch 2.14.1's PowerSGD hook hung at its first compressed step in our runs.
        ddp = DDP(model, bucket_cap_mb=ONE_BUCKET_MB)
        if name == "powersgd":
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                           start_powerSGD_iter=POWERSGD_START)
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        else:
            ddp.register_comm_hook(None, {"plain": default_hooks.allreduce_hook,
                                          "fp16": default_hooks.fp16_compress_hook,
                                          "bf16": default_hooks.bf16_compress_hook}[name])
        opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        losses, per_step = [], []
        for step in range(STEPS):
            x, y = batch(step)
            COUNT.update(on=True, bytes=0, calls=0)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            COUNT["on"] = False
            per_step.append((COUNT["bytes"], COUNT["calls"]))
            opt.step()
            total = torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append((total[0] / total[1]).item())
        ctx.record(kind="compress", hook=name, powersgd_rank=rank, losses=losses,
                   bytes=[b for b, _ in per_step], calls=[c for _, c in per_step],
                   grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
        del ddp, model, opt


SHAPES = {"class": models.WideMLP, "nn.Sequential": models.wide_mlp}   # a user's model, a bare container


def compile_probe(ctx):
    """Which graphs torch.compile hands its backend, for the two orders of wrapping and compiling, on a
    model class with its own forward (as users write them) and on the same layers in a bare nn.Sequential."""
    import torch._dynamo as dynamo
    given = []

    def counting(gm, example_inputs):       # a backend that runs each graph as it is, and counts it
        given.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    _, batch = model_and_batches(ctx)
    x, y = batch(0)
    for shape, make in SHAPES.items():
        torch.manual_seed(0)
        eager_model = make(width=WIDTH, depth=DEPTH)
        eager = DDP(eager_model, bucket_cap_mb=CAP_MB)
        F.cross_entropy(eager(x), y).backward()
        ref = grads(eager_model)
        sizes = [p.numel() * p.element_size() for p in eager_model.parameters()]
        # an explicit bucket_cap_mb caps the first bucket too (torch 2.14): every bucket at CAP_MB
        predicted = len(buckets.assign(sizes, int(CAP_MB * buckets.MB), int(CAP_MB * buckets.MB)))
        del eager, eager_model
        for order in ("compile(DDP(model))", "DDP(model.compile())"):
            for optimize_ddp in (True, False):
                dynamo.reset()
                dynamo.config.optimize_ddp = optimize_ddp
                given.clear()
                torch.manual_seed(0)
                model = make(width=WIDTH, depth=DEPTH)
                if order == "compile(DDP(model))":
                    ddp = DDP(model, bucket_cap_mb=CAP_MB)
                    step_model = torch.compile(ddp, backend=counting)
                else:
                    model.compile(backend=counting)     # in place: parameter names stay as they are
                    ddp = step_model = DDP(model, bucket_cap_mb=CAP_MB)
                F.cross_entropy(step_model(x), y).backward()
                graphs = list(given)
                equal = all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(grads(model), ref))
                with ddp.no_sync():                      # a step that skips the all-reduce: compiles again?
                    F.cross_entropy(step_model(x), y).backward()
                ctx.record(kind="compile", shape=shape, order=order, optimize_ddp=optimize_ddp, graphs=graphs,
                           after_no_sync=len(given), predicted_buckets=predicted, equal_to_eager=equal,
                           names=[n for n, _ in step_model.named_parameters()][:2])
                del step_model, ddp, model
    dynamo.config.optimize_ddp = True
    dynamo.reset()


def hybrid(ctx):
    """DDP, composable replicate, FSDP2 over every rank and FSDP2 on a 2-D mesh (HSDP), on notebook
    09's MLP and global batches: each rank's bytes of parameters (its local shard) and the losses."""
    from torch.distributed._composable import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ddp_lab.lessons.beyond import LR, STEPS as BEYOND_STEPS, build_model, global_batch
    world = ctx.world_size
    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for strategy in ("ddp", "replicate", "fsdp", "hsdp"):
        model = build_model()
        if strategy == "ddp":
            model = DDP(model)
        elif strategy == "replicate":
            replicate(model)                  # DDP as a composable API: the module keeps its type
        else:
            mesh = flat if strategy == "fsdp" else hsdp
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)     # on a 2-D mesh: shard over "shard", replicate over the rest
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        losses = []
        for step in range(BEYOND_STEPS):
            x, y = global_batch(step)
            n = len(x) // world
            x, y = x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total = torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append((total[0] / total[1]).item())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        ctx.record(kind="hybrid", strategy=strategy, losses=losses,
                   param_bytes=sum(t.numel() * t.element_size() for t in local),
                   full_bytes=sum(p.numel() * p.element_size() for p in build_model().parameters()),
                   type=type(model).__name__)
        del model, optimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--powersgd-ranks", type=lambda v: [int(r) for r in v.split(",")],
                        help="only the PowerSGD runs, at these ranks (e.g. 1,2,4): notebook 11's exercise 3")
    args = parser.parse_args()
    os.environ.setdefault(runtime.BACKEND_ENV, "gloo")   # CPU ranks, counted the same with GPUs or not
    # and no GPU seen at all: torch's PowerSGD hook calls torch.cuda.synchronize(device) whenever CUDA
    # is available, which fails for a CPU bucket ("Expected a cuda device, but got: cpu", seen on an H200)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    install_counter()
    with runtime.distributed(timeout=max(runtime.timeout_s(), 120)) as ctx:
        torch.set_num_threads(1)
        if args.powersgd_ranks:
            compress(ctx, hooks=(), powersgd_ranks=args.powersgd_ranks)
            return
        for probe in (views, static, compress, compile_probe, hybrid):
            t0 = time.perf_counter()
            probe(ctx)
            ctx.print0(f"{probe.__name__}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
