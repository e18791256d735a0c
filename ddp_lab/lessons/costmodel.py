"""The alpha-beta cost model of all-reduce, and how to fit it to your own machine.

A message of m bytes costs alpha + m * beta: alpha is the fixed latency (start-up,
software, a round trip), beta the seconds per byte (1 / link bandwidth). An
algorithm that needs k rounds, each moving m bytes per link, costs k * (alpha + m * beta).
For an all-reduce of S bytes over N ranks:

    naive (reduce to rank 0, broadcast back)   2(N-1) * (alpha + S * beta)
    ring  (reduce-scatter + all-gather)        2(N-1) * alpha + 2(N-1)/N * S * beta
    tree  (binomial reduce, then broadcast)    2 ceil(log2 N) * (alpha + S * beta)
    tree, pipelined in k chunks                2 (ceil(log2 N) + k - 1) * (alpha + S/k * beta)

The plain tree sends the whole tensor at every level, one level after the other, so
its bandwidth term grows like log N: against it the ring wins every big tensor.
NCCL's trees are pipelined: the tensor is cut into chunks, and while one chunk
climbs a level the next one follows, so every level works at once and the bandwidth
term stays near 2 * S * beta (one chunk per link per step; NCCL's double binary tree
arranges its two trees so that holds), with a latency term that grows like log N,
not N. tree_pipelined() picks the best k. Ring wins for big tensors on few ranks;
on many ranks the pipelined tree wins all but enormous ones. NCCL picks per call.

nccl-tests definitions: algbw = S / t; busbw = algbw * 2(N-1)/N. busbw undoes the
ring's 2(N-1)/N factor, so it estimates the link speed and compares across N.
"""
from __future__ import annotations

import math
import os

import numpy as np


def naive(nbytes, n, alpha, beta):
    return 2 * (n - 1) * (alpha + np.asarray(nbytes, dtype=float) * beta)


def ring(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * np.asarray(nbytes, dtype=float) * beta


def tree(nbytes, n, alpha, beta):
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    return 2 * levels * (alpha + np.asarray(nbytes, dtype=float) * beta)


def tree_pipelined(nbytes, n, alpha, beta, chunks=None):
    """Tree reduce then broadcast, each pass pipelined in `chunks` pieces: (L + k - 1) steps of
    alpha + (S/k) beta per pass, L = ceil(log2 n). chunks=None picks the k that minimises it
    (k* = sqrt((L - 1) S beta / alpha)); chunks=1 is the plain tree."""
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    s = np.asarray(nbytes, dtype=float)
    if levels == 0:
        return np.zeros_like(s)
    if chunks is None:
        if alpha <= 0:
            return 2 * s * beta + 0 * s  # infinitely many chunks cost nothing: bandwidth alone
        k = np.maximum(1.0, np.round(np.sqrt((levels - 1) * s * beta / alpha)))
    else:
        k = np.asarray(chunks, dtype=float)
    return 2 * (levels + k - 1) * (alpha + s / k * beta)


MODELS = {"naive": naive, "ring": ring, "tree": tree}                # linear in alpha, beta: fit() can use them
PREDICTORS = {**MODELS, "tree (pipelined)": tree_pipelined}


def from_steps(sim, alpha, beta) -> float:
    """Time of a simulated schedule (ddp_lab.lessons.ring): each step costs alpha + beta * its
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
    """Smallest power-of-two size, up to 1 TiB, at which algorithm b (a PREDICTORS name)
    becomes cheaper than a (None if it never does)."""
    for k in range(0, 41):
        s = 2 ** k
        if PREDICTORS[b](s, n, alpha, beta) < PREDICTORS[a](s, n, alpha, beta):
            return s
    return None


# --- the fitted alpha and beta, handed from notebook 03 to notebook 09 ----------------------------

# Paths relative to notebooks/, where both notebooks run. The tracked record is the fit of the
# workbook's stored run (python -m ddp_lab.engine.workbook --store, with STORE_ENV set); a learner's
# run writes its own fit under runs/, which git ignores, so running notebook 03 leaves the checkout
# clean. Notebook 09 reads the learner's fit where there is one, else the stored one.
STORED = "records/03_alpha_beta.json"
LEARNER = "../runs/03_alpha_beta.json"
STORE_ENV = "DDP_LAB_STORE_RECORDS"
RECORD = STORED if os.environ.get(STORE_ENV) == "1" else LEARNER


def _in_notebooks(path) -> str:
    """A relative path taken from notebooks/, also when the kernel runs in a folder below it (the
    Chinese edition's notebooks/zh/, notebooks/zh/solutions/)."""
    from pathlib import Path
    if os.path.isabs(path):
        return str(path)
    here = Path.cwd()
    for base in (here, *list(here.parents)[:2]):
        if base.name == "notebooks":
            return str(base / path)
    return str(path)


def save_fit(path, alpha: float, beta: float, n: int, sizes, backend: str) -> dict:
    """Write a fit of the ring model with what it was measured on, for other notebooks to read."""
    import datetime
    import json
    import os
    import platform

    import torch
    path = _in_notebooks(path)
    record = {"alpha_s": alpha, "beta_s_per_byte": beta, "ranks": n, "backend": backend,
              "sizes_bytes": [int(s) for s in sizes],
              "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
              "processor": platform.processor() or platform.machine()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)  # a notebook reading it meanwhile sees the old fit or the new, never half of one
    return record


def load_fit(path) -> dict | None:
    """The record save_fit() wrote, or None if there is none (run notebook 03 to make it). A
    learner's record that is not there yet falls back to the stored one."""
    import json
    for candidate in (path, STORED) if path == LEARNER else (path,):
        candidate = _in_notebooks(candidate)
        try:
            with open(candidate) as f:
                record = json.load(f)
            path = candidate
            break
        except FileNotFoundError:
            continue
    else:
        return None
    missing = {"alpha_s", "beta_s_per_byte"} - set(record)
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)}: re-run notebook 03 to write it again")
    return record
