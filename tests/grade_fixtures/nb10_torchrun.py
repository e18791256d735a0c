"""10.5: right torchrun arguments for a cluster and the wrong ones, each with the hint it must get."""


def good(nnodes, gpus_per_node, node_rank, master_addr, master_port):
    return [f"--nnodes={nnodes}", f"--nproc_per_node={gpus_per_node}", f"--node_rank={node_rank}",
            f"--master_addr={master_addr}", f"--master_port={master_port}"]


def world_size_per_node(nnodes, gpus_per_node, node_rank, master_addr, master_port):
    return good(nnodes, nnodes * gpus_per_node, node_rank, master_addr, master_port)


def same_node_rank(nnodes, gpus_per_node, node_rank, master_addr, master_port):
    return good(nnodes, gpus_per_node, 0, master_addr, master_port)


def localhost(nnodes, gpus_per_node, node_rank, master_addr, master_port):
    return ["--nnodes", nnodes, "--nproc_per_node", gpus_per_node, "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"localhost:{master_port}"]


def standalone(nnodes, gpus_per_node, node_rank, master_addr, master_port):
    return ["--standalone", f"--nproc_per_node={gpus_per_node}"]


MISTAKES = {
    "world size per node": (world_size_per_node, "torchrun wants the processes per node"),
    "node_rank 0 everywhere": (same_node_rank, "each node passes its own --node_rank"),
    "localhost rendezvous": (localhost, "every node must reach the same address"),
    "standalone": (standalone, "--standalone starts a single-node job"),
}
