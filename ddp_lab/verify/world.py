"""What must not depend on the world size, and what must differ across ranks: checks on the records
of ddp_lab/verify/_inject.

- lr-per-step (every run): each LR scheduler steps at most once per optimizer step;
- eval-count (every run): an all-reduced count of an evaluation pass that includes the samples
  DistributedSampler repeats to pad the last round;
- same-noise (every run): random numbers drawn while a training batch is loaded (augmentation), or in
  the DDP model's training forward (dropout), from a generator in the same state on every rank;
- grad-scale (--scaling, one more launch): the 1-rank run takes step 1 on rank 0's batches, from the
  same parameters; rank 0's own gradient (before DDP averages it) must equal the 1-rank gradient,
  both read where backward() leaves them (DDP's comm hook), before any clipping.
"""
from __future__ import annotations

import json
import statistics

from ddp_lab.verify.findings import Finding, _kind, _training_loaders, distributed

TOLERANCE = 0.01  # relative: the same batch, parameters and operations give (nearly) the same numbers
NEGLIGIBLE = 1e-4  # a parameter tensor's gradient norm below this share of the largest one is not compared


# -- LR scheduler steps per optimizer step --------------------------------------------------------

def lr_per_step(records: dict, notes: list) -> list:
    """A scheduler stepped more than once between two optimizer steps, in most of the intervals
    between steps that the run completed (the interval before step 1 counts only when it is the only one)."""
    for r, recs in sorted(_kind(records, "sched").items()):
        final = len([x for x in records[r] if x.get("kind") == "step" and not x.get("joined")])
        by = {}
        for x in recs:
            by.setdefault(x["sched"], {}).setdefault(x["opt_steps"], []).append(x)
        for number, intervals in sorted(by.items()):
            done = {v: xs for v, xs in intervals.items() if v < final}
            later = {v: xs for v, xs in done.items() if v >= 1}
            done = later or done
            many = {v: xs for v, xs in done.items() if len(xs) > 1}
            if not many or 2 * len(many) <= len(done):
                continue
            v, xs = min(many.items())
            k = max(len(x) for x in many.values())
            lrs = [xs[0]["lr"][0], xs[-1]["lr"][0]] if xs[0]["lr"] and xs[-1]["lr"] else [None]
            lrs = lrs if all(isinstance(v, (int, float)) for v in lrs) else None
            return [Finding("lr-per-step", r, v + 1,
                            f"the LR scheduler ({xs[0]['type']}) steps {k} times per optimizer step: its "
                            f"schedule runs {k}x as fast as the optimizer's steps (stepped per micro-batch)",
                            f"{len(xs)} scheduler.step() calls between optimizer steps {v} and {v + 1} on rank {r}"
                            + (f"; the learning rate went from {lrs[0]:.6g} to {lrs[1]:.6g} meanwhile" if lrs else "")
                            + f"; {len(many)} of {len(done)} such intervals had more than one call",
                            "call scheduler.step() once per optimizer step, next to optimizer.step() (inside "
                            "the `if (i + 1) % K == 0:` of an accumulation), or size the schedule in micro-batches",
                            xs[0].get("at"))]
    return []


# -- an evaluation count with DistributedSampler's padding ------------------------------------------

