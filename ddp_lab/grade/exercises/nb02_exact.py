"""02.5: an exact shuffling sampler, every sample once per epoch, no padding; graded in the kernel.

The answer is called for every rank of several worlds and epochs, as each rank would call it.
The reference is the sampler's contract checked directly (the shards of an epoch are a partition
of the dataset, of sizes that differ by at most one; the order changes with the epoch and agrees
across ranks) and, without shuffling, the lesson's sampling.exact_shard.
"""
from ddp_lab.grade.core import Exercise, register
from ddp_lab.lessons import plural

CASES = [(11, 2), (297, 4), (10, 3), (64, 8)]  # (samples, ranks)
SEED = 7


def on_rank(answer, rank, world):
    out = []
    for n, w in CASES:
        for shuffle in (False, True):
            epochs = [[[int(i) for i in answer(n, r, w, shuffle, SEED, e)] for r in range(w)]
                      for e in (0, 1)]
            out.append({"n": n, "w": w, "shuffle": shuffle, "epochs": epochs})
    return {"cases": out}


def _finding(c):
    from ddp_lab.lessons import sampling
    n, w, shuffle, (first, second) = c["n"], c["w"], c["shuffle"], c["epochs"]
    flat = [i for shard in first for i in shard]
    twice, missing = len(flat) - len(set(flat)), sorted(set(range(n)) - set(flat))
    if twice and len(flat) == -(-n // w) * w and not missing:
        return (f"{plural(twice, 'sample')} read twice: that is DistributedSampler's padding; an exact sampler "
                f"gives shards that differ by one instead")
    if twice or (missing and shuffle and len(flat) >= n):
        return (f"{plural(twice, 'sample')} read twice and {len(missing)} never: every rank must draw the same "
                f"permutation (seed with seed + epoch, never the rank) and take its own share of it")
    if missing:
        return f"{plural(len(missing), 'sample')} never read (e.g. {missing[:3]}): an exact sampler drops nothing"
    if max(map(len, first)) - min(map(len, first)) > 1:
        return f"shard sizes {[len(s) for s in first]}: balance them, sizes that differ by at most one"
    if not shuffle and first != [sampling.exact_shard(n, r, w) for r in range(w)]:
        return "without shuffling, rank r reads r, r + W, r + 2W, ... (DistributedSampler's order, unpadded)"
    if shuffle and first == second:
        return "the same order in epoch 0 and epoch 1: mix the epoch into the seed, as set_epoch does"
    if shuffle and first == [sampling.exact_shard(n, r, w) for r in range(w)]:
        return "shuffle=True returned the unshuffled order"
    return None


def judge(per_rank):
    problems = []
    for c in per_rank[0]["cases"]:
        why = _finding(c)
        if why:
            problems.append(f"{c['n']} samples on {c['w']} ranks, shuffle={c['shuffle']}: {why}")
    return problems[:2]


register(Exercise(
    id="02.5", notebook="02_sampler_and_metrics", title="An exact sampler",
    skills="every sample exactly once per epoch; shards that differ by one; one permutation shared by "
           "the ranks (seed + epoch)",
    answer="exact_indices(n, rank, world_size, shuffle, seed, epoch) -> this rank's indices",
    nproc=0, on_rank=on_rank, judge=judge))
