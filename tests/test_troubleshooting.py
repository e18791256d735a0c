"""ddp_lab.lessons.troubleshooting: the replica check and the NaN check of notebook 07.

The unit tests need no process group; the program test launches nb07_ddp on 2 ranks and checks
what the two checks reported there against what each case did to the replicas.
"""
import torch
from torch import nn

from ddp_lab.engine import launch
from ddp_lab.lessons.troubleshooting import ReplicaReport, finite_everywhere, replica_check, tensor_hash


def test_tensor_hash_sees_the_last_bit_and_the_shape():
    t = torch.linspace(-1, 1, 12)
    nudged = t.clone()
    nudged[5] = torch.nextafter(nudged[5], torch.tensor(2.0))
    assert tensor_hash(t) == tensor_hash(t.clone())
    assert tensor_hash(t) != tensor_hash(nudged)
    assert tensor_hash(t) != tensor_hash(t.reshape(3, 4))      # same bytes, other shape
    assert tensor_hash(t) != tensor_hash(t.double())
    assert tensor_hash(torch.tensor(3)) != tensor_hash(torch.tensor(4))   # 0-dim (num_batches_tracked)
    assert 0 <= tensor_hash(t) < 2**63


def test_without_a_process_group_the_checks_are_a_world_of_one():
    assert replica_check(nn.BatchNorm1d(3)).ok
    assert replica_check(nn.BatchNorm1d(3), buffers=False).unchecked == ["running_mean", "running_var",
                                                                         "num_batches_tracked"]
    assert finite_everywhere(torch.tensor(1.0)) == (True, [])
    assert finite_everywhere(torch.tensor([1.0, float("nan")])) == (False, [0])
    assert finite_everywhere(torch.tensor(1.0), torch.tensor(float("inf"))) == (False, [0])


def test_report_names_ranks_and_tensors():
    text = str(ReplicaReport(False, [1, 3], ["a.weight", "bn.running_mean"], 4))
    assert "[1, 3]" in text and "bn.running_mean" in text
    assert str(ReplicaReport(True, world_size=4)) == "all 4 replicas are identical"
    assert "2 buffers not compared" in str(ReplicaReport(True, world_size=2, unchecked=["a", "b"]))


def test_checks_in_a_two_rank_job():
    run = launch.torchrun("-m ddp_lab.experiments.nb07_ddp", nproc=2, timeout=180, stream=False)
    case = {(r["case"], r["rank"]): r for r in run.select(kind="case")}
    model_tensors = list(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).state_dict())
    for rank in (0, 1):
        bug = case["one_rank_step", rank]["bug"]
        assert bug["differing_ranks"] == [1] and bug["differing_tensors"] == model_tensors
        assert case["one_rank_step", rank]["fixed"]["ok"]
        assert "ready only once" in case["reentrant", rank]["use_reentrant_True"]
        assert case["reentrant", rank]["use_reentrant_True_static_graph"] == "all 2 replicas are identical"
        bn = case["bn_buffers", rank]
        assert bn["broadcast_False"]["default"]["differing_tensors"] == ["1.running_mean", "1.running_var"]
        assert bn["broadcast_True"]["default"]["ok"]                       # no alarm on the fix
        assert bn["broadcast_True"]["after_next_forward"]["ok"]
        nan = case["nan", rank]
        assert not nan["unchecked"]["params_finite"]
        for guard in ("finite_everywhere", "grad_norm"):
            assert [s["step"] for s in nan[guard]["skipped"]] == [1]       # every rank skipped step 1
            assert nan[guard]["params_finite"] and nan[guard]["identical"]
        assert nan["finite_everywhere"]["skipped"][0]["bad_ranks"] == [1]
        assert case["release", rank]["alive_after_collect"] == 0
