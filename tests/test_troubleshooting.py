"""ddp_lab.lessons.troubleshooting: the replica check and the NaN check of notebook 07.

The unit tests need no process group; what the two checks report on 2 ranks (nb07_ddp) is asserted
in notebook 07, on every rank.
"""
import torch
from torch import nn

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
