"""The alpha-beta cost model of all-reduce, and how to fit it to your own machine.

A message of m bytes costs alpha + m * beta: alpha is the fixed latency (start-up,
software, a round trip), beta the seconds per byte (1 / link bandwidth). An
algorithm that needs k rounds, each moving m bytes per link, costs k * (alpha + m * beta).
For an all-reduce of S bytes over N ranks:

    naive (reduce to rank 0, broadcast back)   2(N-1) * (alpha + S * beta)
    ring  (reduce-scatter + all-gather)        2(N-1) * alpha + 2(N-1)/N * S * beta
    tree  (binomial reduce, then broadcast)    2 ceil(log2 N) * (alpha + S * beta)

Ring wins for big tensors (its bandwidth term stops growing with N), tree for small
ones on many ranks (its latency term grows like log N). NCCL picks between them.

nccl-tests definitions: algbw = S / t; busbw = algbw * 2(N-1)/N. busbw undoes the
ring's 2(N-1)/N factor, so it estimates the link speed and compares across N.
"""
from __future__ import annotations

import math

import numpy as np


def naive(nbytes, n, alpha, beta):
    return 2 * (n - 1) * (alpha + np.asarray(nbytes, dtype=float) * beta)


def ring(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * np.asarray(nbytes, dtype=float) * beta


def tree(nbytes, n, alpha, beta):
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    return 2 * levels * (alpha + np.asarray(nbytes, dtype=float) * beta)


MODELS = {"naive": naive, "ring": ring, "tree": tree}


def from_steps(sim, alpha, beta) -> float:
    """Time of a simulated schedule (ddp_lab.ring): each step costs alpha + beta * its
    largest message, because all messages of a step travel at once on separate links."""
    return sum(alpha + beta * max(m.nbytes for m in step) for step in sim.steps if step)


def algbw(nbytes, seconds):
    """Algorithm bandwidth, bytes/s: how fast the *tensor* gets all-reduced."""
    return np.asarray(nbytes, dtype=float) / np.asarray(seconds, dtype=float)


def busbw(nbytes, seconds, n):
    """Bus bandwidth, bytes/s: algbw * 2(n-1)/n, the rate each link actually carried."""
    return algbw(nbytes, seconds) * (2 * (n - 1) / n)


def fit(nbytes, seconds, n, model: str = "ring"):
    """Least-squares alpha, beta (relative errors, so 4 KB counts as much as 16 MB).

    Every model above is linear: t = a * alpha + b(S) * beta, with a, b known.
    Returns (alpha, beta) in seconds and seconds per byte.
    """
    s = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.size < 2:
        raise ValueError("fit needs at least two (size, time) pairs of equal length")
    f = MODELS[model]
    a = f(s, n, 1.0, 0.0)  # coefficient of alpha at each size
    b = f(s, n, 0.0, 1.0)  # coefficient of beta
    design = np.stack([a, b], axis=1) / t[:, None]  # divide by t: minimise relative error
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def fit_one_term(nbytes, seconds, n, term: str, model: str = "ring") -> float:
    """Best alpha-only (term="alpha") or beta-only (term="beta") model, for comparison."""
    s = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    f = MODELS[model]
    x = f(s, n, 1.0, 0.0) if term == "alpha" else f(s, n, 0.0, 1.0)
    x = x / t
    return float((x @ np.ones_like(t)) / (x @ x))


def relative_error(predicted, measured):
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / m


def crossover_bytes(n, alpha, beta, a="tree", b="ring"):
    """Smallest power-of-two size at which algorithm b becomes cheaper than a (None if never)."""
    for k in range(0, 41):
        s = 2 ** k
        if MODELS[b](s, n, alpha, beta) < MODELS[a](s, n, alpha, beta):
            return s
    return None