def eval_count(records: dict, world: int, notes: list) -> list:
    """A small all-reduce after a pass of a loader that no step ran during, whose DistributedSampler
    pads: a finding when every rank's values hold the number of samples that rank drew, padding
    included (so the sum counts the repeated samples as if they were more data)."""
    ranks = sorted(records)
    reduces = _kind(records, "reduce")
    if world < 2 or len(ranks) < world or not all(reduces.get(r) for r in ranks):
        return []
    training = _training_loaders(records)
    passes = {r: {(x["loader"], x["pass"]): x for x in recs} for r, recs in _kind(records, "pass").items()}
    for i in range(min(len(reduces[r]) for r in ranks)):
        xs = {r: reduces[r][i] for r in ranks}
        key = (xs[ranks[0]]["loader"], xs[ranks[0]]["pass"])
        if key[0] in training or any((x["loader"], x["pass"]) != key for x in xs.values()):
            continue
        ps = {r: passes.get(r, {}).get(key) for r in ranks}
        if any(p is None for p in ps.values()):
            continue
        s = ps[ranks[0]]["sampler"]
        pad = (s.get("total_size") or 0) - (s.get("length") or 0)
        if not distributed(s) or s.get("drop_last") or pad <= 0:
            continue
        if all(float(ps[r]["count"]) in xs[r]["values"] for r in ranks):
            x = xs[ranks[-1]]
            held = ", ".join(f"{xs[r]['values']} on rank {r}" for r in ranks)
            return [Finding("eval-count", None, x["step"] or None,
                            f"an all-reduced count is {s['total_size']} samples where loader {key[0]} has "
                            f"{s['length']}: it counts the {pad} sample{'s' if pad > 1 else ''} DistributedSampler repeats to pad the last round",
                            f"loader {key[0]} (no optimizer step during its passes: an evaluation) on {world} ranks, "
                            f"pass {key[1]}: each rank draws {ps[ranks[0]]['count']} samples and all-reduces that "
                            f"number ({held}); "
                            f"the metric then changes with the world size",
                            "count only the real samples: evaluate each rank on Subset(dataset, range(rank, len(dataset), "
                            "world_size)) with a sampler that does not pad, all-reduce the sums and the count, then "
                            "divide; or evaluate on rank 0 alone", x.get("at"))]
    return []


# -- augmentation noise drawn the same on every rank ------------------------------------------------

def same_noise(records: dict, world: int, notes: list) -> list:
    """Loading one of the first batches of a training pass moved torch's global generator (or Python's
    `random`) on every rank, and that generator was in the same state on every rank before it."""
    ranks = sorted(records)
    if world < 2 or len(ranks) < world:
        return []
    training = _training_loaders(records)
    draws = {r: {(x["loader"], x["pass"], x["batch"]): x for x in recs if x["loader"] in training}
             for r, recs in _kind(records, "draw").items()}
    if len(draws) < world:
        return []
    for key in sorted(set.intersection(*(set(d) for d in draws.values()))):
        xs = {r: draws[r][key] for r in ranks}
        for name, words in (("torch", "torch's global generator"), ("random", "Python's random module")):
            moved = all(x[name][0] != x[name][1] for x in xs.values())
            if moved and len({x[name][0] for x in xs.values()}) == 1:
                x = xs[ranks[0]]
                return [Finding("same-noise", None, x["step"] + 1,
                                f"every rank draws the same random numbers while loading its batches: {words} is "
                                f"in the same state on every rank (one seed), and loading draws from it "
                                f"(augmentation), so the ranks' augmentations are the same",
                                f"loader {key[0]}, pass {key[1]}, batch {key[2]}: the generator's state before it "
                                f"was loaded hashes to {x[name][0]} on all {world} ranks; loading it moved the "
                                f"generator on every rank",
                                "seed the data path per rank: torch.manual_seed(seed + rank) (and random.seed) after "
                                "the model is built and wrapped (DDP copies rank 0's parameters anyway), or give the "
                                "augmentation a torch.Generator seeded with seed + rank", x.get("at"))]
    from ddp_lab.verify.state import same_loop_noise
    return same_masks(records, world) or same_loop_noise(records, world)


