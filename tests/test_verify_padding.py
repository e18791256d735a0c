"""verify judges a DistributedSampler's shards against what the sampler promises: with
drop_last=False it pads the last round with repeats (at most world_size - 1 of them), so that many
repeats are no overlap, for DistributedSampler and for a subclass with an order of its own (the
template's resumable sampler); more than that is. First on records made here from real samplers,
then one verify --uneven of the unmodified template on 3 ranks and 1000 samples (1000 = 3 x 333 + 1)."""
import argparse
import json
import math
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from ddp_lab.verify.findings import data_coverage

TEMPLATE = Path(__file__).resolve().parents[1] / "scripts" / "train_ddp.py"


class OwnOrder(DistributedSampler):
    """An order of its own, padded as DistributedSampler pads: the shape of the template's sampler."""

    def __iter__(self):
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed)).tolist()
        order += order[:-len(order) % self.num_replicas]
        return iter(order[self.rank::self.num_replicas])

    def __len__(self):
        return math.ceil(len(self.dataset) / self.num_replicas)


def records(n, world, sampler=OwnOrder, shards=None):
    """One pass per rank as the observer writes it; shards: {rank: indices} replacing the sampler's."""
    out = {}
    for r in range(world):
        s = sampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=0)
        indices = (shards or {}).get(r, list(s))
        out[r] = [{"kind": "pass", "loader": 0, "pass": 0, "step": 0, "dataset_len": n, "subset": False,
                   "batch_size": 4, "drop_last": False, "count": len(indices), "indices": indices,
                   "sampler": {"type": type(s).__name__, "distributed": True, "rank": r, "num_replicas": world,
                               "epoch": 0, "shuffle": True, "drop_last": False, "seed": 0,
                               "total_size": s.total_size, "length": n}},
                  {"kind": "step", "step": 1}]
    return out


def test_the_padding_a_sampler_subclass_promises_is_no_overlap():
    for n, world in ((10, 3), (1000, 3), (9, 4)):
        assert data_coverage(records(n, world), world, []) == [], (n, world)
        assert data_coverage(records(n, world, DistributedSampler), world, []) == [], (n, world)


def test_repeats_beyond_the_promise_are_an_overlap():
    world = 3
    honest = records(10, world)
    shards = {r: honest[r][0]["indices"] for r in range(world)}
    shards[2] = shards[2] + shards[1][:2]  # 2 samples of rank 1 too: 4 repeats, 2 of them padding
    (f,) = data_coverage(records(10, world, shards=shards), world, [])
    assert f.category == "data-coverage" and "shards overlap: 4 samples drawn twice or more" in f.message
    assert "2 more than the 2 repeats the sampler pads with" in f.message


def test_the_unmodified_template_on_3_ranks_has_no_overlap():
    from ddp_lab.verify import command
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--nproc", "3", "--steps", "1", "--pg-timeout", "60", "--timeout", "300", "--",
                              str(TEMPLATE), "--epochs", "1", "--dataset", "synthetic", "--synthetic-size", "1000"])
    report = command.report_for(args)
    data, text = json.loads(json.dumps(report.to_dict())), report.text()
    assert data["findings"] == [], text
    assert any(c.startswith("data-coverage: 1 pass of loader 0") and "on 3 ranks, against the 1000 samples" in c
               for c in data["checked"]), text
