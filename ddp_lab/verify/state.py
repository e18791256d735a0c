"""State the script keeps outside the optimizer (an EMA of the weights, a teacher, running averages),
compared across ranks after each of the first optimizer steps.

Records: each step's "state", {name: {"class", "hash", "tensors"}}, written by
ddp_lab/verify/_inject/_ddp_lab_verify_state.py. An object is compared where every rank holds it.
"""
from __future__ import annotations

import ast

from ddp_lab.verify.gates import _RANK, _line, parsed
from ddp_lab.verify.findings import Finding, _kind


def rank_state(records: dict, world: int) -> list:
    steps = {r: {x["step"]: x["state"] for x in recs if "state" in x} for r, recs in _kind(records, "step").items()}
    ranks = sorted(steps)
    if world < 2 or len(ranks) < world:
        return []
    for step in sorted(set.intersection(*(set(s) for s in steps.values()))):
        held = {r: steps[r][step] for r in ranks}
        for name in sorted(set.intersection(*(set(h) for h in held.values()))):
            hashes = {r: held[r][name]["hash"] for r in ranks}
            if len(set(hashes.values())) == 1:
                continue
            r = next(q for q in ranks if hashes[q] != hashes[ranks[0]])
            x = held[r][name]
            at = next((s.get("at") for s in _kind(records, "step")[r] if s["step"] == step), None)
            update = update_under_rank(at.rsplit(":", 1)[0], name) if at and ":" in at else None
            agreed = [t for t in sorted(steps[ranks[0]]) if t < step
                      and len({steps[q].get(t, {}).get(name, {}).get("hash") for q in ranks}) == 1]
            gate = f"{_file(at)}:{update[0]} `{update[1]}`" if update else None
            return [Finding(
                "rank-state", r, step,
                f"`{name}` ({x['class']}) differs from rank {ranks[0]} after step {step}: state kept outside the "
                f"optimizer is updated differently on the ranks, so what it is used for (evaluation, the "
                f"checkpoint) depends on the rank",
                f"{x['tensors']} tensors hashed after each of the first steps"
                + (f"; equal on every rank after step {agreed[-1]}, then not" if agreed else
                   "; different from the first step hashed"),
                ("update it on every rank, as the model is (an EMA update costs no communication); "
                 + (f"not only on the ranks {gate} lets through; " if gate else "")
                 + "only logging and saving belong to one rank"),
                f"{at.rsplit(':', 1)[0]}:{update[2]}" if update else at)]
    return []


def update_under_rank(path: str, name: str):
    """(line of the `if`, its code, line of the statement inside it that names `name`'s variable) for
    the first `if` on the rank whose body names it; None when the script has none."""
    base = name.split(".")[-1] if name.startswith("self.") else name.split(".")[0]
    if (found := parsed(path)) is None:
        return None
    tree, lines = found
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not _RANK.search(ast.unparse(node.test)):
            continue
        for st in node.body:
            if any(isinstance(n, ast.Name) and n.id == base or isinstance(n, ast.Attribute) and n.attr == base
                   for n in ast.walk(st)):
                return node.lineno, _line(lines, node.lineno), st.lineno
    return None


def checked(records: dict) -> list:
    """What was hashed (said in a clean report), or why nothing was."""
    held = {}
    steps = set()
    for recs in _kind(records, "step").values():
        for x in recs:
            if "state" in x:
                steps.add(x["step"])
                held.update({n: v["class"] for n, v in x["state"].items()})
    if not steps:
        return []
    if not held:
        return [f"rank-state: not observed: the script's frames hold no state outside the optimizer "
                f"(no module besides the DDP model, no tensors named ema, shadow or average) after "
                f"{'each of ' if len(steps) > 1 else ''}{len(steps)} step{'s' if len(steps) > 1 else ''}"]
    shown = ", ".join(f"{n} ({c})" for n, c in sorted(held.items())[:4]) + (" ..." if len(held) > 4 else "")
    return [f"rank-state: {len(held)} object{'s' if len(held) > 1 else ''} kept outside the optimizer "
            f"({shown}) hashed on every rank after {'each of ' if len(steps) > 1 else ''}{len(steps)} "
            f"step{'s' if len(steps) > 1 else ''}"]


def _file(at: str) -> str:
    return at.rsplit(":", 1)[0].replace("\\", "/").rsplit("/", 1)[-1]


# -- noise drawn in the training loop, the same on every rank ----------------------------------------

GENERATORS = {"torch": "torch's global generator", "random": "Python's random module",
              "numpy": "numpy's global generator"}


