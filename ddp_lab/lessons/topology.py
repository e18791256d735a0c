"""Nodes, devices, processes and ranks: the numbering torchrun uses, and a figure of it."""
from __future__ import annotations

from ddp_lab.lessons import plural


def rank_table(nnodes: int, nproc_per_node: int) -> list[dict]:
    """One row per process: global rank = node_rank * nproc_per_node + local_rank."""
    world_size = nnodes * nproc_per_node
    return [{"node": node, "local_rank": local, "rank": node * nproc_per_node + local,
             "world_size": world_size}
            for node in range(nnodes) for local in range(nproc_per_node)]


def draw(nnodes: int = 2, nproc_per_node: int = 4, device: str = "GPU", ax=None):
    """Boxes for nodes, one cell per device/process, labelled with local and global rank."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(2.1 * nproc_per_node * nnodes / 2 + 1.5, 2.6))
    w, gap = 1.0, 0.5
    node_w = nproc_per_node * w + 0.4
    for node in range(nnodes):
        x0 = node * (node_w + gap)
        ax.add_patch(FancyBboxPatch((x0, 0), node_w, 2.0, boxstyle="round,pad=0.05",
                                    fc="#eef3fb", ec="#4a6fa5", lw=1.5))
        ax.text(x0 + node_w / 2, 2.15, f"node {node} (node_rank={node})", ha="center",
                fontsize=10, weight="bold")
        for local in range(nproc_per_node):
            x = x0 + 0.2 + local * w
            rank = node * nproc_per_node + local
            ax.add_patch(Rectangle((x + 0.05, 0.2), w - 0.1, 1.5, fc="#ffd8a8" if rank == 0 else "white",
                                   ec="#e8590c", lw=1.2))
            ax.text(x + w / 2, 1.35, f"{device} {local}", ha="center", fontsize=8)
            ax.text(x + w / 2, 0.95, f"local_rank {local}", ha="center", fontsize=7, color="#555")
            ax.text(x + w / 2, 0.5, f"rank {rank}", ha="center", fontsize=10, weight="bold")
    ax.set_xlim(-0.2, nnodes * (node_w + gap))
    ax.set_ylim(-0.3, 2.5)
    ax.axis("off")
    ax.set_title(f"world_size = {plural(nnodes, 'node')} x {plural(nproc_per_node, 'process', 'processes')} = "
                 f"{nnodes * nproc_per_node}"
                 "   (one process per device; rank 0 shaded)", fontsize=10)
    return ax
