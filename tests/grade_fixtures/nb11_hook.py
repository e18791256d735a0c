"""11.2: a right bf16 compression hook and the wrong ones, each with the hint it must get."""
import torch
import torch.distributed as dist


def good(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


def no_division(state, bucket):
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


def uncompressed(state, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def not_copied_back(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    dist.all_reduce(compressed)                  # averaged, but into a copy that is then dropped
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def no_all_reduce(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def in_float64(state, bucket):  # divided in float64, sent in bf16 all the same
    buffer = bucket.buffer()
    compressed = buffer.double().div_(dist.get_world_size()).to(torch.bfloat16)
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer
    return fut.then(decompress)


PRECISIONS = {"float32": good, "float64": in_float64}


MISTAKES = {
    "no division": (no_division, "divide by the world size"),
    "fp32 sent": (uncompressed, "not the buffer itself"),
    "result not copied back": (not_copied_back, "decompress it back into it"),
    "no all_reduce": (no_all_reduce, "never called dist.all_reduce"),
}
