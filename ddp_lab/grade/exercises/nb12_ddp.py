"""12.1: your own DDP, graded on 2 real ranks against torch's DistributedDataParallel.

The answer is a class, MyDDP(module, bucket_cap_bytes), with forward, finish() (wait for every
bucket's all-reduce and put the averaged gradients into .grad) and no_sync(). The grader trains
lessons.build.Net with it and, beside it, a copy under torch's DDP on the same data: two plain
steps, then one step of two micro-batches, the first inside no_sync(). Rank 1's model starts
from other weights, so a wrapper that does not broadcast rank 0's is seen at once.

What it watches (grade/exercises/_watch.py): every collective the answer calls, in which phase
(construction, backward, finish), and each handle's wait(). All-reduces issued with
async_op=True run only when waited for, so unpacking a bucket before its wait reads it
un-reduced, every time.

Tolerance: the gradients are compared within 1e-5 of their largest element. Bitwise equality is
possible for 2 ranks (a + b is exact in either order, and halving is exact), not in general: with
3 or more ranks a ring adds in another order than a tree, and torch divides before the sum
(gradient / N on each rank) where an answer may divide after it.
"""
from ddp_lab.grade.core import MANY_OPS, Exercise, register, within
from ddp_lab.grade.exercises._watch import Watch, refusal, torch_own_inside

STEPS, LR, BATCH = 2, 0.1, 8
CAP = 300  # bytes: 4 buckets, not the 3 of plan_buckets' default (4096): a class that ignores bucket_cap_bytes is seen


def _data(rank, step, micro=0):
    import torch
    g = torch.Generator().manual_seed(1200 + 100 * step + 10 * micro + rank)
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _models(rank):
    import copy
    import torch
    from ddp_lab.lessons.build import Net
    torch.manual_seed(12)
    model = Net()
    if rank:  # rank 1 starts elsewhere: only a broadcast from rank 0 makes the ranks agree
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    return model, copy.deepcopy(model)


def _grads(model):
    import torch
    return torch.cat([p.grad.detach().flatten().double() for p in model.parameters()])


def _compare(got, ddp, local, world) -> dict:
    scale = float(ddp.abs().max())
    return {"err": float((got - ddp).abs().max()), "scale": scale, "finite": bool(got.isfinite().all()),
            "ratio": float((got * ddp).sum() / (ddp * ddp).sum()),
            # this rank's own gradient, whole or already divided: what a bucket holds before its wait()
            "local_err": min(float((got - local / c).abs().max()) for c in (1, world))}


def _step_events(watch, params: int):
    """Per all_reduce call: [numel, phase, issued while at least two gradients were still to come,
    async_op]. (The grader's own hook on a parameter runs after the answer's, so the answer's hook on
    the last parameter has seen params - 1 of the grader's marks.)"""
    out, ready = [], 0
    for e in watch.events:
        if e[0] == "grad":
            ready += 1
        elif e[0] == "call" and e[1] == "all_reduce":
            out.append([e[2], e[3], ready < params - 1, e[4]])
    waits_in_backward = sum(1 for e in watch.events if e[0] == "wait" and e[2] == "backward")
    waited = sorted(e[1] for e in watch.events if e[0] == "wait")
    return {"calls": out, "waits_in_backward": waits_in_backward, "waits": len(waited),
            "unwaited": sum(1 for c in range(len(out)) if c not in waited),
            "other": sorted({e[1] for e in watch.events if e[0] == "call" and e[1] != "all_reduce"})}