def same_loop_noise(records: dict, world: int) -> list:
    """Between two optimizer steps with no loader pass starting in between (a new DataLoader iterator
    draws its base seed), a global generator moved on every rank from the same state on every rank."""
    steps = {r: {x["step"]: x for x in recs} for r, recs in _kind(records, "step").items()}
    ranks = sorted(steps)
    if world < 2 or len(ranks) < world:
        return []
    started = {p["step"] for recs in _kind(records, "pass").values() for p in recs}
    for k in sorted(set.intersection(*(set(s) for s in steps.values()))):
        if k in started or any("rng_after" not in steps[r][k] or "rng_before" not in steps[r].get(k + 1, {})
                               for r in ranks):
            continue
        after = {r: steps[r][k]["rng_after"] for r in ranks}
        before = {r: steps[r][k + 1]["rng_before"] for r in ranks}
        for name, words in GENERATORS.items():
            if not all(name in after[r] and name in before[r] for r in ranks):
                continue
            if len({after[r][name] for r in ranks}) == 1 and all(after[r][name] != before[r][name] for r in ranks):
                at = steps[ranks[0]][k + 1].get("at")
                draw = random_call(at.rsplit(":", 1)[0], name) if at and ":" in at else None
                return [Finding(
                    "same-noise", None, k + 1,
                    f"every rank drew the same noise: {words} is in the same state on every rank (one seed) and "
                    f"the training loop draws from it between steps {k} and {k + 1}, so every rank gets the same "
                    f"random numbers (augmentation, noise, masks)",
                    f"after step {k} the generator's state hashes to {after[ranks[0]][name]} on all {world} ranks; "
                    f"before step {k + 1} it had moved on every rank",
                    "seed with seed + rank: after the model is built and wrapped (DDP copies rank 0's parameters, so "
                    "the replicas still start equal), seed each rank's generators with seed + rank "
                    "(torch.manual_seed, random.seed, np.random.seed), or draw from a torch.Generator of its own "
                    "seeded so",
                    f"{at.rsplit(':', 1)[0]}:{draw}" if draw else at)]
    return []


_DRAWS = {"torch": ("torch.rand", "torch.randn", "torch.randint", "torch.randperm", "torch.bernoulli",
                    "torch.normal", "torch.multinomial", "torch.poisson", ".uniform_", ".normal_",
                    ".bernoulli_", ".random_", ".exponential_", "dropout"),
          "random": ("random.",), "numpy": ("np.random.", "numpy.random.")}


def random_call(path: str, generator: str):
    """The line of the first call inside a loop of the script that draws from `generator`; None if none."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    found = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))):
        for n in ast.walk(loop):
            if isinstance(n, ast.Call):
                if _draws(ast.unparse(n.func), generator):
                    found.append(n.lineno)
    return min(found) if found else None


def _draws(name: str, generator: str) -> bool:
    if "seed" in name or "state" in name:
        return False
    return any(name.endswith(d) if d.startswith(".") else name.startswith(d) if "." in d else d in name.lower()
               for d in _DRAWS[generator])


def noise_checked(records: dict) -> list:
    """Each same-noise check, as observed in this run: whether the watched code drew random numbers on
    every rank (their generators' states then compared across ranks), or that it drew none."""
    from ddp_lab.verify.findings import _training_loaders
    out = []
    training = _training_loaders(records)
    draws = [x for recs in _kind(records, "draw").values() for x in recs if x["loader"] in training]
    if draws:
        batches = {(x["loader"], x["pass"], x["batch"]) for x in draws}
        moved = {(x["loader"], x["pass"], x["batch"]) for x in draws
                 if any(x[g][0] != x[g][1] for g in ("torch", "random"))}
        out.append(f"same-noise: observed, {len(moved)} of {len(batches)} training batches (augmentation) drew "
                   f"random numbers while loading, their generators' states compared across ranks" if moved else
                   f"same-noise: not observed: loading {_plural(len(batches), 'training batch', 'es')} "
                   f"(augmentation; the first 2 of each pass) drew nothing from torch's or Python's global generator")
    forwards = [x for recs in _kind(records, "forward").values() for x in recs]
    if forwards:
        n = len({(x["ddp"], x["forward"]) for x in forwards})
        moved = {(x["ddp"], x["forward"]) for x in forwards if x["torch"][0] != x["torch"][1]}
        out.append(f"same-noise: observed, {len(moved)} of {_plural(n, 'training forward')} of the DDP model "
                   f"(dropout) drew random numbers, their generator's states compared across ranks" if moved else
                   f"same-noise: not observed: {_plural(n, 'training forward')} of the DDP model (dropout) drew "
                   f"nothing from torch's global generator")
    steps = {r: {x["step"]: x for x in recs} for r, recs in _kind(records, "step").items()}
    started = {p["step"] for recs in _kind(records, "pass").values() for p in recs}
    gaps, moved = 0, 0
    for k in sorted(set.intersection(*(set(s) for s in steps.values()))) if steps else []:
        pairs = [(s[k].get("rng_after"), s.get(k + 1, {}).get("rng_before")) for s in steps.values()]
        if k in started or not all(a and b for a, b in pairs):
            continue
        gaps += 1
        moved += any(a.get(g) != b.get(g) for a, b in pairs for g in a)
    if gaps:
        out.append(f"same-noise: observed, the training loop (between steps) drew from the global generators in "
                   f"{moved} of {_plural(gaps, 'interval')} without a new loader pass, their states compared across "
                   f"ranks" if moved else
                   f"same-noise: not observed: the training loop (between steps) drew nothing from torch's, "
                   f"Python's or numpy's global generator in {_plural(gaps, 'interval')} without a new loader pass")
    return out


def _plural(n: int, one: str, many: str = "s") -> str:
    return f"{n} {one}{'' if n == 1 else many}"
