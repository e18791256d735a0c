"""03.6: a right byte count and the wrong ones, each with the hint it must get."""
import torch


def good(numel, n):
    sizes = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    # rank r sends every chunk but (r+1) in reduce-scatter and every chunk but (r+2) in all-gather
    return [4 * (2 * numel - sizes[(r + 1) % n] - sizes[(r + 2) % n]) for r in range(n)]


def formula(numel, n):
    return [2 * (n - 1) / n * numel * 4] * n


def unchunked(numel, n):
    return [(n - 1) * numel * 4] * n


def one_number(numel, n):
    return [2 * (n - 1) * numel * 4 // n]


def in_float32(numel, n):  # the same count in float32 tensors
    sizes = torch.tensor([numel // n + (1 if i < numel % n else 0) for i in range(n)], dtype=torch.float32)
    return [4 * (2 * numel - sizes[(r + 1) % n] - sizes[(r + 2) % n]) for r in range(n)]


def in_float64(numel, n):
    return [float(b) for b in good(numel, n)]


PRECISIONS = {"float32": in_float32, "float64": in_float64}


MISTAKES = {
    "2(N-1)/N·S for every rank": (formula, "N does not divide the tensor here"),
    "unchunked ring": (unchunked, "(N-1)·S is the unchunked ring"),
    "one number": (one_number, "return one number per rank"),
}
