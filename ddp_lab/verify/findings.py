"""From the ranks' records to findings: each with its category, rank, step, evidence and fix.

Records are what ddp_lab/verify/_inject/sitecustomize.py wrote, grouped by rank
({rank: [record, ...]}, in write order). Each check compares the ranks with each other, or a rank
with its own earlier pass, never with a number typed here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ddp_lab.verify.gates import quoted

CATEGORIES = ("data-coverage", "replica-divergence", "rank-state", "comm-per-step", "lr-per-step", "eval-count",
              "same-noise", "grad-scale", "resume-mismatch", "hang")
SHOW = 3  # tensors or indices named in a finding's evidence


@dataclass
class Finding:
    category: str
    rank: int | None
    step: int | None      # the optimizer step it shows at (1 = the first); None: before any step
    message: str
    evidence: str
    fix: str
    line: str | None = None  # "file:line" of the script where it shows, where the observer saw it

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        where = ", ".join(filter(None, [f"rank {self.rank}" if self.rank is not None else "",
                                        f"step {self.step}" if self.step is not None else ""]))
        return (f"[{self.category}] {where + ': ' if where else ''}{self.message}\n"
                + (f"    line: {self.line}\n" if self.line else "")
                + f"    evidence: {self.evidence}\n    fix: {self.fix}")


def _kind(records: dict, kind: str) -> dict:
    return {r: [x for x in recs if x.get("kind") == kind] for r, recs in records.items()}


# -- 1. data coverage ---------------------------------------------------------------------------

def _training_loaders(records: dict) -> set:
    """Loaders during whose passes an optimizer step happened (not an evaluation loader)."""
    out = set()
    for recs in records.values():
        steps = [x["step"] for x in recs if x.get("kind") == "step"]
        final = max(steps, default=0)
        passes = [x for x in recs if x.get("kind") == "pass"]
        for i, p in enumerate(passes):
            end = passes[i + 1]["step"] if i + 1 < len(passes) else final
            if end > p["step"]:
                out.add(p["loader"])
    return out


def data_coverage(records: dict, world: int, notes: list) -> list:
    passes = _kind(records, "pass")
    ranks = sorted(passes)
    out = []
    for loader in sorted(_training_loaders(records)):
        by_rank = {r: [p for p in passes[r] if p["loader"] == loader] for r in ranks}
        common = min((len(v) for v in by_rank.values()), default=0)
        if len(ranks) < world or common == 0:
            notes.append(f"data-coverage: loader {loader} was not iterated on every rank; not checked")
            continue
        for k in range(common):
            found = _one_pass(loader, k, {r: by_rank[r][k] for r in ranks}, world)
            if found:
                out.append(found)
                break
        out.extend(_order(loader, by_rank, notes))
    return out


def _one_pass(loader, k, recs: dict, world: int) -> Finding | None:
    first = recs[min(recs)]
    if any(p["indices"] is None for p in recs.values()):
        return None
    n, pool, of = _universe(recs)
    step = first["step"] + 1
    sizes = {r: p["dataset_len"] for r, p in recs.items()}
    if len(set(sizes.values())) > 1:
        r = max(sizes, key=sizes.get)
        return Finding("data-coverage", r, step,
                       f"the ranks load data sets of different sizes: {_per_rank(sizes)}",
                       "the loader's data set differs between ranks", "build the same data set on every rank",
                       recs[r].get("at"))
    samplers = {r: p["sampler"] for r, p in recs.items()}
    wrong = {r: s for r, s in samplers.items() if distributed(s)
             and (s["rank"] != r or s["num_replicas"] != world)}
    if wrong:
        r, s = min(wrong.items())
        local = " (LOCAL_RANK used as the global rank? each simulated node here has one rank, so "\
                "LOCAL_RANK is 0 everywhere)" if s["rank"] != r else ""
        return Finding("data-coverage", r, step,
                       f"DistributedSampler(rank={s['rank']}, num_replicas={s['num_replicas']}) on rank {r} "
                       f"of {world}{local}",
                       f"pass {k} of loader {loader}: {_overlap_words(recs)}",
                       "build DistributedSampler(dataset) without rank=/num_replicas= (it reads the process "
                       "group), or pass the global RANK and WORLD_SIZE, never LOCAL_RANK", recs[r].get("at"))
    sets = {r: set(p["indices"]) for r, p in recs.items()}
    union = set().union(*sets.values())
    drawn = sum(len(p["indices"]) for p in recs.values())
    pad = promised_padding(samplers.values(), n, world)
    repeated = drawn - len(union)
    if n is not None and repeated > pad:
        if len({tuple(sorted(s)) for s in sets.values()}) == 1:
            message = (f"every rank draws the same {len(union)} samples per pass "
                       f"({first['sampler']['type']}, not a DistributedSampler)")
        else:
            message = f"the ranks' shards overlap: {repeated} samples drawn twice or more in one pass" \
                      f"{f', {repeated - pad} more than the {pad} repeats the sampler pads with' if pad else ''}"
        fix = ("shard with DistributedSampler(dataset, shuffle=True) and call sampler.set_epoch(epoch); "
               "a hand-made split must use the same seed on every rank")
        if first["subset"]:
            fix = "split with one seed shared by every rank (e.g. torch.Generator().manual_seed(SEED)), " \
                  "then take shard RANK of WORLD_SIZE, or use DistributedSampler"
        r = 1 if world > 1 else 0
        return Finding("data-coverage", r, step, message,
                       f"pass {k} of loader {loader}: {_overlap_words(recs)}", fix, recs[r].get("at"))
    if n is not None and pool is not False:
        never = sorted((set(range(n)) if pool is None else pool) - union)
        missing = len(never)
        even = all(map(distributed, samplers.values())) and first["sampler"].get("drop_last")
        allowed = n % world if even else 0
        if first["drop_last"] and first["batch_size"]:
            allowed += world * (first["batch_size"] - 1)
        if missing > allowed:
            return Finding("data-coverage", None, step,
                           f"{missing} of {n} samples{of} are drawn by no rank in pass {k}",
                           f"never drawn: {never[:SHOW]}{' ...' if len(never) > SHOW else ''}; "
                           f"{_per_rank({r: len(s) for r, s in sets.items()})} distinct samples",
                           "shard with DistributedSampler(dataset) so the ranks together cover the data set",
                           first.get("at"))
    return None


def distributed(sampler: dict) -> bool:
    """A DistributedSampler, or a subclass of one (the observer records which)."""
    return bool(sampler.get("distributed")) or sampler.get("type") == "DistributedSampler"


def promised_padding(samplers, n, world: int) -> int:
    """How many samples the ranks' samplers may repeat in one pass by their own promise: with
    drop_last=False, DistributedSampler pads the last round with repeats, total_size - len(dataset) of
    them (at most world_size - 1); a subclass with an order of its own (a resumable sampler that
    starts mid-epoch) pads its own remainder, so at most world_size - 1. 0 for any other sampler."""
    samplers = list(samplers)
    if not samplers or not all(map(distributed, samplers)) or any(s.get("drop_last") for s in samplers):
        return 0
    s = samplers[0]
    if s.get("type") == "DistributedSampler" and s.get("total_size") is not None and s.get("length") is not None:
        return max(0, s["total_size"] - s["length"])
    if s.get("type") == "DistributedSampler" and n is not None:
        return math.ceil(n / world) * world - n
    return world - 1


def _universe(recs: dict):
    """(n, pool, words): the samples one pass of the ranks must cover, as indices into the data set
    under every Subset. The innermost of each rank's universes (the observer's "universes") that all
    ranks share: the Subset every rank wraps (a training split: the rest is not training data), or
    the index list every rank's sampler draws from; ranks with index lists of their own: those lists
    together. Else the whole data set under them (a Subset per rank is a hand-made shard of it).
    pool: a set, None for range(n), False when too large to list (missing samples not counted)."""
    base = (recs[min(recs)]["dataset_len"], None, "")
    levels = [p.get("universes") for p in recs.values()]
    if not all(levels):
        return base
    for k in range(min(map(len, levels)) - 1):  # the last level is the data set itself
        here = [lv[k] for lv in levels]
        if any(x["what"] != here[0]["what"] for x in here):
            return base
        if any(x["indices"] is None for x in here):
            return here[0]["len"], False, ""
        sets = [set(x["indices"]) for x in here]
        words = " of the Subset the loader wraps" if here[0]["what"] == "Subset" else " of the sampler's index list"
        if all(x == sets[0] for x in sets):
            return len(sets[0]), sets[0], words
        if here[0]["what"] == "sampler":
            pool = set().union(*sets)
            return len(pool), pool, " of the ranks' index lists together"
    return base


def _order(loader, by_rank: dict, notes: list) -> list:
    """A shuffling sampler must give each rank a new order every pass (set_epoch)."""
    for r, recs in sorted(by_rank.items()):
        if len(recs) < 2:
            notes.append(f"data-coverage: one pass of loader {loader} seen; the order across epochs was not "
                         f"compared (run more steps to see two)")
            return []
        for k in range(1, len(recs)):
            a, b = recs[k - 1], recs[k]
            s = b["sampler"]
            if a["indices"] is None or a["indices"] != b["indices"]:
                continue
            if distributed(s) and s.get("shuffle"):
                return [Finding("data-coverage", r, b["step"] + 1,
                                f"pass {k} draws exactly the order of pass {k - 1}: the DistributedSampler "
                                f"still has epoch={s['epoch']}",
                                f"loader {loader}, rank {r}: first indices {b['indices'][:SHOW]} in both passes",
                                "call sampler.set_epoch(epoch) at the start of every epoch, before iterating",
                                b.get("at"))]
    return []


def _overlap_words(recs: dict) -> str:
    ranks = sorted(recs)
    a, b = ranks[0], ranks[-1]
    shared = sorted(set(recs[a]["indices"]) & set(recs[b]["indices"]))
    return (f"ranks {a} and {b} share {len(shared)} of {len(set(recs[a]['indices']))} samples "
            f"(e.g. {shared[:SHOW]}); rank {a} draws {recs[a]['indices'][:SHOW]}..., rank {b} draws "
            f"{recs[b]['indices'][:SHOW]}...")


def _per_rank(values: dict) -> str:
    return ", ".join(f"{v} on rank {r}" for r, v in sorted(values.items()))


# -- 2. replica divergence ----------------------------------------------------------------------

def replica_divergence(records: dict, notes: list) -> list:
    # A "joined" step (a rank out of data under Join shadowed the others' all-reduce) changes no
    # parameter on that rank until Join's final sync: not compared.
    steps = {r: {x["step"]: x for x in recs if not x.get("joined")} for r, recs in _kind(records, "step").items()}
    if len(steps) < 2:
        return []
    ranks = sorted(steps)
    common = sorted(set.intersection(*(set(s) for s in steps.values())))
    if not common:
        notes.append("replica-divergence: no optimizer step ran on every rank; not checked")
    out = []
    for what in ("params", "buffers"):
        for step in common:
            ref = steps[ranks[0]][step]
            if what == "buffers" and all(steps[r][step].get("broadcast_buffers") is not False for r in ranks):
                break  # DDP overwrites the buffers from rank 0 at the next forward: healthy
            found = _differs(what, step, ranks, steps, ref)
            if found:
                out.append(found)
                break
    return out


def _differs(what, step, ranks, steps, ref) -> Finding | None:
    for r in ranks[1:]:
        rec = steps[r][step]
        names = [n for n in ref[what] if rec[what].get(n) != ref[what][n]]
        if not names:
            continue
        shown = ", ".join(names[:SHOW]) + (f" and {len(names) - SHOW} more" if len(names) > SHOW else "")
        if what == "buffers":
            return Finding("replica-divergence", r, step,
                           f"buffers differ from rank {ranks[0]} after step {step}: {shown}",
                           "DistributedDataParallel(broadcast_buffers=False): each rank keeps its own running "
                           "statistics, so evaluation and checkpoints depend on the rank",
                           "drop broadcast_buffers=False and keep the default (forward_sync_buffers=True, the name "
                           "since torch 2.13), or use SyncBatchNorm on GPUs", rec.get("at"))
        lrs = {q: steps[q][step]["lr"] for q in ranks}
        agreed = [t for t in sorted(steps[ranks[0]]) if t < step
                  and all(steps[q].get(t, {}).get("lr") == steps[ranks[0]][t]["lr"] for q in ranks)]
        if len({tuple(v) for v in lrs.values()}) > 1 and agreed:
            evidence = f"learning rates agreed at step {agreed[-1]}, then differ: {_per_rank(lrs)}"
            gate = quoted(rec.get("at"), prefer={"step"})
            fix = ("step the scheduler (and change the optimizer) on every rank, "
                   + (f"not just on the ranks {gate} lets through" if gate else "not under a condition on the rank")
                   + "; only logging and saving belong to one rank")
        elif len({tuple(v) for v in lrs.values()}) > 1:
            evidence = f"learning rates differ: {_per_rank(lrs)}"
            fix = "derive hyperparameters from the world size or the config, never from the rank"
        else:
            evidence = f"{len(names)} of {len(ref[what])} parameters differ; learning rates agree ({ref['lr']})"
            gate = quoted(rec.get("at"))
            fix = ("run the same optimizer and scheduler steps, and the same in-place changes of parameters, on "
                   "every rank (" + (f"{gate} keeps work from the other ranks" if gate else
                                     "a condition on the rank around one is the usual cause") + ")")
        if not ref.get("ddp"):
            fix = "wrap the model in DistributedDataParallel, so gradients are averaged before each step"
        return Finding("replica-divergence", r, step,
                       f"parameters differ from rank {ranks[0]} after step {step}: {shown}", evidence, fix,
                       rec.get("at"))
    return None


# -- 3. gradient all-reduces per step -----------------------------------------------------------

def comm_per_step(records: dict, notes: list) -> list:
    for r, recs in sorted(_kind(records, "step").items()):
        if any(x["ddp"] for x in recs):  # steps before the DDP model's first forward: a warm-up
            recs = recs[next(i for i, x in enumerate(recs) if x["ddp"]):]
        if not recs:
            continue
        if not any(x["ddp"] for x in recs):
            return [Finding("comm-per-step", r, recs[0]["step"],
                            "no DistributedDataParallel model: gradients are never all-reduced",
                            f"{len(recs)} optimizer steps observed on rank {r}, no DDP module was built",
                            "wrap the model: model = DistributedDataParallel(model)", recs[0].get("at"))]
        extra = [x for x in recs if x["rounds"] > 1]
        if extra:
            x = extra[0]
            wasted = sum(y["bytes"] - y["bytes"] // y["rounds"] for y in extra)
            per = x["bytes"] // x["rounds"]
            return [Finding("comm-per-step", r, x["step"],
                            f"{x['rounds']} gradient all-reduces before step {x['step']} (1 is enough): "
                            f"every micro-batch of an accumulation all-reduces",
                            f"{per:,} bytes per all-reduce; {wasted:,} bytes sent for nothing over "
                            f"{len(extra)} of {len(recs)} steps on this rank",
                            "run the forward and the backward of every micro-batch before the last one inside "
                            "`with model.no_sync():` (the forward too: DDP decides there whether the backward "
                            "will all-reduce), or set model.require_backward_grad_sync = (micro_step == K - 1) "
                            "before each forward",
                            (x.get("round_lines") or [None])[0])]
        none = [x for x in recs if x["rounds"] == 0]
        if none:
            x = none[0]
            return [Finding("comm-per-step", r, x["step"],
                            f"no gradient all-reduce before step {x['step']}: this step used this rank's "
                            f"gradients alone",
                            f"{len(none)} of {len(recs)} steps without an all-reduce on rank {r}",
                            "leave no_sync (or require_backward_grad_sync = False) for the last micro-batch "
                            "of each step only", x.get("at"))]
    return []


# -- what was checked, and what cannot be ----------------------------------------------------------

LIMITS = (  # what these checks cannot see, whatever the run: said beside a clean report
    "augmentation noise drawn the same on every rank in DataLoader workers, or from a generator of its "
    "own (only torch's and Python's global generators are watched, in a single-process loader; numpy's "
    "too between the first 4 steps), and dropout masks drawn the same on every rank from a generator of "
    "the script's own, or after the first 2 training forwards",
    "state kept outside the optimizer (an EMA, a teacher) that the script's frames do not hold (a closure, "
    "a library object), or that diverges only after the first 4 steps",
    "a learning rate set by hand per micro-batch (param_group['lr'] = ...) instead of by an LR scheduler, "
    "or a scheduler stepped per micro-batch in a run of fewer than 3 optimizer steps",
    "a metric averaged as a mean of per-rank means, or a validation set that DistributedSampler pads "
    "reduced as if exact when its sample count is not all-reduced with torch.distributed.all_reduce "
    "(losses and metrics themselves are not observed)",
    "a loss scaled wrongly for the accumulation (the same on every rank)",
    "the sharding inside an IterableDataset (its indices are not seen)",
)


def checked(records: dict, world: int) -> list:
    """What the checks compared in one run, each counted from its records (said in a clean report)."""
    out = []
    passes = _kind(records, "pass")
    if not _training_loaders(records):
        out.append("data-coverage: not observed: no DataLoader pass had an optimizer step in it (no training "
                   "loader to compare)")
    for loader in sorted(_training_loaders(records)):
        by_rank = {r: [p for p in recs if p["loader"] == loader] for r, recs in passes.items()}
        k = min(map(len, by_rank.values()), default=0)
        if len(by_rank) < world or not k:
            out.append(f"data-coverage: loader {loader} not observed: it was not iterated on every rank")
            continue
        if any(p["indices"] is None for ps in by_rank.values() for p in ps[:k]):
            out.append(f"data-coverage: loader {loader} not observed: a pass of more than {200_000:,} indices is "
                       f"counted, not compared")
            continue
        n, _, of = _universe({r: ps[0] for r, ps in by_rank.items()})
        at = by_rank[min(by_rank)][0].get("at")
        out.append(f"data-coverage: {_count(k, 'pass', 'passes')} of loader {loader}"
                   f"{f' (iterated at {at})' if at else ''} on {_count(world, 'rank')}, against the {n} samples{of}"
                   + ("; the order of each pass against the one before" if k > 1 else ""))
    steps = {r: [x for x in recs if not x.get("joined")] for r, recs in _kind(records, "step").items()}
    common = set.intersection(*({x["step"] for x in v} for v in steps.values())) if steps else set()
    if not common:
        out.append("replica-divergence: not observed: no optimizer step ran on every rank")
    elif len(steps) > 1:
        last = steps[min(steps)][-1]
        buffers = len(last["buffers"]) if last.get("broadcast_buffers") is False else 0
        out.append(f"replica-divergence: {_count(len(last['params']), 'parameter tensor')}"
                   f"{f' and {buffers} buffers' if buffers else ''} bitwise on {len(steps)} ranks after "
                   f"{'each of ' if len(common) > 1 else ''}{_count(len(common), 'step')}")
    counted = {r: [x for x in recs if x["ddp"]] for r, recs in _kind(records, "step").items()}
    if any(counted.values()):
        rounds = sorted({x["rounds"] for recs in counted.values() for x in recs})
        n = max(map(len, counted.values()))
        out.append(f"comm-per-step: the gradient all-reduces before {'each of ' if n > 1 else ''}"
                   f"{_count(n, 'step')} on {_count(len(counted), 'rank')} ({' or '.join(map(str, rounds))} per step)")
    from ddp_lab.verify import state
    from ddp_lab.verify import world as invariant
    return out + state.checked(records) + invariant.checked(records)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def analyse(records: dict, world: int, notes: list) -> list:
    """Every finding the records show, in CATEGORIES order."""
    from ddp_lab.verify import state
    from ddp_lab.verify import world as invariant
    return (data_coverage(records, world, notes) + replica_divergence(records, notes)
            + state.rank_state(records, world) + comm_per_step(records, notes) + invariant.lr_per_step(records, notes)
            + invariant.eval_count(records, world, notes) + invariant.same_noise(records, world, notes))
