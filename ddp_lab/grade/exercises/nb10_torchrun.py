"""10.5: the torchrun arguments one node runs for a cluster layout; graded in the kernel.

The answer's arguments are read by torchrun's own parser (torch.distributed.run.get_args_parser),
and what torchrun would do with them is compared with the layout: N nodes of G GPUs.
"""
from ddp_lab.grade.core import Exercise, register

MASTER, PORT = "10.0.0.7", 29500
CASES = [(2, 8, 0), (2, 8, 1), (4, 4, 3)]  # (nodes, GPUs per node, this node's index)


def on_rank(answer, rank, world):
    from torch.distributed.run import get_args_parser
    out = []
    for nnodes, gpus, node in CASES:
        args = [str(a) for a in answer(nnodes, gpus, node, MASTER, PORT)]
        a = get_args_parser().parse_args(args + ["train.py"])
        out.append({"case": [nnodes, gpus, node], "args": " ".join(args), "nnodes": a.nnodes,
                    "nproc_per_node": a.nproc_per_node, "node_rank": a.node_rank,
                    "standalone": a.standalone, "backend": a.rdzv_backend, "endpoint": a.rdzv_endpoint,
                    "master": f"{a.master_addr}:{a.master_port}"})
    return {"cases": out}


def _findings(c):
    nnodes, gpus, node = c["case"]
    if c["standalone"]:
        yield "--standalone starts a single-node job on localhost: give --nnodes and a shared rendezvous"
    if c["nnodes"] not in (str(nnodes), f"{nnodes}:{nnodes}"):
        yield f"--nnodes is {c['nnodes']}: the number of nodes, {nnodes}"
    if str(c["nproc_per_node"]) != str(gpus):
        hint = " (that is the world size; torchrun wants the processes per node)" \
            if str(c["nproc_per_node"]) == str(nnodes * gpus) else ""
        yield f"--nproc_per_node is {c['nproc_per_node']}, should be {gpus}{hint}"
    if c["backend"] == "static" and c["node_rank"] != node:
        yield (f"--node_rank is {c['node_rank']} on node {node}: each node passes its own --node_rank "
               f"(0 to {nnodes - 1}), or every node would claim the same global ranks")
    where = c["master"] if c["backend"] == "static" else c["endpoint"]
    if not c["standalone"] and where.split(":")[0] != MASTER:
        yield (f"the rendezvous is at {where}: every node must reach the same address, node 0's "
               f"({MASTER}:{PORT}), not its own localhost")


def judge(per_rank):
    problems = []
    for c in per_rank[0]["cases"]:
        found = list(_findings(c))
        if found:
            n, g, node = c["case"]
            problems.append(f"{n} nodes x {g} GPUs, node {node}: `{c['args']}`: " + "; ".join(found))
    return problems[:2]


register(Exercise(
    id="10.5", notebook="10_laptop_to_cluster", title="torchrun for N nodes x G GPUs",
    skills="--nnodes, --nproc_per_node (per node), --node_rank (per node), one rendezvous address "
           "every node reaches",
    answer="torchrun_args(nnodes, gpus_per_node, node_rank, master_addr, master_port) -> list of arguments",
    nproc=0, on_rank=on_rank, judge=judge))
