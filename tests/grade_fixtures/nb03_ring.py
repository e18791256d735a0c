"""03.5: a right answer and the wrong ones learners give, each with the hint it must get."""
import torch
import torch.distributed as dist


def _ring(tensor, right_of, left_of, divide=True):
    n, me = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            send_i = (me - s) % n if phase == "reduce-scatter" else (me + 1 - s) % n
            recv_i = (send_i - 1) % n
            inbox = torch.empty_like(chunks[recv_i])
            req = dist.isend(chunks[send_i].contiguous(), right_of(me, n))
            dist.recv(inbox, left_of(me, n))
            req.wait()
            if phase == "reduce-scatter":
                chunks[recv_i].add_(inbox)
            else:
                chunks[recv_i].copy_(inbox)
    return tensor / n if divide else tensor


def right(me, n):
    return (me + 1) % n


def left(me, n):
    return (me - 1) % n


def good(tensor):
    return _ring(tensor, right, left)


def forgets_to_divide(tensor):
    return _ring(tensor, right, left, divide=False)


def sends_the_wrong_way(tensor):  # sends left, receives from the right, chunks as for a right ring
    return _ring(tensor, left, right)


def same_side(tensor):  # sends to and receives from the right neighbour: nobody sends to it
    return _ring(tensor, right, right)


def whole_tensors(tensor):  # the unchunked ring: right sum, (N-1)·S bytes per rank
    n, me = dist.get_world_size(), dist.get_rank()
    total, passing = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        inbox = torch.empty_like(passing)
        req = dist.isend(passing, (me + 1) % n)
        dist.recv(inbox, (me - 1) % n)
        req.wait()
        total += inbox
        passing = inbox
    return total / n


def library(tensor):
    dist.all_reduce(tensor)
    return tensor / dist.get_world_size()


def in_float32(tensor):  # the float64 input averaged in float32: half the bytes, the same chunks
    return _ring(tensor.float(), right, left)


PRECISIONS = {"float32": in_float32, "float64": good}


MISTAKES = {  # label: (answer, a phrase the hint must contain); a hang comes last
    "forgets to divide": (forgets_to_divide, "did you divide by the world size"),
    "whole tensors": (whole_tensors, "instead of chunks"),
    "uses dist.all_reduce": (library, "called dist.all_reduce"),
    "sends the wrong way": (sends_the_wrong_way, "its left neighbour (rank - 1) % world sends"),
    "same side (hangs)": (same_side, "sending to and receiving from the same side deadlocks"),
}
