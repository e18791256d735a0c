"""07.1: a right diff_tensors and the wrong ones, each with the hint it must get."""
import torch

from ddp_lab.lessons import troubleshooting

BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def good(a, b):
    return [name for name in a if troubleshooting.tensor_hash(a[name]) != troubleshooting.tensor_hash(b[name])]


def with_a_tolerance(a, b):
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or not torch.allclose(a[n], b[n])]


def shapes_only(a, b):
    return [n for n in a if a[n].shape != b[n].shape]


def first_difference_only(a, b):
    return good(a, b)[:1]


def parameters_only(a, b):
    return [n for n in good(a, b) if not n.endswith(BUFFERS)]


def torch_equal(a, b):
    return [n for n in a if not torch.equal(a[n], b[n])]


def storage_bytes(a, b):
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or bytes(a[n].untyped_storage()) != bytes(b[n].untyped_storage())]


MISTAKES = {
    "torch.allclose": (with_a_tolerance, "a tolerance"),
    "shapes only": (shapes_only, "compares only the shapes"),
    "first difference only": (first_difference_only, "only the first name"),
    "buffers ignored": (parameters_only, "buffers included"),
    "torch.equal, dtype unseen": (torch_equal, "hashes the dtype too"),
    "storage bytes, layout counted": (storage_bytes, "memory layout"),
}
