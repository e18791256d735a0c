"""03.5: a ring all-reduce that averages, written with isend/recv, on 3 real ranks.

Three ranks, not two: with two, the left and the right neighbour are the same rank and a
ring that sends the wrong way cannot be told from a right one.
"""
from ddp_lab.grade.core import FEW_OPS, Exercise, close, register, within

NUMEL = 1003  # no N divides it: uneven chunks
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all")


def _spy(dist):
    """Count the bytes the answer sends point to point and note any collective it calls."""
    seen = {"sent": 0, "elements": 0, "collectives": []}
    saved = {name: getattr(dist, name) for name in ("isend", "send", *COLLECTIVES)}

    def sender(real):
        def wrapped(tensor, *args, **kwargs):
            seen["sent"] += tensor.numel() * tensor.element_size()
            seen["elements"] += tensor.numel()  # a ring in float32 sends half the bytes of float64
            return real(tensor, *args, **kwargs)
        return wrapped

    def collective(name, real):
        def wrapped(*args, **kwargs):
            seen["collectives"].append(name)
            return real(*args, **kwargs)
        return wrapped

    for name, real in saved.items():
        setattr(dist, name, sender(real) if name in ("isend", "send") else collective(name, real))
    return seen, lambda: [setattr(dist, n, f) for n, f in saved.items()]


def on_rank(answer, rank, world):
    import torch
    import torch.distributed as dist
    g = torch.Generator().manual_seed(300 + rank)
    mine = torch.randint(-50, 50, (NUMEL,), generator=g).double()  # integers: any order sums exactly
    x = mine.clone()
    seen, restore = _spy(dist)
    try:
        out = answer(x)
    finally:
        restore()
    out = x if out is None else out
    reference = mine.clone()
    dist.all_reduce(reference)
    reference /= world
    return {"out": out.tolist(), "input": mine.tolist(), "reference": reference.tolist(),
            "world": world, "itemsize": mine.element_size(), **seen}


def judge(per_rank):
    import numpy as np
    from ddp_lab.lessons import ring
    problems = []
    for r, o in sorted(per_rank.items()):
        out, ref, mine, n = np.array(o["out"]), np.array(o["reference"]), np.array(o["input"]), o["world"]
        if o["collectives"]:
            problems.append(f"rank {r} called dist.{o['collectives'][0]}: build the average from "
                            f"dist.isend/dist.recv between neighbours only")
            continue
        if out.shape != ref.shape:
            problems.append(f"rank {r} returned {out.size} elements, the input had {ref.size}")
        elif close(out, ref, FEW_OPS):  # a sum of N integers over N: float32 rounds it to 6e-8
            # in the dtype the answer sent (float64 like the input, or float32): compare elements
            itemsize = o["sent"] // o["elements"] if o["elements"] else o["itemsize"]
            expected = ring.simulate([np.zeros(ref.size)] * n, "ring").bytes_sent[r] // 8 * itemsize
            if o["sent"] != expected:
                problems.append(
                    f"rank {r} sent {o['sent']} bytes; a ring sends one chunk per step, "
                    f"{expected} bytes here (about 2(N-1)/N·S with S = {ref.size * itemsize}): did it pass "
                    f"whole tensors instead of chunks, or use a call other than dist.isend/dist.send?")
        elif close(out, ref * n, FEW_OPS):
            problems.append(f"rank {r}'s result is {n}x the reference (the sum, not the mean): "
                            f"did you divide by the world size?")
        elif close(out, mine, FEW_OPS) or close(out, mine / n, FEW_OPS):
            problems.append(f"rank {r}'s result is its own input: nothing it received was added")
        else:
            bad = [c for c, (lo, hi) in enumerate(ring.chunk_bounds(ref.size, n))
                   if not close(out[lo:hi], ref[lo:hi], FEW_OPS, scale=np.abs(ref).max())]
            problems.append(
                f"rank {r} differs from the mean in chunk{'s' * (len(bad) != 1)} {bad} of {n} (max difference "
                f"{np.abs(out - ref).max():.3g} {within(FEW_OPS)}). In reduce-scatter step s, rank r sends "
                f"chunk (r-s) % N to its right neighbour (r+1) % N and adds chunk (r-s-1) % N received from its left "
                f"neighbour (r-1) % N; all-gather then copies instead of adding")
    return problems


def on_error(error):
    if "size" in error.lower():
        return ("a rank received a message of another size than the chunk it expected: in each step a "
                "rank must receive exactly the chunk its left neighbour (rank - 1) % world sends to it")
    if "recv" in error.lower() or "timed out" in error.lower() or "timeout" in error.lower():
        return ("a rank waited for a message that never came: every rank must send to its right "
                "neighbour (rank + 1) % world and receive from its left one (rank - 1) % world; "
                "sending to and receiving from the same side deadlocks the ring")
    return None


register(Exercise(
    id="03.5", notebook="03_ring_allreduce", title="Ring all-reduce that averages",
    skills="reduce-scatter + all-gather from isend/recv; neighbours; dividing by the world size; "
           "bytes per rank 2(N-1)/N·S",
    answer="ring_allreduce_mean(tensor) -> tensor: every rank returns the mean of all ranks' tensors",
    nproc=3, on_rank=on_rank, judge=judge, on_error=on_error))
