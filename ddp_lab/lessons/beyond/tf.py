"""TensorFlow's tf.distribute and Horovod, mapped to DDP and torchrun (notebook 09b, section 7).

    from ddp_lab.lessons.beyond import tf as beyond_tf
    beyond_tf.markdown()          # the side-by-side table, as Markdown
    beyond_tf.unresolved()        # PyTorch names in the table that this torch does not have ([] = all real)
    beyond_tf.uncovered()         # names the survey's lines use that the table lacks ([] = all covered)

SURVEY_LINES holds the survey article's lines that name a TensorFlow/Horovod API, verbatim;
survey_names() extracts the names from them and uncovered() lists those MAPPING lacks ([] = all).
MAPPING gives each name its PyTorch counterpart and the torch object that implements it (a dotted
name resolved against the installed torch, so a renamed or removed API shows up).
"""
from __future__ import annotations

import importlib

# Every line of the survey article that names a TensorFlow or Horovod API (a grep for PATTERN over
# the article, kept verbatim, in order, each line once): survey_names() reads the names from here,
# independently of MAPPING, and tests/test_beyond_tf.py checks the lines against the article itself.
SURVEY_LINES = (
    '• TensorFlow MultiWorkerMirroredStrategy 实战',
    'TensorFlow 主要通过 tf.distribute.Strategy 实现分布式训练。',
    '• MirroredStrategy',
    '• MultiWorkerMirroredStrategy',
    '• TPUStrategy',
    '• ParameterServerStrategy',
    '1. MirroredStrategy',
    'MirroredStrategy 适用于单机多 GPU。',
    'strategy = tf.distribute.MirroredStrategy()',
    'print("设备数量:", strategy.num_replicas_in_sync)',
    'with strategy.scope():',
    'model = tf.keras.Sequential([',
    'tf.keras.layers.Input(shape=(224, 224, 3)),',
    'tf.keras.layers.Conv2D(32, 3, activation="relu"),',
    'tf.keras.layers.MaxPooling2D(),',
    'tf.keras.layers.Conv2D(64, 3, activation="relu"),',
    'tf.keras.layers.GlobalAveragePooling2D(),',
    'tf.keras.layers.Dense(10, activation="softmax")',
    'model.compile(',
    'optimizer=tf.keras.optimizers.Adam(learning_rate=1e-3),',
    'model.fit(',
    'MirroredStrategy 会自动完成：',
    'num_replicas = strategy.num_replicas_in_sync',
    'train_dataset = tf.keras.utils.image_dataset_from_directory(',
    'train_dataset = train_dataset.prefetch(',
    'tf.data.AUTOTUNE',
    '3. MultiWorkerMirroredStrategy',
    'strategy = tf.distribute.MultiWorkerMirroredStrategy()',
    'TensorFlow 需要通过 TF_CONFIG 描述集群拓扑。',
    "export TF_CONFIG='{",
    'optimizer=tf.keras.optimizers.Adam(),',
    'loss=tf.keras.losses.SparseCategoricalCrossentropy(),',
    'optimizer = tf.keras.optimizers.Adam()',
    'loss_object = tf.keras.losses.SparseCategoricalCrossentropy(',
    'reduction=tf.keras.losses.Reduction.NONE',
    'return tf.nn.compute_average_loss(',
    '@tf.function',
    'with tf.GradientTape() as tape:',
    'optimizer.apply_gradients(',
    'per_replica_losses = strategy.run(',
    'return strategy.reduce(',
    'tf.distribute.ReduceOp.SUM,',
    'strategy.run(...)',
    'strategy.reduce(...)',
    'hvd.init()',
    'local_rank = hvd.local_rank()',
    'lr=1e-3 * hvd.size()',
    'optimizer = hvd.DistributedOptimizer(',
    'hvd.broadcast_parameters(',
    'hvd.broadcast_optimizer_state(',
    'rank = hvd.rank()',
    'world_size = hvd.size()',
    'horovodrun -np 4 -H localhost:4 python train_horovod.py',
    'mpirun -np 4 \\',
    'gpus = tf.config.list_physical_devices("GPU")',
    'tf.config.set_visible_devices(',
    'gpus[hvd.local_rank()],',
    'optimizer = tf.keras.optimizers.Adam(',
    'learning_rate=0.001 * hvd.size()',
    'hvd.callbacks.BroadcastGlobalVariablesCallback(',
    'hvd.callbacks.MetricAverageCallback()',
    'if hvd.rank() == 0:',
    'tf.keras.callbacks.ModelCheckpoint(',
    'model.save("model.h5")',
    '• 使用 tf.data 数据管道的项目',
    '• TensorFlow 项目优先使用 tf.distribute',
)
PATTERN = r"\b(?:tf|hvd|strategy)\.[A-Za-z_][\w.]*|\bmodel\.(?:fit|compile|save)\b|\.(?:apply_gradients|prefetch)\b|\b(?:horovodrun|mpirun|TF_CONFIG|\w+Strategy)\b"


def survey_names() -> list[str]:
    """The API names in SURVEY_LINES, in order of first use (methods without their object)."""
    import re
    names = []
    for line in SURVEY_LINES:
        for m in re.findall(PATTERN, line):
            name = m.lstrip(".")
            if name not in names:
                names.append(name)
    return names