def same_masks(records: dict, world: int) -> list:
    """One of the first training forwards of a DDP model moved torch's global generator on every rank
    (dropout), and that generator was in the same state on every rank before it."""
    ranks = sorted(records)
    forwards = {r: {(x["ddp"], x["forward"]): x for x in recs} for r, recs in _kind(records, "forward").items()}
    if len(forwards) < world:
        return []
    for key in sorted(set.intersection(*(set(f) for f in forwards.values()))):
        xs = {r: forwards[r][key] for r in ranks}
        if all(x["torch"][0] != x["torch"][1] for x in xs.values()) and len({x["torch"][0] for x in xs.values()}) == 1:
            x = xs[ranks[0]]
            return [Finding("same-noise", None, x["step"] + 1,
                            "every rank draws the same dropout masks: torch's global generator is in the same "
                            "state on every rank (one seed) when the model's forward draws from it, so each "
                            "step drops the same units on every rank and the averaged gradient sees one mask, "
                            "not one per rank",
                            f"training forward {key[1] + 1} of DDP model {key[0]}: the generator's state before "
                            f"it hashes to {x['torch'][0]} on all {world} ranks; the forward moved the generator "
                            f"on every rank",
                            "seed each rank after the model is built and wrapped: torch.manual_seed(seed + rank) "
                            "after DDP(model) (DDP copies rank 0's parameters, so the replicas still start equal)",
                            x.get("at"))]
    return []


def checked(records: dict) -> list:
    """What these checks compared in one run (said in a clean report)."""
    out = []
    scheds = {x["sched"] for recs in _kind(records, "sched").values() for x in recs}
    if scheds:
        calls = max(len(v) for v in _kind(records, "sched").values())
        out.append(f"lr-per-step: {calls} scheduler.step() calls of {len(scheds)} LR scheduler"
                   f"{'s' if len(scheds) > 1 else ''} against the optimizer steps (at most 1 per step)")
    else:
        out.append("lr-per-step: not observed: the script stepped no LR scheduler")
    training = _training_loaders(records)
    evals = {x["loader"] for recs in _kind(records, "reduce").values() for x in recs if x["loader"] not in training}
    if evals:
        out.append(f"eval-count: the script's all-reduces after passes of evaluation loader "
                   f"{', '.join(map(str, sorted(evals)))} against the samples each rank drew, padding included")
    else:
        out.append("eval-count: not observed: the script all-reduced no small tensor after a pass of an "
                   "evaluation loader")
    from ddp_lab.verify.state import noise_checked
    return out + noise_checked(records)


# -- the gradient and the learning rate of step 1, N ranks against 1 ---------------------------------

def first_step(recs: list) -> dict | None:
    return next((x for x in recs if x.get("kind") == "step" and not x.get("joined")), None)


def reference(path, args, world, timeout, pg_timeout, folder, report, full) -> list:
    """Run the script on 1 rank for one step, on the batches rank 0 of the main run drew for its
    step 1; compare (findings; notes and checked lines go into report)."""
    from ddp_lab.verify.runner import launch_observed, steps_done
    a = first_step(full.get(0, []))
    if a is None or not a.get("drawn"):
        report.notes.append("grad-scale: " + ("no optimizer step ran on rank 0" if a is None else
                            "the batches of step 1 were not seen (no DataLoader, or an IterableDataset)")
                            + "; the 1-rank run was not launched, the gradients not compared")
        return []
    records, work = folder / "records", folder / "work"
    records.mkdir(parents=True)
    work.mkdir()
    feed = folder / "feed.json"
    feed.write_text(json.dumps(a["drawn"]))
    ref, e, wall = launch_observed(path, args, 1, records, work, timeout, pg_timeout,
                                   {"DDP_LAB_VERIFY_STEPS": "1", "DDP_LAB_VERIFY_FEED": str(feed)})
    report.runs.append({"ranks": 1, "steps": steps_done(ref), "wall_s": round(wall, 2),
                        "what": "step 1 on rank 0's batches"})
    if e is not None and first_step(ref.get(0, [])) is None:
        report.notes.append(f"grad-scale: the 1-rank run failed before step 1, not compared: "
                            f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}")
        return []
    found, notes, said = compare(a, first_step(ref.get(0, [])), world)
    report.notes += notes
    report.checked += said
    return found


