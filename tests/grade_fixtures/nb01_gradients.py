"""01.4: a right gradient average and the wrong ones, each with the hint it must get."""
import torch.distributed as dist


def good(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def forgets_to_divide(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def weights_only(model):
    for p in model.parameters():
        if p.dim() > 1:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def divides_without_reducing(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def in_float64(model):  # the sum in float64, copied back into the float32 gradient
    for p in model.parameters():
        g = p.grad.double()
        dist.all_reduce(g)
        p.grad.copy_(g / dist.get_world_size())


PRECISIONS = {"float32": good, "float64": in_float64}


MISTAKES = {
    "forgets to divide": (forgets_to_divide, "divide the all-reduced sum by the world size"),
    "weights only, no biases": (weights_only, "gradient of `0.bias` is still this rank's own"),
    "divides without all-reducing": (divides_without_reducing, "all-reduce it before dividing"),
}