def on_rank(answer, rank, world):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_lab.lessons.build import bucket_sizes
    mine, twin = _models(rank)
    plain = _models(0)[0]  # rank 0's start, no DDP: this rank's own, un-averaged gradient
    watch = Watch(defer=True)
    with watch.watching():
        ours = answer(mine, CAP)
    own = torch_own_inside(ours)
    if own:
        return {"refused": own}
    setup_calls = [e[1] for e in watch.calls(phase="setup")]
    every = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(every, torch.cat([p.detach().flatten() for p in mine.parameters()]).sum().reshape(1))
    synced = len({round(float(t), 4) for t in every}) == 1
    ref = DDP(twin)
    names = [n for n, _ in mine.named_parameters()]
    for name, p in mine.named_parameters():  # after the answer's own hooks: runs once this gradient is ready
        p.register_post_accumulate_grad_hook(lambda p, name=name: watch.mark("grad", name))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=LR) for m in (mine, twin))
    steps = []
    for step in range(STEPS + 1):
        micro = [_data(rank, step, 0), _data(rank, step, 1)] if step == STEPS else [_data(rank, step)]
        for m in (mine, twin, plain):
            m.zero_grad(set_to_none=True)
        for m, (x, y) in enumerate(micro):
            quiet = len(micro) > 1 and m == 0
            with (ref.no_sync() if quiet else _nothing()):
                F.cross_entropy(ref(x), y).backward()
            F.cross_entropy(plain(x), y).backward()
        record = {"no_sync": len(micro) > 1, "micro": []}
        for m, (x, y) in enumerate(micro):
            quiet = len(micro) > 1 and m == 0
            watch.events = []
            with watch.watching(), (ours.no_sync() if quiet else _nothing()):
                watch.phase = "forward"
                loss = F.cross_entropy(ours(x), y)
                watch.phase = "backward"
                loss.backward()
                watch.phase = "after"
                watch.mark("backward returned")
                if not quiet:
                    watch.phase = "finish"
                    ours.finish()
            record["micro"].append(_step_events(watch, len(names)))
        record.update(_compare(_grads(mine), _grads(twin), _grads(plain), world))
        steps.append(record)
        opt.step()
        ref_opt.step()
        plain.load_state_dict(twin.state_dict())  # the next local gradient is taken where DDP stands
    sizes = bucket_sizes(mine.parameters(), CAP)
    forward_sizes = bucket_sizes(list(mine.parameters())[::-1], CAP)
    del ref
    return {"synced": synced, "setup_calls": setup_calls, "steps": steps, "buckets": sizes,
            "forward_buckets": forward_sizes, "params": len(names), "world": world, "cap": CAP}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def judge(per_rank):
    o0 = per_rank[0]
    if refusal(per_rank):
        return refusal(per_rank)
    problems = []
    if not all(o["synced"] for o in per_rank.values()):
        return [f"the ranks' weights differ after your constructor ({', '.join(o0['setup_calls']) or 'no collective'} "
                f"called): broadcast every parameter from rank 0 in __init__ (dist.broadcast(p.data, src=0)), "
                f"as DDP does, or the ranks train different models"]
    want = sorted(o0["buckets"])
    for rank, o in sorted(per_rank.items()):
        for s, step in enumerate(o["steps"]):
            where = f"step {s + 1}" + (" (two micro-batches, the first in no_sync)" if step["no_sync"] else "")
            found = _calls(step, want, o, where, rank)
            if found:
                problems.extend(found)
                break
            if not step["finite"]:
                problems.append(f"rank {rank}'s gradients at {where} hold NaN or inf, where DDP's are finite")
                break
            if not step["err"] <= MANY_OPS * step["scale"]:
                if abs(step["ratio"] - o["world"]) < 0.05:
                    problems.append(f"rank {rank}'s gradients at {where} are {o['world']}x DDP's: all_reduce sums; "
                                    f"divide each bucket by the world size")
                elif abs(step["ratio"] - 1 / o["world"]) < 0.05:
                    problems.append(f"rank {rank}'s gradients at {where} are 1/{o['world']} of DDP's: divided by the "
                                    f"world size twice (once is enough, before or after the sum)")
                elif last_unwaited(step):
                    problems.append(f"rank {rank} never called wait() on {last_unwaited(step)} of its all-reduce "
                                    f"handles at {where}: without it the sum may not be there yet")
                elif step["local_err"] <= MANY_OPS * step["scale"]:
                    problems.append(f"rank {rank}'s .grad at {where} is this rank's own gradient, not the average: "
                                    f"copy each bucket back into the .grad's after its wait() returns (a copy taken "
                                    f"before wait() holds the un-reduced values)")
                else:
                    problems.append(f"rank {rank}'s gradients at {where} differ from DDP's by up to "
                                    f"{step['err']:.3g} {within(MANY_OPS, of='the largest gradient')}")
                break
    return problems