def compare(a: dict, b: dict | None, world: int) -> tuple[list, list, list]:
    """(findings, notes, checked) from step 1 of the N-rank run's rank 0 (`a`) and of the 1-rank run
    on the same batches (`b`)."""
    notes, said = [], []
    if b is None:
        return [], ["grad-scale: the 1-rank run made no optimizer step; not compared"], []
    lr_a, lr_b = a.get("lr") or [], b.get("lr") or []
    if lr_a and lr_b and None not in lr_a + lr_b:
        if lr_a == lr_b:
            said.append(f"lr-per-step: the learning rate of step 1 on {world} ranks equals the 1-rank run's ({lr_a[0]:g})")
        elif lr_b[0] and abs(lr_a[0] / lr_b[0] / world - 1) <= TOLERANCE:
            notes.append(f"lr-per-step: the learning rate of step 1 is {world}x the 1-rank run's ({lr_a[0]:g} against "
                         f"{lr_b[0]:g}): scaled with the world size, as the linear scaling rule does for a global "
                         f"batch that grows with it; a bug if the global batch does not")
        else:
            notes.append(f"lr-per-step: the learning rate of step 1 differs between {world} ranks ({lr_a}) and 1 "
                         f"rank ({lr_b})")
    why = None
    if a.get("pre_params") != b.get("pre_params"):
        why = (f"the parameters before step 1 differ between {world} ranks and 1 (an initialisation that depends "
               f"on the world size, or on random numbers drawn before it)")
    elif a.get("batch") != b.get("batch"):
        why = "the 1-rank run's step 1 did not draw rank 0's batches"
    elif a.get("rounds") != 1 or not a.get("grad_local"):
        why = f"step 1 on {world} ranks had {a.get('rounds', 0)} gradient all-reduces, not 1"
    # Like with like: rank 0's own gradient as backward() left it (in the comm hook, before the
    # all-reduce and before any clipping) against the 1-rank run's at the same point. The gradient the
    # optimizer saw (`grad`) is after clipping: a clip that fires at step 1 would look like a scale.
    local, ref = a.get("grad_local") or {}, b.get("grad_local") or b.get("grad") or {}
    top = max(ref.values(), default=0)
    # a gradient that is rounding noise (a bias before a BatchNorm: about 1e-8) has no scale to compare
    names = [n for n in ref if ref[n] > NEGLIGIBLE * top and local.get(n)]
    if why is None and not names:
        why = "no parameter tensor had a gradient that is not negligible in both runs"
    ratios = {n: local[n] / ref[n] for n in names}
    if why is None and max(ratios.values()) > min(ratios.values()) * (1 + TOLERANCE):
        why = (f"the gradients differ by more than a factor (ratios {min(ratios.values()):.4g} to "
               f"{max(ratios.values()):.4g} across parameter tensors): random numbers drawn in the forward, "
               f"such as dropout's, differ between the runs")
    if why:
        return [], notes + [f"grad-scale: not compared: {why}"], said
    scale = statistics.median(ratios.values())
    if abs(scale - 1) <= TOLERANCE:
        said.append(f"grad-scale: rank 0's gradient of step 1, before the all-reduce, equals a 1-rank run's on the "
                    f"same batches from the same parameters ({len(names)} parameter tensors, ratio {scale:.4f})")
        return [], notes, said
    words = (f"{world} times (the world size)" if abs(scale / world - 1) <= TOLERANCE else
             f"1/{world} of (one over the world size)" if abs(scale * world - 1) <= TOLERANCE else f"{scale:.4g} times")
    shown = ", ".join(f"{n} {local[n]:.4g} / {ref[n]:.4g}" for n in names[:3])
    line = (a.get("round_lines") or [None])[0]
    return [Finding("grad-scale", 0, 1,
                    f"the gradient of step 1 is {words} the gradient one process computes on the same batch: the "
                    f"loss is scaled with the world size, so DDP's average over the ranks is off by that factor",
                    f"gradient norm per parameter tensor, rank 0 of {world} before the all-reduce / 1 rank, same "
                    f"batches and parameters: {shown}",
                    "compute each rank's loss exactly as one process would (the mean over its batch) and drop the "
                    "factor of the world size: DDP already averages the gradients over the ranks", line)], notes, said
