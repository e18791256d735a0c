"""ddp_lab.verify.findings on records made here (no launch): the shards come from torch's own
DistributedSampler, so the expectation is independent of the code under test."""
import torch
from torch.utils.data import DistributedSampler

from ddp_lab.verify.findings import analyse, comm_per_step, data_coverage, replica_divergence


def passes(n, world, epochs=2, set_epoch=True, rank_of=lambda r: r, step_per_pass=2):
    """Pass records as the observer writes them, from a real DistributedSampler per rank."""
    records = {}
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank_of(r), shuffle=True, seed=0)
        recs = []
        for e in range(epochs):
            if set_epoch:
                s.set_epoch(e)
            order = list(s)
            recs.append({"kind": "pass", "loader": 0, "pass": e, "step": e * step_per_pass, "dataset_len": n,
                         "subset": False, "batch_size": 4, "drop_last": False, "count": len(order),
                         "indices": order,
                         "sampler": {"type": "DistributedSampler", "rank": rank_of(r), "num_replicas": world,
                                     "epoch": s.epoch, "shuffle": True, "drop_last": False, "seed": 0}})
        recs.append(step(epochs * step_per_pass))
        records[r] = recs
    return records


def step(n, rounds=1, params=None, buffers=None, lr=0.1, broadcast=True, ddp=1):
    return {"kind": "step", "step": n, "rounds": rounds, "buckets": rounds, "bytes": 40 * rounds, "ddp": ddp,
            "broadcast_buffers": broadcast, "params": params or {"w": "a"}, "buffers": buffers or {},
            "lr": [lr]}


def test_padding_of_an_uneven_sampler_is_not_an_overlap():
    notes = []
    assert data_coverage(passes(10, 3), 3, notes) == []  # 10 on 3 ranks: 2 padded samples repeated
    assert notes == []


def test_missing_set_epoch_is_found_at_the_second_pass():
    (f,) = data_coverage(passes(16, 2, set_epoch=False), 2, [])
    assert (f.category, f.rank, f.step) == ("data-coverage", 0, 3)
    assert "set_epoch" in f.fix


def test_local_rank_as_rank_names_the_sampler():
    (f,) = data_coverage(passes(16, 2, rank_of=lambda r: 0), 2, [])
    assert f.rank == 1 and "DistributedSampler(rank=0, num_replicas=2) on rank 1" in f.message


def test_an_evaluation_loader_is_not_a_training_loader():
    records = passes(16, 2)
    for r, recs in records.items():  # rank 0 evaluates on everything after training: no step in it
        recs.insert(-1, {**recs[0], "loader": 1, "pass": 0, "step": 4, "indices": list(range(16)),
                         "sampler": {"type": "SequentialSampler"}})
    assert data_coverage(records, 2, []) == []


def test_one_pass_is_said_not_compared():
    notes = []
    assert data_coverage(passes(16, 2, epochs=1), 2, notes) == []
    assert "one pass" in notes[0]


def test_buffers_count_only_without_broadcast_buffers():
    def records(broadcast):
        return {0: [step(1, buffers={"bn.running_mean": "x"}, broadcast=broadcast)],
                1: [step(1, buffers={"bn.running_mean": "y"}, broadcast=broadcast)]}
    assert replica_divergence(records(True), []) == []
    (f,) = replica_divergence(records(False), [])
    assert (f.rank, f.step) == (1, 1) and "bn.running_mean" in f.message


def test_the_first_diverging_step_is_named():
    recs = {0: [step(1), step(2, params={"w": "b", "v": "c"})], 1: [step(1), step(2, params={"w": "b", "v": "d"})]}
    (f,) = replica_divergence(recs, [])
    assert (f.rank, f.step) == (1, 2) and f.message.endswith(": v")


def test_no_all_reduce_before_a_step_and_a_warm_up_step():
    warm = step(1, rounds=0, ddp=0)
    assert comm_per_step({0: [warm, step(2), step(3)]}, []) == []  # a warm-up before DDP is no finding
    (f,) = comm_per_step({0: [warm, step(2), step(3, rounds=0)]}, [])
    assert f.step == 3 and "no gradient all-reduce" in f.message
    (f,) = comm_per_step({0: [step(1, rounds=0, ddp=0)]}, [])
    assert "no DistributedDataParallel model" in f.message


def test_analyse_of_a_healthy_run_is_empty():
    assert analyse(passes(16, 2), 2, []) == []