def last_unwaited(step) -> int:
    return step["micro"][-1]["unwaited"]


def _calls(step, want, o, where, rank) -> list:
    first, last = step["micro"][0], step["micro"][-1]
    if step["no_sync"] and first["calls"]:
        return [f"rank {rank} called all_reduce {len(first['calls'])} times inside no_sync(): no_sync() must "
                f"switch the hooks off, so the gradients just accumulate"]
    calls = last["calls"]
    if last["other"]:
        return [f"rank {rank} called {', '.join(last['other'])} during a step: DDP needs only all_reduce"]
    if not calls:
        again = " (it did at step 1: reset each bucket's count of ready gradients after every step, in finish())" \
            if where.startswith("step 2") else ""
        return [f"rank {rank} made no dist.all_reduce call at {where}{again}: each full bucket is all-reduced "
                f"(dist.all_reduce(buffer, async_op=True)) from the hook that completes it"]
    if len(calls) == o["params"] and len(want) != o["params"]:
        return [f"rank {rank} made one all-reduce per parameter ({len(calls)}), not one per bucket "
                f"({len(want)}): pack each bucket's gradients into one flat buffer (plan_buckets)"]
    sizes = sorted(c[0] for c in calls)
    if any(not c[3] for c in calls):
        where_ = "backward until the sum arrives" if any(not c[3] and c[1] == "backward" for c in calls) else \
            "until the sum arrives, after backward"
        return [f"rank {rank} called all_reduce without async_op=True: it blocks {where_}, so nothing "
                f"overlaps; issue it with async_op=True from the hook and wait for the handle in finish()"]
    if last["waits_in_backward"]:
        return [f"rank {rank} waited for an all-reduce inside backward (in a hook): that stalls backward "
                f"until the bucket's sum arrives; wait for every handle in finish(), after backward"]
    if last["waits"] > len(calls):
        return [f"rank {rank} waited {last['waits']} times for {len(calls)} all-reduces at {where}: handles of "
                f"an earlier step are still kept; clear them in finish() once waited for"]
    if sizes == sorted(o["forward_buckets"]) and sizes != want:
        return [f"rank {rank}'s buckets hold {sizes} elements, the forward order's; backward makes the "
                f"last layer's gradients first, so fill buckets in reverse (DDP's buckets: {want})"]
    if sizes != want:
        return [f"rank {rank} all-reduced buffers of {sizes} elements; the bucket rule (plan_buckets, "
                f"reverse order, closed at the bucket_cap_bytes your class is given, {o['cap']}) gives {want}"]
    if all(c[1] != "backward" for c in calls):
        return [f"rank {rank} issued every all-reduce after backward returned: nothing overlaps; issue "
                f"each bucket's all_reduce from the hook that completes it"]
    if not any(c[2] for c in calls):
        return [f"rank {rank} issued its first all-reduce only once every gradient was ready: a full "
                f"bucket must go as soon as its last gradient arrives, while backward goes on"]
    return []


register(Exercise(
    id="12.1", notebook="12_build_it", title="Your own DDP",
    skills="broadcast the start; post-accumulate-grad hooks; buckets in reverse order; one async "
           "all_reduce per bucket issued during backward; wait and unpack before the step; no_sync",
    answer="MyDDP(module, bucket_cap_bytes): forward, finish(), no_sync()",
    nproc=2, on_rank=on_rank, judge=judge))
