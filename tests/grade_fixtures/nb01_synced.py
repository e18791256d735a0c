"""01.5: a right list of synchronised tensors and the wrong ones, each with the hint it must get."""


def good(names, broadcast_buffers):
    stats = ("running_mean", "running_var")
    return [n for n in names if broadcast_buffers or not n.endswith(stats)]


def everything(names, broadcast_buffers):
    return list(names)


def parameters_only(names, broadcast_buffers):
    return [n for n in names if n.endswith(("weight", "bias"))]


def stats_only_with_flag(names, broadcast_buffers):
    return [n for n in names if broadcast_buffers or n.endswith(("weight", "bias"))]


MISTAKES = {
    "everything, whatever the flag": (everything, "each rank's running statistics follow its own data"),
    "parameters only": (parameters_only, "DDP copies rank 0's buffers to every rank"),
    "num_batches_tracked forgotten": (stats_only_with_flag, "num_batches_tracked counts the forwards"),
}
