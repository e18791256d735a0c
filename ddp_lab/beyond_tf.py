"""TensorFlow's tf.distribute and Horovod, mapped to DDP and torchrun (notebook 09, section 6).

    from ddp_lab import beyond_tf
    beyond_tf.markdown()          # the side-by-side table, as Markdown
    beyond_tf.unresolved()        # PyTorch names in the table that this torch does not have ([] = all real)

SURVEY_APIS lists every TensorFlow/Horovod name the survey article's sections 4-5 use, as it spells
them; MAPPING gives each one its PyTorch counterpart and the torch object that implements it (a
dotted name resolved against the installed torch, so a renamed or removed API shows up).
"""
from __future__ import annotations

import importlib

SURVEY_APIS = (
    "tf.distribute.MirroredStrategy", "tf.distribute.MultiWorkerMirroredStrategy", "TPUStrategy",
    "ParameterServerStrategy", "strategy.scope", "strategy.num_replicas_in_sync", "global_batch_size",
    "TF_CONFIG", "strategy.run", "strategy.reduce", "tf.distribute.ReduceOp.SUM",
    "tf.nn.compute_average_loss", "Reduction.NONE", "model.fit",
    "hvd.init", "hvd.rank", "hvd.local_rank", "hvd.size", "hvd.DistributedOptimizer",
    "hvd.broadcast_parameters", "hvd.broadcast_optimizer_state", "lr * hvd.size()",
    "hvd.callbacks.BroadcastGlobalVariablesCallback", "hvd.callbacks.MetricAverageCallback",
    "ModelCheckpoint on hvd.rank() == 0", "horovodrun -np 4 -H localhost:4", "mpirun -np 4",
)

# api: (what it does, PyTorch counterpart, torch object that implements it or None for a CLI/idea)
MAPPING = {
    "tf.distribute.MirroredStrategy": (
        "one process drives every GPU of a machine; all-reduce of gradients",
        "DDP, one process per device (the one-process design is nn.DataParallel's, minus its master GPU)",
        "torch.nn.parallel.DistributedDataParallel"),
    "tf.distribute.MultiWorkerMirroredStrategy": (
        "the same over several machines", "DDP + torchrun --nnodes", "torch.distributed.run"),
    "TPUStrategy": ("data parallel on TPU cores", "torch_xla (not part of torch)", None),
    "ParameterServerStrategy": (
        "workers push gradients to parameter servers, asynchronously",
        "no DDP mode: torch.distributed.rpc builds one by hand", "torch.distributed.rpc"),
    "strategy.scope": ("variables created inside are mirrored", "build the model, then wrap it: DDP(model)",
                       "torch.nn.parallel.DistributedDataParallel"),
    "strategy.num_replicas_in_sync": ("number of replicas", "dist.get_world_size()",
                                      "torch.distributed.get_world_size"),
    "global_batch_size": ("TF batches the global batch and splits it",
                          "DataLoader(batch_size=per-rank) + DistributedSampler; global = per-rank x world",
                          "torch.utils.data.distributed.DistributedSampler"),
    "TF_CONFIG": ("JSON: cluster addresses and this task's index",
                  "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (torchrun sets them); init_method='env://'",
                  "torch.distributed.init_process_group"),
    "strategy.run": ("run the step on every replica", "every rank runs the step itself (SPMD)", None),
    "strategy.reduce": ("combine per-replica values", "dist.all_reduce (every rank gets the result)",
                        "torch.distributed.all_reduce"),
    "tf.distribute.ReduceOp.SUM": ("sum", "dist.ReduceOp.SUM", "torch.distributed.ReduceOp"),
    "tf.nn.compute_average_loss": (
        "sum of per-example losses / global batch", "loss.mean() on the local batch: DDP averages over ranks",
        "torch.nn.functional.cross_entropy"),
    "Reduction.NONE": ("per-example losses", "reduction='none'", "torch.nn.functional.cross_entropy"),
    "model.fit": ("Keras' training loop", "your loop (or a trainer library)", None),
    "hvd.init": ("start Horovod (MPI/Gloo)", "dist.init_process_group", "torch.distributed.init_process_group"),
    "hvd.rank": ("global rank", "dist.get_rank()", "torch.distributed.get_rank"),
    "hvd.local_rank": ("rank on this machine", "int(os.environ['LOCAL_RANK'])", None),
    "hvd.size": ("number of processes", "dist.get_world_size()", "torch.distributed.get_world_size"),
    "hvd.DistributedOptimizer": (
        "all-reduces (averages) gradients before step()", "DDP: bucketed all-reduce during backward()",
        "torch.nn.parallel.DistributedDataParallel"),
    "hvd.broadcast_parameters": (
        "copy rank 0's weights to all", "DDP does it when it wraps the model (and buffers every forward)",
        "torch.nn.parallel.DistributedDataParallel"),
    "hvd.broadcast_optimizer_state": (
        "copy rank 0's optimizer state to all", "nothing in DDP: dist.broadcast_object_list by hand "
        "(or load the checkpoint on every rank, notebook 06)", "torch.distributed.broadcast_object_list"),
    "lr * hvd.size()": ("linear learning-rate scaling", "lr * dist.get_world_size() (notebook 05: with warm-up)",
                        "torch.distributed.get_world_size"),
    "hvd.callbacks.BroadcastGlobalVariablesCallback": (
        "Keras: broadcast initial variables", "DDP's broadcast at construction",
        "torch.nn.parallel.DistributedDataParallel"),
    "hvd.callbacks.MetricAverageCallback": (
        "average metrics over workers", "dist.all_reduce(metric) / world size (notebook 02)",
        "torch.distributed.all_reduce"),
    "ModelCheckpoint on hvd.rank() == 0": ("only rank 0 writes", "if rank == 0: torch.save(...) (notebook 06)",
                                           "torch.save"),
    "horovodrun -np 4 -H localhost:4": ("start 4 processes", "torchrun --nproc_per_node=4",
                                        "torch.distributed.run"),
    "mpirun -np 4": ("MPI starts the processes", "torchrun, or srun on SLURM (notebook 10)",
                     "torch.distributed.run"),
}


def resolve(dotted: str):
    """The object a dotted name points to in the installed packages (ImportError/AttributeError if none)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def unresolved() -> list[str]:
    """Torch names in MAPPING that the installed torch lacks."""
    bad = []
    for api, (_, _, target) in MAPPING.items():
        if target is None:
            continue
        try:
            resolve(target)
        except (ImportError, AttributeError):
            bad.append(f"{api} -> {target}")
    return bad


def markdown() -> str:
    rows = ["| TensorFlow / Horovod | what it does | PyTorch | implemented by |", "|---|---|---|---|"]
    for api, (does, torch_side, target) in MAPPING.items():
        rows.append(f"| `{api}` | {does} | {torch_side} | {f'`{target}`' if target else '-'} |")
    return "\n".join(rows)