def uncovered() -> list[str]:
    """Survey names with no row in MAPPING. A bare class name (MirroredStrategy) counts as covered
    by its dotted row (tf.distribute.MirroredStrategy)."""
    return [n for n in survey_names() if n not in MAPPING and not any(k.endswith("." + n) for k in MAPPING)]


# api: (what it does, PyTorch counterpart, torch object that implements it or None for a CLI/idea)
MAPPING = {
    "tf.distribute": ("TensorFlow's distributed-training API", "torch.distributed, with DDP or FSDP on top",
                      "torch.distributed"),
    "tf.distribute.Strategy": ("the base class every strategy shares",
                               "no common base: a wrapper around the model (DDP, or FSDP2's fully_shard)",
                               "torch.nn.parallel.DistributedDataParallel"),
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
    "tf.keras.losses.Reduction.NONE": (
        "per-example losses (Keras 2; Keras 3 has no Reduction enum: reduction=None)", "reduction='none'",
        "torch.nn.functional.cross_entropy"),
    "tf.keras.losses.SparseCategoricalCrossentropy": (
        "cross-entropy on integer labels", "nn.CrossEntropyLoss (takes logits: from_logits=True)",
        "torch.nn.CrossEntropyLoss"),
    "tf.keras.optimizers.Adam": ("Adam", "torch.optim.Adam", "torch.optim.Adam"),
    "tf.GradientTape": ("records the ops to differentiate", "autograd records every op; loss.backward()",
                        "torch.autograd.backward"),
    "apply_gradients": ("optimizer.apply_gradients(zip(grads, variables))",
                        "optimizer.step() (the gradients are already in p.grad)", "torch.optim.Optimizer.step"),
    "tf.function": ("trace the step into a graph", "torch.compile (optional)", "torch.compile"),
    "model.compile": ("attach optimizer, loss and metrics to a Keras model", "nothing: the loop names them", None),
    "model.fit": ("Keras' training loop", "your loop (or a trainer library)", None),
    "model.save": ("save the whole model (here on rank 0 only)",
                   "if rank == 0: torch.save(model.module.state_dict(), path) (notebook 06)", "torch.save"),
    "tf.keras.Sequential": ("a stack of layers", "nn.Sequential", "torch.nn.Sequential"),
    "tf.keras.layers.Input": ("declares the input shape", "nothing: shapes come with the first batch", None),
    "tf.keras.layers.Conv2D": ("2-D convolution (channels last)", "nn.Conv2d (channels first)",
                               "torch.nn.Conv2d"),
    "tf.keras.layers.MaxPooling2D": ("max pooling", "nn.MaxPool2d", "torch.nn.MaxPool2d"),
    "tf.keras.layers.GlobalAveragePooling2D": ("mean over height and width", "nn.AdaptiveAvgPool2d(1) + flatten",
                                               "torch.nn.AdaptiveAvgPool2d"),
    "tf.keras.layers.Dense": ("fully connected layer", "nn.Linear", "torch.nn.Linear"),
    "tf.config.list_physical_devices": ("the GPUs TensorFlow sees", "torch.cuda.device_count()",
                                        "torch.cuda.device_count"),
    "tf.config.set_visible_devices": ("let this process see only its GPU",
                                      "torch.cuda.set_device(local_rank) before the first CUDA op",
                                      "torch.cuda.set_device"),
    "tf.data": ("the input pipeline", "torch.utils.data: Dataset + DataLoader", "torch.utils.data.DataLoader"),
    "tf.keras.utils.image_dataset_from_directory": (
        "a batched image dataset from class folders",
        "torchvision.datasets.ImageFolder + DataLoader(batch_size=per-rank, sampler=DistributedSampler)",
        "torch.utils.data.DataLoader"),
    "prefetch": ("dataset.prefetch(n): prepare the next batches while the step runs",
                 "DataLoader(num_workers=k, prefetch_factor=n, pin_memory=True)", "torch.utils.data.DataLoader"),
    "tf.data.AUTOTUNE": ("let TensorFlow pick the prefetch depth", "no auto-tuning: choose num_workers, prefetch_factor",
                         "torch.utils.data.DataLoader"),
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
        "Keras: broadcast initial variables (horovod.keras / horovod.tensorflow.keras, not horovod.tensorflow)", "DDP's broadcast at construction",
        "torch.nn.parallel.DistributedDataParallel"),
    "hvd.callbacks.MetricAverageCallback": (
        "average metrics over workers", "dist.all_reduce(metric) / world size (notebook 02)",
        "torch.distributed.all_reduce"),
    "tf.keras.callbacks.ModelCheckpoint": ("save every epoch (the survey: on hvd.rank() == 0 only)",
                                           "if rank == 0: torch.save(...) (notebook 06)", "torch.save"),
    "horovodrun": ("horovodrun -np 4 -H localhost:4: start 4 processes", "torchrun --nproc_per_node=4",
                   "torch.distributed.run"),
    "mpirun": ("mpirun -np 4: MPI starts the processes", "torchrun, or srun on SLURM (notebook 10)",
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
