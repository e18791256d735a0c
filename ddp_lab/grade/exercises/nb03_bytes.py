"""03.6: the bytes each rank of a chunked ring sends, exactly; graded in the kernel.

The reference is the ring simulated message by message (ddp_lab.lessons.ring.simulate), not a formula.
"""
from ddp_lab.grade.core import FEW_OPS, Exercise, as_given, close, register, shown
from ddp_lab.lessons import plural

CASES = [(8, 4), (10, 6), (1003, 3), (7, 2), (12, 5)]  # (float32 elements, ranks)


def on_rank(answer, rank, world):
    return {"cases": [[numel, n, [as_given(b) for b in answer(numel, n)]] for numel, n in CASES]}


def judge(per_rank):
    import numpy as np
    from ddp_lab.lessons import ring
    problems = []
    for numel, n, got in per_rank[0]["cases"]:
        sim = ring.simulate([np.zeros(numel, dtype=np.float32)] * n, "ring").bytes_sent
        S = numel * 4
        if len(got) == n and close(got, sim, FEW_OPS):  # a count of bytes: float32 holds it exactly
            continue
        if len(got) != n:
            why = f"{plural(len(got), 'value')} for {n} ranks: return one number per rank"
        elif close(got, [2 * (n - 1) / n * S] * n, FEW_OPS):
            why = ("2(N-1)/N·S for every rank, but N does not divide the tensor here: chunks differ by one "
                   "element (ring.chunk_bounds), and each rank skips sending two particular chunks")
        elif close(got, [(n - 1) * S] * n, FEW_OPS):
            why = "(N-1)·S is the unchunked ring; the chunked ring sends one chunk of about S/N per step"
        else:
            why = "count the chunks each rank sends in the 2(N-1) steps, with their real sizes"
        problems.append(f"{numel} elements on {n} ranks: you said {shown(got)} bytes, the "
                        f"simulated ring sends {[int(b) for b in sim]}: {why}")
    return problems[:2]  # the first two cases that differ are evidence enough


register(Exercise(
    id="03.6", notebook="03_ring_allreduce", title="Bytes per rank, exactly",
    skills="the ring's schedule: which chunk each rank sends when; uneven chunks; 2(N-1)/N·S as the limit",
    answer="ring_bytes(numel, n) -> list of the bytes each rank sends (float32), per rank",
    nproc=0, on_rank=on_rank, judge=judge))
