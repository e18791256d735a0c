"""07.1: which state-dict entries differ, by exact bytes; graded in the kernel.

The lesson's definition: a name differs when troubleshooting.tensor_hash differs, and that hash
reads the dtype, the shape and the exact bytes of the values in logical order. The grader builds
pairs of state dicts of a small BatchNorm model, each with changes it knows: one element moved by
one ulp (torch.nextafter, which torch.allclose calls equal), buffers changed, the same values in
another dtype or shape, and equal values in other memory layouts (a transposed copy, a strided
view), which the hash calls equal. The reference is the list of names each pair was built with.
"""
from ddp_lab.grade.core import Exercise, error_text, register

# pair -> {name changed: how}; "layout" pairs hold equal values in other memory layouts
PAIRS = {
    "identical": {},
    "one ulp": {"2.weight": "ulp"},
    "buffers": {"1.running_mean": "buffer", "1.num_batches_tracked": "buffer"},
    "dtype": {"0.bias": "dtype"},
    "shape": {"2.bias": "shape"},
    "layout": {},
    "several": {"0.weight": "ulp", "1.running_var": "buffer", "2.bias": "dtype"},
}
LAYOUT = ["0.weight", "1.weight"]  # equal values, other strides, in the "layout" pair

WHY = {
    "ulp": "{names} moved by one ulp (torch.nextafter) and not returned: a tolerance (torch.allclose, "
           "isclose, a max-difference threshold) calls them equal; compare exact bytes with "
           "troubleshooting.tensor_hash",
    "buffer": "{names} (BatchNorm buffers) changed and not returned: compare every entry of the state dict, "
              "buffers included",
    "dtype": "{names}: the same values as float64 instead of float32, not returned: torch.equal and "
             "allclose compare values only; tensor_hash hashes the dtype too",
    "shape": "{names}: the same numbers reshaped to (2, 2), not returned: tensor_hash hashes the shape too",
}


def _state_dicts():
    """{pair: (a, b)}, built from a seeded model without touching the kernel's random state."""
    import torch
    from torch import nn
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        model(torch.randn(32, 8))  # running statistics and num_batches_tracked become non-trivial
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pairs = {}
    for pair, changes in PAIRS.items():
        b = {k: v.clone() for k, v in base.items()}
        for name, how in changes.items():
            if how == "ulp":
                b[name][1, 3] = torch.nextafter(b[name][1, 3], torch.tensor(float("inf")))
            elif how == "buffer":
                b[name] += 1 if name.endswith("num_batches_tracked") else 0.25
            elif how == "dtype":
                b[name] = b[name].double()
            elif how == "shape":
                b[name] = b[name].reshape(2, 2)
        if pair == "layout":
            b["0.weight"] = base["0.weight"].t().contiguous().t()                     # column-major copy
            b["1.weight"] = torch.stack([base["1.weight"], torch.zeros(16)], 1)[:, 0]  # stride-2 view
        pairs[pair] = ({k: v.clone() for k, v in base.items()}, b)
    return pairs


def on_rank(answer, rank, world):
    obs = {}
    for pair, (a, b) in _state_dicts().items():
        try:
            obs[pair] = {"got": [str(n) for n in answer(a, b)]}
        except Exception as exc:
            obs[pair] = {"error": error_text(exc)}
    return obs


def judge(per_rank):
    obs = per_rank[0]
    raised: dict = {}
    for p, o in obs.items():
        if "error" in o:
            raised.setdefault(o["error"], []).append(f"'{p}'")
    errors = [f"your function raised {e} (on the {', '.join(ps)} pair{'s' * (len(ps) > 1)})"
              for e, ps in raised.items()]
    got = {p: o["got"] for p, o in obs.items() if "error" not in o}
    if not errors and all(set(g) == set(PAIRS[p]) for p, g in got.items()):
        twice = sorted({n for g in got.values() for n in g if g.count(n) > 1})
        return [f"you returned {', '.join(twice)} more than once: return each name once"] if twice else []
    if got and all(sorted(g) == sorted(n for n, how in PAIRS[p].items() if how == "shape") for p, g in got.items()):
        return errors + ["your answer compares only the shapes: equal shapes can hold other values or dtypes "
                         "(2.weight one ulp apart, 0.bias as float64); compare dtype, shape and exact bytes "
                         "with troubleshooting.tensor_hash"]
    if got and all(len(g) <= 1 and set(g) <= set(PAIRS[p]) for p, g in got.items()) and \
            any(len(PAIRS[p]) > len(g) == 1 for p, g in got.items()):
        several = sorted(PAIRS["several"])
        return errors + [f"you returned only the first name that differs (the 'several' pair differs in "
                         f"{', '.join(several)}, you said {got.get('several')}): return every one"]
    missing: dict = {}
    problems = []  # what was returned but does not differ
    for p, g in got.items():
        for name, how in PAIRS[p].items():
            if name not in g:
                missing.setdefault(how, set()).add(name)
        extra = sorted(set(g) - set(PAIRS[p]))
        layout = [n for n in extra if p == "layout" and n in LAYOUT]
        if layout:
            problems.append(f"{', '.join(layout)} hold the same values in another memory layout (a transposed "
                            f"copy, a strided view) and were returned: tensor_hash reads the values in logical "
                            f"order (.contiguous()), so a memory layout is no difference")
        if set(extra) - set(layout):
            differs = ", ".join(sorted(PAIRS[p]))
            problems.append(f"'{p}' pair: you returned {', '.join(sorted(set(extra) - set(layout)))}, but "
                            f"{f'only {differs}' if differs else 'nothing'} differs there")
    why = [WHY[how].format(names=", ".join(sorted(missing[how]))) for how in WHY if how in missing]
    return (errors + why + problems)[:5]


register(Exercise(
    id="07.1", notebook="07_troubleshooting", title="State-dict entries that differ, by exact bytes",
    skills="exact comparison by dtype, shape and bytes (tensor_hash); a tolerance misses one ulp; buffers "
           "are state; a memory layout is no difference",
    answer="diff_tensors(a, b) -> names of the state-dict entries whose tensor_hash differs",
    nproc=0, on_rank=on_rank, judge=judge))
