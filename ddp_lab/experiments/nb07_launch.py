"""Notebook 07, deep dives on launch failures and wrong identity: rendezvous failures,
GLOO_SOCKET_IFNAME, and wrong identity.

    torchrun --nnodes 2 --node_rank N --master_addr HOST --master_port PORT --nproc_per_node 1 \
        -m ddp_lab.experiments.nb07_launch SHARED_DIR

Launched as two simulated nodes of one process each, so that LOCAL_RANK is 0 on both ranks.
The rendezvous failures are reproduced at the layer torchrun itself uses (a TCPStore, the
rendezvous of env:// and static launches), each on a private port with a 3 s timeout, so the
messages are the ones torchrun prints, in seconds instead of torchrun's 15-minute default.
Last, wrapping in DDP with device_ids before moving the model to its GPU (section 8).
Every case is recorded (kind="case") with the error it raised, or None.
"""
import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist

from ddp_lab.engine import runtime

T = datetime.timedelta(seconds=3)


def port_in_use(ctx):
    with socket.socket() as busy:              # another job (or a stale run) holds the port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        dist.TCPStore("127.0.0.1", busy.getsockname()[1], 2, is_master=True, timeout=T)


def nobody_listening(ctx):                      # wrong MASTER_PORT, or the master is not up
    dist.TCPStore("127.0.0.1", runtime._free_port(), 2, is_master=False, timeout=T)


def unknown_host(ctx):                          # a typo in MASTER_ADDR
    dist.TCPStore("no-such-host.invalid", 29500, 2, is_master=False, timeout=T)


def half_the_nodes(ctx):                        # --nnodes 2, only one node started
    dist.TCPStore("127.0.0.1", runtime._free_port(), 2, is_master=True, timeout=T, wait_for_workers=True)


def ddp_before_to(ctx):                         # DDP(model, device_ids=[...]) with the model still on the CPU
    from torch.nn.parallel import DistributedDataParallel as DDP
    DDP(torch.nn.Linear(2, 2), device_ids=[ctx.local_rank])


def ifname(value):
    def case(ctx):
        os.environ["GLOO_SOCKET_IFNAME"] = value
        try:
            g = dist.new_group(backend="gloo", timeout=T)
            x = torch.ones(1)
            dist.all_reduce(x, group=g)
            return {"sum": x.item()}
        finally:
            del os.environ["GLOO_SOCKET_IFNAME"]
    return case


def identity(ctx, folder):
    """Each rank saves 'its' shard, named by LOCAL_RANK (the bug) and by RANK (the fix)."""
    for turn in range(ctx.world_size):          # one rank at a time: rank 1 writes last
        if turn == ctx.rank:
            for scheme, idx in (("local_rank", ctx.local_rank), ("rank", ctx.rank)):
                os.makedirs(os.path.join(folder, scheme), exist_ok=True)
                torch.save({"written_by_rank": ctx.rank}, os.path.join(folder, scheme, f"shard_{idx}.pt"))
        dist.barrier()
    return {"local_rank": ctx.local_rank,
            "files": {s: sorted(os.listdir(os.path.join(folder, s))) for s in ("local_rank", "rank")}}


# Rank 0 runs the first pair while rank 1 runs the second (each waits out its timeouts alone);
# then both ranks run the GLOO_SOCKET_IFNAME cases, which build a group together.
ALONE = [[("port_in_use", port_in_use), ("nobody_listening", nobody_listening)],
         [("unknown_host", unknown_host), ("half_the_nodes", half_the_nodes)]]
TOGETHER = [("ifname_lo", ifname("lo")), ("ifname_missing", ifname("nosuch0")),
            ("ddp_before_to", ddp_before_to)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shared_dir", help="a folder both simulated nodes can write (section 8's files)")
    folder = parser.parse_args(argv).shared_dir
    with runtime.distributed() as ctx:
        for cases in (ALONE[ctx.rank % 2], TOGETHER):
            for name, case in cases:
                try:
                    out, error = case(ctx) or {}, None
                except Exception as exc:
                    out, error = {}, f"{type(exc).__name__}: {exc}"
                ctx.record(kind="case", case=name, error=error, **out)
            dist.barrier()
        ctx.record(kind="case", case="identity", error=None, **identity(ctx, folder))


if __name__ == "__main__":
    main()
